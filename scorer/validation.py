"""The rules config values follow, and pydantic's errors in the project's words.

The config file (scorer/config.py) and the plugins' parameters (scorer/registry.py) are pydantic models and
dataclasses whose fields carry these rules, so that each error comes out as a ``ConfigError`` line that names the
field's path, shows the value (bounded by ``shown``) and says what would be valid::

    pool.endpoints[1].address: 'gpu-1:8000': 'gpu-1' is not a literal IP address (...)
    profiles.fast.scorers[2].weight must be a number in (0, 100]; got 0
    signals: unknown key 'stale_after' (allowed: gpu_interval_s, scrape_interval_s, ...)

`Parsed` (``Annotated`` metadata) sees a field's raw value first and returns what pydantic then validates; `must`,
`number`, `integer`, `one_of`, `TEXT` and `FLAG` are the common ones. `Section` is the base of the file's models and
dataclasses. A validator raises `invalid`; `config_error` turns a ``ValidationError`` into a ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, GetCoreSchemaHandler, GetJsonSchemaHandler, ValidationError, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

from inferlb.scorer.errors import ConfigError, shown

__all__ = [
    "FLAG",
    "TEXT",
    "Model",
    "Parsed",
    "Section",
    "config_error",
    "integer",
    "invalid",
    "must",
    "non_empty_list",
    "number",
    "one_of",
    "optional",
]

_ERROR = "inferlb"  # the type of the errors raised through `invalid`


def invalid(text: str, *at: str | int) -> PydanticCustomError:
    """An error whose message is the failing field's path followed by ``text`` (``" must be ..."`` or
    ``": ..."``); ``at`` is that field's place below the value being validated (a validator of ``signals`` that
    refuses ``stale_after_s`` passes ``"stale_after_s"``)."""
    return PydanticCustomError(_ERROR, "{text}", {"text": text, "at": at})


@dataclass(frozen=True, slots=True)
class Parsed:
    """``Annotated`` metadata: ``parse`` runs on the raw value before pydantic validates the field and returns what
    pydantic validates then (a canonical form, or the value). Its ``ValueError`` reads ``<path>: <message>``;
    `invalid` and nested validation errors pass as raised. ``schema``: JSON Schema keywords to add (pairs, as
    metadata must be hashable); ``input``: the type the JSON Schema describes instead of the field's."""

    parse: Callable[[Any], Any]
    schema: tuple[tuple[str, Any], ...] = ()
    input: Any = None
    # Whether ``parse`` takes None (`optional`): if not, the JSON Schema offers no null (unless ``input`` says).
    nullable: bool = False

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        described = None if self.input is None else handler.generate_schema(self.input)
        return core_schema.no_info_before_validator_function(
            self._run, handler(source), json_schema_input_schema=described
        )

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        described = handler(schema)
        if not self.nullable and self.input is None and "anyOf" in described:
            # The field's type allows None (its default: not set), but a null written in the file is refused.
            branches = [b for b in described["anyOf"] if b != {"type": "null"}]
            described = {**{k: v for k, v in described.items() if k != "anyOf"}, **_one_of(branches)}
        return {**described, **{k: list(v) if isinstance(v, tuple) else v for k, v in self.schema}}

    def _run(self, value: Any) -> Any:
        try:
            return self.parse(value)
        except (PydanticCustomError, ValidationError):
            raise
        except ValueError as exc:
            raise invalid(f": {exc}") from None


def must(what: str, test: Callable[[Any], bool], **schema: Any) -> Parsed:
    """Refuses a value ``test`` rejects: ``<path> must be <what>; got <value>``."""

    def check(value: Any) -> Any:
        if not test(value):
            raise invalid(f" must be {what}; got {shown(value)}")
        return value

    return Parsed(check, tuple(schema.items()))


def optional(rule: Parsed) -> Parsed:
    """``rule``, with None (YAML's ``null``) let through."""
    return Parsed(lambda value: None if value is None else rule.parse(value), rule.schema, nullable=True)


def _one_of(branches: list[JsonSchemaValue]) -> JsonSchemaValue:
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def non_empty_list(what: str) -> Parsed:
    return must(what, lambda value: isinstance(value, list) and bool(value), minItems=1)


def number(
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    inf: bool = False,
    noun: str = "a number",
) -> Parsed:
    """An int or a float (never a bool, never NaN; infinity only with ``inf``) within the bounds: "a number in
    0.001..3600" (both bounds inclusive), "a number in (0, 1]", "a number >= 0 or .inf"."""
    low, high = (gt if ge is None else ge), (lt if le is None else le)
    if ge is not None and le is not None:
        what = f"{noun} in {ge:g}..{le:g}"
    elif low is not None and high is not None:
        what = f"{noun} in {'(' if ge is None else '['}{low:g}, {high:g}{')' if le is None else ']'}"
    else:
        signs = ((">", gt), (">=", ge), ("<", lt), ("<=", le))
        what = " ".join([noun, *(f"{sign} {bound:g}" for sign, bound in signs if bound is not None)])

    def test(value: Any) -> bool:
        return (
            _is_number(value)
            and (inf or not math.isinf(value))
            and (gt is None or value > gt)
            and (ge is None or value >= ge)
            and (lt is None or value < lt)
            and (le is None or value <= le)
        )

    keywords = {"exclusiveMinimum": gt, "minimum": ge, "exclusiveMaximum": lt, "maximum": le}
    return must(f"{what} or .inf" if inf else what, test, **{k: v for k, v in keywords.items() if v is not None})


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def integer(*, ge: int | None = None, le: int | None = None, noun: str = "an integer") -> Parsed:
    """An int (never a bool) within the bounds: "an integer in 1..3600", "an integer >= 0", "an integer"."""
    what = noun if ge is None else f"{noun} >= {ge}" if le is None else f"{noun} in {ge}..{le}"

    def test(value: Any) -> bool:
        whole = isinstance(value, int) and not isinstance(value, bool)
        return whole and (ge is None or value >= ge) and (le is None or value <= le)

    keywords = {"minimum": ge, "maximum": le}
    return must(what, test, **{k: v for k, v in keywords.items() if v is not None})


def one_of(*choices: str) -> Parsed:
    """One of the strings ``choices``: "must be spans or stream", "must be none, otlp-grpc or otlp-http"."""
    what = " or ".join(choices) if len(choices) < 3 else f"{', '.join(choices[:-1])} or {choices[-1]}"
    return must(what, lambda value: isinstance(value, str) and value in choices, enum=choices)


TEXT = must("a non-empty string", lambda value: isinstance(value, str) and value != "", minLength=1)
FLAG = must("true or false", lambda value: isinstance(value, bool))


class Section:
    """The base of the file's models and dataclasses: before pydantic validates the fields, it refuses a value that
    is not a mapping, an unknown key (naming the allowed ones: a typo would otherwise be ignored) and a missing
    required key (saying what it is: the field's ``description`` in a model, ``metadata["description"]`` in a
    dataclass). A dataclass built in code is not validated."""

    __slots__ = ()
    __pydantic_config__ = ConfigDict(extra="forbid")  # dataclasses' (`Model` sets its own)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise invalid(f" must be a mapping; got {type(data).__name__}")
        keys = _keys(cls)
        unknown = sorted(str(key) for key in data if key not in keys)
        if unknown:
            raise invalid(f": unknown key {unknown[0]!r} (allowed: {', '.join(sorted(keys))})")
        for key, missing in keys.items():
            if missing is not None and key not in data:
                raise invalid(f" is required{f' ({missing})' if missing else ''}", key)
        return data


class Model(Section, BaseModel):
    """A `Section` that is a frozen pydantic model (the parts of the file that no other code builds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _keys(cls: type) -> Mapping[str, str | None]:
    """Each field of ``cls`` -> None when it is optional, else what to say when it is missing."""
    if issubclass(cls, BaseModel):
        return {name: (f.description or "") if f.is_required() else None for name, f in cls.model_fields.items()}
    missing = dataclasses.MISSING
    return {
        f.name: f.metadata.get("description", "") if f.default is missing and f.default_factory is missing else None
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
    }


def config_error(exc: ValidationError, where: str = "") -> ConfigError:
    """The ``ConfigError`` for ``exc``: one line per error, each starting with the field's path below ``where``."""
    return ConfigError("\n".join(_line(error, where) for error in exc.errors(include_url=False)))


_LISTS = {"list_type", "tuple_type", "set_type", "frozen_set_type"}  # pydantic's, for fields without a `must`


def _line(error: Any, where: str) -> str:
    ctx = error.get("ctx") or {}
    path = _path(where, (*error["loc"], *ctx.get("at", ())))
    if error["type"] == _ERROR:
        return f"{path}{ctx['text']}"
    if error["type"] in _LISTS or error["type"] == "dict_type":
        what = "a list" if error["type"] in _LISTS else "a mapping"
        return f"{path} must be {what}; got {type(error['input']).__name__}"
    message = error["msg"]
    return f"{path}: {message[:1].lower()}{message[1:]}; got {shown(error['input'])}"


def _path(where: str, loc: Sequence[str | int]) -> str:
    """``pool.endpoints[1].address`` for ``("pool", "endpoints", 1, "address")``; ``labels key`` for the key of a
    mapping (pydantic's ``(..., "labels", 3, "[key]")``); ``config`` for the document itself."""
    parts: list[str] = [where] if where else []
    for part in loc:
        if part == "[key]":
            parts[-1] = " key"
        else:
            parts.append(f"[{part}]" if isinstance(part, int) else f".{part}" if parts else part)
    return "".join(parts) or "config"
