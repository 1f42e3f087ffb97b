"""A fake ``pynvml`` for tests: the NVML functions the GPU agent calls, over a table of GPUs, with failures on demand.

``FakeNvml(...).module()`` is a module object to put in ``sys.modules["pynvml"]``. The state stays on the
``FakeNvml``: a test changes a GPU's numbers, or makes a function fail, while an agent is running. Errors are
raised as the real module raises them: ``NVMLError(code)``, whose ``str`` is NVML's message for the code.
"""

from __future__ import annotations

import threading
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
}

H100_TOTAL = 85_520_809_984  # 81559 MiB, what an H100 80GB HBM3 reports


class NVMLError(Exception):
    """As ``pynvml.NVMLError``: carries the NVML return code in ``value``."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


@dataclass
class FakeGpu:
    uuid: str
    name: str
    utilization: int = 0
    used: int = 0
    total: int = H100_TOTAL


@dataclass(frozen=True)
class _Handle:
    index: int


@dataclass(frozen=True)
class _Utilization:
    gpu: int
    memory: int


@dataclass(frozen=True)
class _Memory:
    total: int
    free: int
    used: int


def two_h100s() -> list[FakeGpu]:
    return [
        FakeGpu("GPU-5d1f3a2e-8b47-4c1d-9e0a-3f6b7c8d9e01", "NVIDIA H100 80GB HBM3", 37, 73_014_444_032),
        FakeGpu("GPU-a93c0b71-2d5e-46f8-b1c9-0e7d4f2a6b53", "NVIDIA H100 80GB HBM3", 0, 4_194_304),
    ]


@dataclass
class FakeNvml:
    """The NVML of a node with ``gpus``. ``init_error``: the code ``nvmlInit`` fails with; ``failures``: function
    name -> code it fails with from now on; ``as_bytes``: names and UUIDs as bytes, as pynvml before 11.5;
    ``hang``: when given, ``nvmlDeviceGetMemoryInfo`` blocks until it is set (an NVML call that hangs)."""

    gpus: list[FakeGpu] = field(default_factory=two_h100s)
    init_error: int | None = None
    failures: dict[str, int] = field(default_factory=dict)
    as_bytes: bool = False
    hang: threading.Event | None = None
    init_calls: int = 0
    shutdown_calls: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def module(self) -> types.ModuleType:
        mod = types.ModuleType("pynvml", "a fake pynvml (tests/scorer/fakenvml.py)")
        mod.NVMLError = NVMLError  # type: ignore[attr-defined]
        for name in (
            "nvmlInit",
            "nvmlShutdown",
            "nvmlDeviceGetCount",
            "nvmlDeviceGetHandleByIndex",
            "nvmlDeviceGetUUID",
            "nvmlDeviceGetName",
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetMemoryInfo",
        ):
            setattr(mod, name, getattr(self, name))
        return mod

    @property
    def initialized(self) -> bool:
        return self.init_calls - self.shutdown_calls > 0

    def _enter(self, function: str) -> None:
        with self._lock:
            self.calls[function] = self.calls.get(function, 0) + 1
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        code = self.failures.get(function)
        if code is not None:
            raise NVMLError(code)

    def _gpu(self, handle: _Handle) -> FakeGpu:
        if not isinstance(handle, _Handle) or not 0 <= handle.index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[handle.index]

    def _text(self, text: str) -> str | bytes:
        return text.encode() if self.as_bytes else text

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.init_calls += 1  # NVML counts nested inits; each needs its shutdown

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str | bytes:
        self._enter("nvmlDeviceGetUUID")
        return self._text(self._gpu(handle).uuid)

    def nvmlDeviceGetName(self, handle: _Handle) -> str | bytes:
        self._enter("nvmlDeviceGetName")
        return self._text(self._gpu(handle).name)

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> _Utilization:
        self._enter("nvmlDeviceGetUtilizationRates")
        return _Utilization(gpu=self._gpu(handle).utilization, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> _Memory:
        self._enter("nvmlDeviceGetMemoryInfo")
        if self.hang is not None:
            self.hang.wait(10)
        gpu = self._gpu(handle)
        return _Memory(total=gpu.total, free=gpu.total - gpu.used, used=gpu.used)


def nvml_missing() -> list[Any]:
    """Test cases (fresh fakes each call) where NVML cannot be used at all, with the reason the agent gives."""
    return [
        pytest.param(
            FakeNvml(init_error=NVML_ERROR_LIBRARY_NOT_FOUND),
            "nvmlInit failed: NVML Shared Library Not Found",
            id="no-libnvidia-ml",
        ),
        pytest.param(
            FakeNvml(init_error=NVML_ERROR_DRIVER_NOT_LOADED), "nvmlInit failed: Driver Not Loaded", id="no-driver"
        ),
        pytest.param(FakeNvml(gpus=[]), "NVML found no GPU", id="no-gpu"),
    ]
