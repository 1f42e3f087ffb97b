"""Tests for inferlb/configcmd.py: ``inferlb config check`` on the repository's example configs and on bad files,
and ``inferlb config schema``: a JSON Schema that describes the example configs and refuses unknown keys."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferlb.cli import main
from inferlb.scorer.config import parse_config
from inferlb.scorer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _readme_config() -> str:
    """The YAML block of the README's "The picker: one YAML file" section."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("### The picker: one YAML file") :]
    match = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


EXAMPLES = [
    pytest.param((ROOT / "deploy" / "picker.example.yaml").read_text(encoding="utf-8"), id="deploy-example"),
    pytest.param(_readme_config(), id="readme"),
]


@pytest.mark.parametrize("text", EXAMPLES)
def test_the_example_configs_check_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(text, encoding="utf-8")
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK {path}: ") and out.count("\n") == 1 and " serving " in out and "policy " in out


@pytest.mark.parametrize(
    ("text", "lines"),
    [
        pytest.param(
            "pool: {endpoints: [{address: '10.0.0.1:80'}, {address: 'gpu-1:8000'}]}\n",
            ["pool.endpoints[1].address: 'gpu-1:8000': 'gpu-1' is not a literal IP address"],
            id="hostname",
        ),
        pytest.param(
            "listen: x\nsignals: {stale_after: 1}\npool: {endpoints: [{address: '10.0.0.1:80'}]}\n",
            ["listen: 'x' must be a literal 'ip:port'", "signals: unknown key 'stale_after' (allowed: "],
            id="two-errors",
        ),
    ],
)
def test_a_bad_config_exits_2_naming_each_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, lines: list[str]
) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(text, encoding="utf-8")
    assert main(["config", "check", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    got = captured.err.splitlines()
    assert len(got) == len(lines)
    for line, expected in zip(got, lines, strict=True):
        assert line.startswith(f"{path}: {expected}"), line


def test_a_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", str(tmp_path / "absent.yaml")]) == 2
    assert "cannot read config file" in capsys.readouterr().err


def _schema(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["config", "schema"]) == 0
    schema: dict[str, Any] = json.loads(capsys.readouterr().out)
    return schema


def _objects(node: Any) -> list[dict[str, Any]]:
    """Every object schema in ``node``: those that declare properties or additionalProperties."""
    found: list[dict[str, Any]] = []
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node:
            found.append(node)
        for value in node.values():
            found += _objects(value)
    elif isinstance(node, list):
        for value in node:
            found += _objects(value)
    return found


def test_the_schema_is_a_json_schema_that_refuses_unknown_keys(capsys: pytest.CaptureFixture[str]) -> None:
    schema = _schema(capsys)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["type"] == "object" and schema["required"] == ["pool"]
    objects = _objects(schema)
    assert len(objects) > 20  # the file's sections and every plugin entry
    assert all(o["additionalProperties"] is False for o in objects), [o.get("title") for o in objects]
    refs = set(re.findall(r'"\$ref": "#/\$defs/([^"]+)"', json.dumps(schema)))
    assert refs <= set(schema["$defs"])


def _conforms(value: Any, node: dict[str, Any], defs: dict[str, Any]) -> bool:
    """Whether ``value`` fits ``node``, for the keywords the config's schema uses (a structural check: the
    project does not depend on a JSON Schema validator)."""
    if "$ref" in node:
        return _conforms(value, defs[node["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in node:
        return any(_conforms(value, branch, defs) for branch in node["anyOf"])
    if "const" in node and value != node["const"]:
        return False
    if "enum" in node and value not in node["enum"]:
        return False
    kind = node.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if kind in types and not isinstance(value, types[kind]):
        return False
    if kind in ("number", "integer"):
        wanted = int if kind == "integer" else (int, float)
        if isinstance(value, bool) or not isinstance(value, wanted):
            return False
        bounds = (("minimum", float.__ge__), ("maximum", float.__le__))
        bounds += (("exclusiveMinimum", float.__gt__), ("exclusiveMaximum", float.__lt__))
        return all(key not in node or check(float(value), float(node[key])) for key, check in bounds)
    if kind == "array":
        return all(_conforms(item, node.get("items", {}), defs) for item in value)
    if kind == "object":
        properties = node.get("properties", {})
        if not set(node.get("required", ())) <= set(value):
            return False
        extra = node.get("additionalProperties", {})
        for key, item in value.items():
            child = properties.get(key, extra)
            if child is False or not _conforms(item, child, defs):
                return False
    return True


@pytest.mark.parametrize("text", EXAMPLES)
def test_the_schema_accepts_the_example_configs(capsys: pytest.CaptureFixture[str], text: str) -> None:
    schema = _schema(capsys)
    document = yaml.safe_load(text)
    assert _conforms(document, schema, schema["$defs"])
    document["pool"]["endpoints"][0]["wieght"] = 2
    assert not _conforms(document, schema, schema["$defs"])


def _key_paths(node: Any, path: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every key of a document, nested ones and those of objects in lists included, as paths."""
    found: list[tuple[str | int, ...]] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        if isinstance(node, dict):
            found.append((*path, key))
        found += _key_paths(value, (*path, key))
    return found


@pytest.mark.parametrize("text", EXAMPLES)
def test_a_null_is_refused_by_the_schema_exactly_where_config_check_refuses_the_field(
    capsys: pytest.CaptureFixture[str], text: str
) -> None:
    """An editor that follows the schema must not be told a null is fine where ``config check`` then says the field
    must be something else, nor refuse one the check takes. (Rules between fields are the check's alone: a null
    the schema allows may still be refused by one of those, naming another field or the rule.)"""
    schema = _schema(capsys)
    mismatches = []
    for path in _key_paths(yaml.safe_load(text)):
        document = yaml.safe_load(text)
        node = document
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = None
        allowed = _conforms(document, schema, schema["$defs"])
        try:
            parse_config(document)
            refusal = None
        except ConfigError as exc:
            refusal = str(exc)
        name = ".".join(f"[{k}]" if isinstance(k, int) else k for k in path).replace(".[", "[")
        if allowed and refusal is not None and f"{name} must be" in refusal:
            mismatches.append(f"{name}: the schema allows null, the check says {refusal}")
        if not allowed and refusal is None:
            mismatches.append(f"{name}: the schema refuses null, the check takes it")
    assert not mismatches, mismatches


def test_the_schema_takes_the_nulls_the_kubernetes_source_takes(capsys: pytest.CaptureFixture[str]) -> None:
    schema = _schema(capsys)
    source = {"namespace": "llm", "selector": None, "service": "vllm", "target_ports": None}
    document = {"pool": {"discovery": {"kubernetes": source}}}
    parse_config(document)
    assert _conforms(document, schema, schema["$defs"])


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param({"type": "queue", "weight": 2}, id="scorer"),
        pytest.param({"type": "prefix-affinity", "guard": 2.0, "capacity_blocks": 1024}, id="parameters"),
        pytest.param("session-affinity", id="by-name"),
    ],
)
def test_the_schema_describes_plugin_entries(capsys: pytest.CaptureFixture[str], entry: Any) -> None:
    schema = _schema(capsys)
    profile = {"scorers": [entry]}
    document = {"profiles": {"mine": profile}, "policy": "mine", "pool": {"endpoints": [{"address": "10.0.0.1:80"}]}}
    assert _conforms(document, schema, schema["$defs"])
    for bad in ({"type": "queue", "wieght": 2}, {"type": "quue"}, "quue", {"type": "queue", "weight": 0}):
        profile["scorers"] = [bad]
        assert not _conforms(document, schema, schema["$defs"]), bad


def test_the_config_command_imports_neither_the_simulator_nor_the_benchmarks(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text("pool: {endpoints: [{address: '10.0.0.1:80'}]}\n", encoding="utf-8")
    code = (
        "import sys\n"
        "from inferlb import configcmd\n"
        f"assert configcmd.main(['check', {str(path)!r}]) == 0\n"
        "assert configcmd.main(['schema']) == 0\n"
        "print(sorted(m for m in sys.modules if m.startswith(('inferlb.sim', 'inferlb.bench'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.splitlines()[-1] == "[]"
