"""A node's GPUs from an NVIDIA DCGM exporter's ``/metrics``: the same :class:`~inferlb.scorer.gpustate.GpuReport`
the GPU agent serves, with source ``"dcgm"``.

Read from the exporter's default counters, one series per GPU and metric:

- ``DCGM_FI_DEV_GPU_UTIL``: utilisation in percent;
- ``DCGM_FI_DEV_FB_USED``, ``DCGM_FI_DEV_FB_FREE`` and, when the collector config adds it,
  ``DCGM_FI_DEV_FB_RESERVED``: framebuffer memory in MiB. Total = used + free + reserved; the report counts the
  reserved memory as used, so its free memory is exactly ``FB_FREE``, what can still be allocated (NVML's v1
  memory info, which the GPU agent reads, counts it the same way).

Labels: ``gpu`` (the index), ``UUID`` (``uuid`` with the exporter's old label names) and ``modelName``; the others
(``device``, ``pci_bus_id``, ``Hostname``, ``DCGM_FI_DRIVER_VERSION``, Kubernetes ``pod``/``namespace``/
``container``) are ignored. Series of MIG instances (with a ``GPU_I_ID`` label) are not whole GPUs and are not
read. These are the names of dcgm-exporter 2.x to 4.8; 4.9 renamed the default metrics and changed their units,
which this reader does not accept.
"""

from __future__ import annotations

import math
import time

from inferlb.scorer.gpustate import GpuInfo, GpuReport
from inferlb.scorer.promtext import read_samples

__all__ = ["DCGM_METRICS", "FB_FREE", "FB_RESERVED", "FB_USED", "GPU_UTIL", "read_dcgm"]

GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
DCGM_METRICS: tuple[str, ...] = (GPU_UTIL, FB_USED, FB_FREE, FB_RESERVED)
"""The families read; all but ``FB_RESERVED`` are required for every GPU."""

_REQUIRED = (GPU_UTIL, FB_USED, FB_FREE)
_MIB = 1024 * 1024
# DCGM's "blank" values (DCGM_INT64_BLANK and up: not found, not supported, no permission) are printed as numbers
# near 2**63; they mean "no value", never a reading.
_DCGM_INT64_BLANK = float(0x7FFFFFFFFFFFFFF0)

_Series = dict[str, list[tuple[dict[str, str], float]]]  # metric -> [(labels, value)] of one GPU


def read_dcgm(text: str | bytes, host: str, *, sampled_at: float | None = None) -> GpuReport:
    """The GPUs of one DCGM exporter scrape, named ``host``; ``sampled_at`` defaults to now.

    Raises ValueError naming the GPU and the metric when a GPU lacks a required metric (or DCGM reports it blank,
    or only per MIG instance), when a value is out of range or series disagree, and when the text holds no GPU at
    all (not a DCGM exporter's ``/metrics``).
    """
    body = text.encode("utf-8", "replace") if isinstance(text, str) else bytes(text)
    by_gpu: dict[int, _Series] = {}
    for metric in DCGM_METRICS:
        for labels, value in read_samples(body, metric):
            index_text = labels.get("gpu")
            if index_text is None or not (index_text.isascii() and index_text.isdigit()):
                raise ValueError(f"{metric} has a series without a GPU index (label gpu={index_text!r})")
            by_gpu.setdefault(int(index_text), {}).setdefault(metric, []).append((labels, value))
    if not by_gpu:
        wanted = ", ".join(_REQUIRED)
        raise ValueError(f"no GPU found: the text has none of {wanted} (is it a DCGM exporter's /metrics?)")
    gpus = tuple(_gpu(index, by_gpu[index]) for index in sorted(by_gpu))
    return GpuReport("dcgm", host, time.time() if sampled_at is None else sampled_at, gpus)


def _gpu(index: int, series: _Series) -> GpuInfo:
    every = [labels for metric in DCGM_METRICS for labels, _ in series.get(metric, ())]
    labels = next((labels for labels in every if "GPU_I_ID" not in labels), every[0])
    uuid = labels.get("UUID", labels.get("uuid"))
    if uuid is None:
        raise ValueError(f"GPU {index}: its series have no UUID label")
    where = f"GPU {index} ({uuid})"
    name = labels.get("modelName")
    if name is None:
        raise ValueError(f"{where}: its series have no modelName label")
    util = _value(where, GPU_UTIL, series)
    if not 0 <= util <= 100:
        raise ValueError(f"{where}: {GPU_UTIL} must be a percentage in [0, 100]; got {util!r}")
    used, free = _mib(where, FB_USED, series), _mib(where, FB_FREE, series)
    reserved = _mib(where, FB_RESERVED, series) if FB_RESERVED in series else 0
    return GpuInfo(index, uuid, name, util, (used + reserved) * _MIB, (used + free + reserved) * _MIB)


def _value(where: str, metric: str, series: _Series) -> float:
    found = series.get(metric, [])
    whole = {value for labels, value in found if "GPU_I_ID" not in labels}
    if not whole:
        if found:
            raise ValueError(f"{where}: {metric} is reported only per MIG instance; MIG GPUs are not supported")
        raise ValueError(f"{where}: metric {metric} is missing")
    if len(whole) > 1:
        raise ValueError(f"{where}: {metric} has {len(whole)} series that disagree: {sorted(whole)}")
    value = whole.pop()
    if value >= _DCGM_INT64_BLANK:
        raise ValueError(
            f"{where}: {metric} is blank (DCGM has no value for it on this GPU: not supported or not permitted)"
        )
    return value


def _mib(where: str, metric: str, series: _Series) -> int:
    value = _value(where, metric, series)
    if not (math.isfinite(value) and value >= 0 and value.is_integer()):
        raise ValueError(f"{where}: {metric} must be a whole number of MiB >= 0; got {value!r}")
    return int(value)
