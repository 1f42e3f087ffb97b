"""``inferlb config``: ``check FILE`` validates a picker config file as ``inferlb serve`` would (exit 0 and a
one-line summary, or every error found, one per line, and exit 2); ``schema`` prints the JSON Schema of the file,
for editors (yaml-language-server) and Helm values. Reads no token and connects to nothing; imports only the
config code (not the simulator or the benchmarks), so it is quick to run in CI or a pre-commit hook."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inferlb.scorer.errors import ConfigError

if TYPE_CHECKING:
    from inferlb.scorer.config import Config

__all__ = ["add_parser", "check", "main", "schema", "summary"]

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def add_parser(commands: Any) -> None:
    """Adds ``config`` to ``commands`` (an ``argparse`` subparsers object); each action sets ``run``."""
    config = commands.add_parser("config", help="check a picker config file, or print the file's JSON Schema")
    actions = config.add_subparsers(required=True, metavar="ACTION")
    check_ = actions.add_parser(
        "check", help="validate FILE: OK and a summary (exit 0), or its errors, each naming the field (exit 2)"
    )
    check_.add_argument("file", type=Path, metavar="FILE", help="picker config YAML")
    check_.set_defaults(run=lambda args: check(args.file))
    schema_ = actions.add_parser("schema", help="print the JSON Schema of the picker config file")
    schema_.set_defaults(run=lambda args: _print(json.dumps(schema(), indent=2)))


def main(argv: Sequence[str] | None = None) -> int:
    """``inferlb config ...`` on its own: ``main(["check", "picker.yaml"])``."""
    parser = argparse.ArgumentParser(prog="inferlb")
    add_parser(parser.add_subparsers(required=True, metavar="COMMAND"))
    args = parser.parse_args(["config", *(sys.argv[1:] if argv is None else argv)])
    result: int = args.run(args)
    return result


def check(path: Path) -> int:
    """Validates ``path``; prints OK and `summary` to stdout (returns 0) or the errors to stderr (returns 2)."""
    from inferlb.scorer.config import load_config  # not when the CLI builds its parser: see inferlb/cli.py

    try:
        config = load_config(path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    return _print(f"OK {path}: {summary(config)}")


def summary(config: Config) -> str:
    """One line: what the config routes where, e.g. "4 endpoints serving 2 models, policy default, 2 classes; listen
    127.0.0.1:9002, admin 127.0.0.1:9003, span receiver off"."""
    served = {m for e in config.endpoints for m in e.models or ()}
    models = "any model" if any(e.models is None for e in config.endpoints) else _count(len(served), "model")
    parts = [
        f"{_count(len(config.endpoints), 'endpoint')} serving {models}",
        f"policy {config.policy}" + (" (a profile of the file)" if config.policy in config.profiles else ""),
        _count(len(config.classes), "class", "classes"),
    ]
    where = [
        f"listen {config.listen}",
        f"admin {config.admin or 'off'}",
        f"span receiver {config.otel.receiver or 'off'}",
    ]
    return f"{', '.join(parts)}; {', '.join(where)}"


def schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the picker config file; every mapping refuses unknown keys."""
    from inferlb.scorer.config import ConfigFile

    return {"$schema": JSON_SCHEMA_DIALECT, **ConfigFile.model_json_schema()}


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _print(text: str) -> int:
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
