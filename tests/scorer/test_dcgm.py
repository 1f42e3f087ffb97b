"""Tests for scorer/dcgm.py: a node's GPU report from a DCGM exporter's /metrics."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from inferlb.scorer.dcgm import read_dcgm
from inferlb.scorer.gpustate import GpuInfo, GpuReport, parse_gpu_report

FIXTURE = Path(__file__).parent.parent / "fixtures" / "dcgm" / "dcgm-exporter-h100x2-k8s.txt"
TEXT = FIXTURE.read_text()
MIB = 1024 * 1024
UUID0 = "GPU-7c1e54b2-93af-4d08-b6e1-2a9f0c3d5e71"
UUID1 = "GPU-e2d84f06-1b7c-4a39-8f52-c06b9d1a7e44"
H100 = "NVIDIA H100 80GB HBM3"
MIG_SERIES = (
    f'DCGM_FI_DEV_FB_USED{{gpu="1",UUID="{UUID1}",device="nvidia1",modelName="{H100}",'
    'GPU_I_PROFILE="1g.10gb",GPU_I_ID="9"} 1024'
)


def series(metric: str, gpu: str) -> str:
    """The fixture's line of one metric and GPU."""
    (line,) = [line for line in TEXT.splitlines() if line.startswith(f'{metric}{{gpu="{gpu}"')]
    return line


def without(metric: str, gpu: str | None = None) -> Callable[[str], str]:
    def edit(text: str) -> str:
        return "\n".join(
            line
            for line in text.splitlines()
            if not (line.startswith(metric + "{") and (gpu is None or f'gpu="{gpu}"' in line))
        )

    return edit


def with_value(metric: str, gpu: str, value: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        line = series(metric, gpu)
        return text.replace(line, line.rsplit(" ", 1)[0] + " " + value)

    return edit


def with_line(line: str) -> Callable[[str], str]:
    return lambda text: text.rstrip("\n") + "\n" + line + "\n"


def test_reads_the_fixture() -> None:
    report = read_dcgm(TEXT, "gpu-node-7", sampled_at=1_750_000_000.0)
    assert report == GpuReport(
        "dcgm",
        "gpu-node-7",
        1_750_000_000.0,
        (
            # reserved memory counts as used: free is exactly DCGM_FI_DEV_FB_FREE
            GpuInfo(0, UUID0, H100, 87.0, (69632 + 530) * MIB, 81559 * MIB),
            GpuInfo(1, UUID1, H100, 0.0, 530 * MIB, 81559 * MIB),
        ),
    )
    assert [gpu.memory_free_bytes for gpu in report.gpus] == [11397 * MIB, 81029 * MIB]
    assert parse_gpu_report(report.to_json()) == report
    assert read_dcgm(TEXT.encode(), "gpu-node-7", sampled_at=1.0).gpus == report.gpus


def test_without_fb_reserved_total_is_used_plus_free() -> None:
    report = read_dcgm(without("DCGM_FI_DEV_FB_RESERVED")(TEXT), "n", sampled_at=1.0)
    assert [(g.memory_used_bytes, g.memory_total_bytes) for g in report.gpus] == [
        (69632 * MIB, 81029 * MIB),
        (0, 81029 * MIB),
    ]


def test_sampled_at_defaults_to_now() -> None:
    before = time.time()
    assert before <= read_dcgm(TEXT, "n").sampled_at <= time.time()


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        pytest.param(
            lambda text: text.replace('UUID="', 'uuid="'),
            [(0, UUID0), (1, UUID1)],
            id="old-lowercase-uuid-label",
        ),
        pytest.param(
            with_line(MIG_SERIES),
            [(0, UUID0), (1, UUID1)],
            id="mig-instance-series-ignored",
        ),
        pytest.param(with_line(series("DCGM_FI_DEV_GPU_UTIL", "0")), [(0, UUID0), (1, UUID1)], id="repeated-series"),
        pytest.param(
            lambda text: "\n".join(line for line in text.splitlines() if not line.startswith("#")),
            [(0, UUID0), (1, UUID1)],
            id="no-help-or-type-lines",
        ),
    ],
)
def test_accepted_variants(edit: Callable[[str], str], expected: list[tuple[int, str]]) -> None:
    report = read_dcgm(edit(TEXT), "n", sampled_at=1.0)
    assert [(g.index, g.uuid) for g in report.gpus] == expected
    assert report.gpus[1].memory_used_bytes == 530 * MIB


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        pytest.param(
            without("DCGM_FI_DEV_FB_FREE", "1"),
            f"GPU 1 ({UUID1}): metric DCGM_FI_DEV_FB_FREE is missing",
            id="missing-fb-free",
        ),
        pytest.param(
            without("DCGM_FI_DEV_GPU_UTIL"),
            f"GPU 0 ({UUID0}): metric DCGM_FI_DEV_GPU_UTIL is missing",
            id="missing-util-everywhere",
        ),
        pytest.param(
            with_value("DCGM_FI_DEV_GPU_UTIL", "1", "9223372036854775794"),
            f"GPU 1 ({UUID1}): DCGM_FI_DEV_GPU_UTIL is blank (DCGM has no value for it on this GPU",
            id="blank-not-supported",
        ),
        pytest.param(
            with_value("DCGM_FI_DEV_GPU_UTIL", "0", "120"),
            f"GPU 0 ({UUID0}): DCGM_FI_DEV_GPU_UTIL must be a percentage in [0, 100]; got 120.0",
            id="util-out-of-range",
        ),
        pytest.param(
            with_value("DCGM_FI_DEV_GPU_UTIL", "0", "NaN"),
            f"GPU 0 ({UUID0}): DCGM_FI_DEV_GPU_UTIL must be a percentage",
            id="util-nan",
        ),
        pytest.param(
            with_value("DCGM_FI_DEV_FB_USED", "0", "12.5"),
            f"GPU 0 ({UUID0}): DCGM_FI_DEV_FB_USED must be a whole number of MiB >= 0; got 12.5",
            id="fractional-mib",
        ),
        pytest.param(
            with_value("DCGM_FI_DEV_FB_FREE", "1", "-1"),
            f"GPU 1 ({UUID1}): DCGM_FI_DEV_FB_FREE must be a whole number of MiB >= 0",
            id="negative-mib",
        ),
        pytest.param(
            lambda text: with_line(MIG_SERIES)(without("DCGM_FI_DEV_FB_USED", "1")(text)),
            f"GPU 1 ({UUID1}): DCGM_FI_DEV_FB_USED is reported only per MIG instance; MIG GPUs are not supported",
            id="mig-only",
        ),
        pytest.param(
            with_line(series("DCGM_FI_DEV_GPU_UTIL", "0").replace("} 87", ',job="other"} 12')),
            f"GPU 0 ({UUID0}): DCGM_FI_DEV_GPU_UTIL has 2 series that disagree: [12.0, 87.0]",
            id="series-disagree",
        ),
        pytest.param(
            with_line('DCGM_FI_DEV_GPU_UTIL{UUID="GPU-x",modelName="x"} 3'),
            "DCGM_FI_DEV_GPU_UTIL has a series without a GPU index (label gpu=None)",
            id="no-gpu-label",
        ),
        pytest.param(
            lambda text: re.sub(r'UUID="[^"]*",', "", text),
            "GPU 0: its series have no UUID label",
            id="no-uuid",
        ),
        pytest.param(
            lambda text: text.replace(f'modelName="{H100}",', ""),
            f"GPU 0 ({UUID0}): its series have no modelName label",
            id="no-model-name",
        ),
        pytest.param(
            lambda _: (
                "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
                'vllm:num_requests_running{model_name="m"} 3\n'
            ),
            "no GPU found: the text has none of DCGM_FI_DEV_GPU_UTIL, DCGM_FI_DEV_FB_USED, DCGM_FI_DEV_FB_FREE",
            id="not-a-dcgm-exporter",
        ),
        pytest.param(lambda _: "", "no GPU found", id="empty"),
    ],
)
def test_errors_name_the_gpu_and_metric(edit: Callable[[str], str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        read_dcgm(edit(TEXT), "n", sampled_at=1.0)
    assert str(info.value).startswith(message), str(info.value)
