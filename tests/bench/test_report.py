"""bench/report.py: the one way a suite writes its result (NAME.json, NAME.md) and its tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferlb.bench.report import header, table, write


def test_write_puts_json_and_markdown_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results" / "deeper"  # created on the way
    data = {"meta": header("inferlb bench demo --out x"), "rows": [{"p50_ms": 1.5, "picker_cpu_us": None}]}

    paths = write(out, "demo", data, "# Demo\n\n| a |\n|---|")

    assert paths == [out / "demo.json", out / "demo.md"]
    assert json.loads((out / "demo.json").read_text(encoding="utf-8")) == data
    assert (out / "demo.json").read_text(encoding="utf-8").endswith("}\n")
    assert (out / "demo.md").read_text(encoding="utf-8") == "# Demo\n\n| a |\n|---|\n"  # ends with a newline
    assert f"wrote {out / 'demo.json'}, {out / 'demo.md'}" in capsys.readouterr().out


def test_write_without_markdown_writes_json_only(tmp_path: Path) -> None:
    assert write(tmp_path, "rows", [1, 2]) == [tmp_path / "rows.json"]
    assert json.loads((tmp_path / "rows.json").read_text(encoding="utf-8")) == [1, 2]
    assert not (tmp_path / "rows.md").exists()


def test_write_replaces_an_older_result(tmp_path: Path) -> None:
    write(tmp_path, "r", {"old": 1}, "old")
    write(tmp_path, "r", {"new": 2}, "new\n")
    assert json.loads((tmp_path / "r.json").read_text(encoding="utf-8")) == {"new": 2}
    assert (tmp_path / "r.md").read_text(encoding="utf-8") == "new\n"


def test_header_names_the_date_command_and_machine() -> None:
    meta = header("inferlb bench hop --quick")
    assert set(meta) == {"date", "command", "machine"}
    assert meta["command"] == "inferlb bench hop --quick"
    assert meta["date"].endswith(" UTC") and "CPUs" in meta["machine"]


def test_table_aligns_names_left_and_figures_right() -> None:
    lines = table(["policy", "p50 ms", "errors"], [["default", "1.25", 0], ["round-robin", None, 3]])
    assert lines == [
        "| policy | p50 ms | errors |",
        "|---|---:|---:|",
        "| default | 1.25 | 0 |",
        "| round-robin | — | 3 |",
    ]


def test_table_takes_an_alignment_per_column() -> None:
    assert table(["n", "what"], [[1, "x"]], "rl")[1] == "|---:|---|"


@pytest.mark.parametrize(
    ("head", "rows", "align", "match"),
    [
        pytest.param(["a", "b"], [["only one"]], None, "a row of 1 cells", id="short row"),
        pytest.param(["a", "b"], [], "l", "one of 'l' or 'r' per column", id="short align"),
        pytest.param(["a", "b"], [], "lc", "one of 'l' or 'r' per column", id="unknown letter"),
    ],
)
def test_table_refuses_a_wrong_width(head: list[str], rows: list[list[object]], align: str | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        table(head, rows, align)
