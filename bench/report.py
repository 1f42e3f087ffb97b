"""What every benchmark report starts with, and how it is written: JSON for machines, markdown for people."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["cpu_model", "header", "write"]


def header(command: str) -> dict[str, Any]:
    """The date (UTC, to the minute), the command that made the report, and the machine it ran on."""
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
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


def write(out: Path, name: str, report: dict[str, Any], markdown: Callable[[dict[str, Any]], str]) -> Path:
    """``out/name.json`` and ``out/name.md``; returns the markdown file's path."""
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    path = out / f"{name}.md"
    path.write_text(markdown(report), encoding="utf-8")
    return path
