"""How every benchmark writes its result: ``OUT/NAME.json`` for machines and ``OUT/NAME.md`` (tables) for people,
each report starting with the same header (date, command, machine).

The JSON is the record: the names of the files under bench/results/ and the keys in them are read by name, so a
suite may add keys but never rename or drop one. The markdown is made from the same data.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["cpu_model", "header", "table", "write"]


def header(command: str, started: datetime | None = None) -> dict[str, Any]:
    """The date (UTC, to the minute; ``started`` or now), the command that made the report, and the machine."""
    return {
        "date": (started or datetime.now(UTC)).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
    }


def cpu_model() -> str:
    """The processor's model name from /proc/cpuinfo ("unknown" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write(out: Path, name: str, data: Any, markdown: str | None = None) -> list[Path]:
    """Write ``data`` to ``out/NAME.json`` and, when given, ``markdown`` to ``out/NAME.md`` (``out`` is created);
    say so on stdout and return the paths written. ``data`` must be JSON-ready."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json"]
    paths[0].write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    if markdown is not None:
        paths.append(out / f"{name}.md")
        paths[1].write_text(markdown if markdown.endswith("\n") else markdown + "\n", encoding="utf-8")
    print("wrote " + ", ".join(str(p) for p in paths), flush=True)
    return paths


def table(head: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None) -> list[str]:
    """A markdown table's lines. ``align`` has one letter per column, ``l`` or ``r`` (default: the first column
    left, the others right, as for a name followed by figures). A None cell is shown as "—", any other with
    ``str``; format numbers before. ValueError for a row or an ``align`` of the wrong width."""
    align = align or "l" + "r" * (len(head) - 1)
    if len(align) != len(head) or set(align) - {"l", "r"}:
        raise ValueError(f"align needs one of 'l' or 'r' per column ({len(head)}); got {align!r}")
    lines = ["| " + " | ".join(head) + " |", "|" + "".join("---|" if a == "l" else "---:|" for a in align)]
    for row in rows:
        if len(row) != len(head):
            raise ValueError(f"a row of {len(row)} cells in a table of {len(head)} columns: {row!r}")
        lines.append("| " + " | ".join("—" if cell is None else str(cell) for cell in row) + " |")
    return lines


def spread(mean: float, low: float, high: float, digits: int) -> str:
    """A mean with its range over runs, as ``mean [low-high]``: ``digits`` decimals, 0 for thousands separators."""
    if digits == 0:
        return f"{mean:,.0f} [{low:,.0f}-{high:,.0f}]"
    return f"{mean:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"
