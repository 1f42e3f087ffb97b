"""The GPU-state report: what a GPU agent (NVML), a DCGM exporter reader or the emulator says about a node's GPUs.

One JSON schema for all of them, so the scorer reads every source through the same client:

    {"source": "nvml" | "dcgm" | "emulated", "host": "...", "sampled_at": <unix seconds>,
     "gpus": [{"index": 0, "uuid": "GPU-...", "name": "NVIDIA H100 80GB HBM3",
               "utilization_pct": 37.5, "memory_used_bytes": 73014444032, "memory_total_bytes": 85899345920}]}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["GPU_SOURCES", "GpuInfo", "GpuReport", "parse_gpu_report"]

GPU_SOURCES = ("nvml", "dcgm", "emulated")


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One GPU. ``utilization_pct`` in [0, 100]; ``0 <= memory_used_bytes <= memory_total_bytes``."""

    index: int
    uuid: str
    name: str
    utilization_pct: float
    memory_used_bytes: int
    memory_total_bytes: int

    @property
    def memory_free_bytes(self) -> int:
        return self.memory_total_bytes - self.memory_used_bytes

    def to_json(self) -> dict[str, object]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "utilization_pct": self.utilization_pct,
            "memory_used_bytes": self.memory_used_bytes,
            "memory_total_bytes": self.memory_total_bytes,
        }


@dataclass(frozen=True, slots=True)
class GpuReport:
    """All GPUs of one node at one time."""

    source: str
    host: str
    sampled_at: float
    gpus: tuple[GpuInfo, ...]

    def to_json(self) -> dict[str, object]:
        return {
            "source": self.source,
            "host": self.host,
            "sampled_at": self.sampled_at,
            "gpus": [gpu.to_json() for gpu in self.gpus],
        }


# No GPU figure comes near it: a larger integer is no reading (JSON's integers are unbounded, and one of 400
# digits would overflow the float64 sums of the collector, or `math.isfinite` itself).
MAX_INTEGER = 2**63


def _number(obj: Mapping[str, object], key: str, where: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
        raise ValueError(f"{where}.{key} must be a finite number; got {_short(value)}")
    return value


def _count(obj: Mapping[str, object], key: str, where: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_INTEGER:
        raise ValueError(f"{where}.{key} must be an integer in [0, 2**63); got {_short(value)}")
    return value


def _finite(value: int | float) -> bool:
    return -MAX_INTEGER < value < MAX_INTEGER if isinstance(value, int) else math.isfinite(value)


def _short(value: object) -> str:
    """A value for a message: at most 120 characters, whatever the report holds there."""
    if isinstance(value, int) and value.bit_length() > 100:  # repr() of one over 4,300 digits raises
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, list | dict):  # repr() would copy all of it, and recurse once per level of nesting
        return f"a list of {len(value)}" if isinstance(value, list) else f"an object of {len(value)} keys"
    return repr(value[:120] if isinstance(value, str) else value)[:120]


def _text(obj: Mapping[str, object], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a string; got {_short(value)}")
    return value


def parse_gpu_report(obj: object) -> GpuReport:
    """Validate a decoded JSON report; ValueError naming the field (``gpus[1].utilization_pct ...``) otherwise."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"a GPU report must be a JSON object; got {type(obj).__name__}")
    source = _text(obj, "source", "report")
    if source not in GPU_SOURCES:
        raise ValueError(f"report.source must be one of {', '.join(GPU_SOURCES)}; got {_short(source)}")
    gpus_raw = obj.get("gpus")
    if not isinstance(gpus_raw, Sequence) or isinstance(gpus_raw, str):
        raise ValueError(f"report.gpus must be a list; got {_short(gpus_raw)}")
    gpus = []
    for i, raw in enumerate(gpus_raw):
        where = f"gpus[{i}]"
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where} must be an object; got {_short(raw)}")
        util = _number(raw, "utilization_pct", where)
        if not 0 <= util <= 100:
            raise ValueError(f"{where}.utilization_pct must be in [0, 100]; got {_short(util)}")
        used, total = _count(raw, "memory_used_bytes", where), _count(raw, "memory_total_bytes", where)
        if used > total:
            raise ValueError(f"{where}.memory_used_bytes ({used}) exceeds memory_total_bytes ({total})")
        gpus.append(
            GpuInfo(
                _count(raw, "index", where),
                _text(raw, "uuid", where),
                _text(raw, "name", where),
                float(util),
                used,
                total,
            )
        )
    return GpuReport(source, _text(obj, "host", "report"), float(_number(obj, "sampled_at", "report")), tuple(gpus))
