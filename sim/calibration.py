"""Calibration of the emulator's profiles: what `ServerProfile.step_time` gives beside the figures it was fitted to.

Each row compares one emulated quantity with a reference figure of one of three kinds:

* ``measured``: a published measurement of this GPU x model pair (URL, figure and conversion in ``source``);
* ``scaled``: a published measurement of a neighbouring pair, scaled by a datasheet ratio (stated in ``source``);
* ``roofline``: the datasheet roofline at the efficiencies the measured rows imply (``ETA_BW`` of memory bandwidth,
  ``MFU`` of dense BF16 peak), taking the *maximum* of weight-read and compute time where the step-time model adds
  them. A roofline is a lower bound on a real step, not a measurement: these rows fill the prefill and batch
  1/32/128 decode points that no published row covers, and only check that the model is not faster than it.

`CalibrationRow.bounds` states how far each kind may be from its reference; tests/sim/test_profiles.py checks it.

Emulated quantities, as the engine (`sim/engine.py`) would produce them with nothing else running:

* prefill throughput: a prompt of ``PREFILL_PROMPT_TOKENS`` computed in chunks of ``max_num_batched_tokens``, one
  chunk per step, each chunk attending to the tokens before it and causally to itself;
* decode step time: ``batch`` sequences of ``context`` tokens each decoding one token (``DECODE_CONTEXT_TOKENS``
  unless a row says otherwise).

Run ``python -m inferlb.sim.calibration`` to print the table that sim/README.md carries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferlb.sim.profiles import ETA_BW, MFU, PROFILES, ServerProfile

__all__ = [
    "DECODE_BATCHES",
    "DECODE_CONTEXT_TOKENS",
    "PREFILL_PROMPT_TOKENS",
    "ROOFLINE_EXCESS",
    "TOLERANCE",
    "CalibrationRow",
    "calibration_rows",
    "calibration_table",
    "decode_step_seconds",
    "markdown_table",
    "prefill_seconds",
]

PREFILL_PROMPT_TOKENS = 16_384
DECODE_CONTEXT_TOKENS = 1_024
DECODE_BATCHES = (1, 32, 128)
# Every published (measured or scaled) row's emulated value is within this relative distance of its reference, and
# no row is more than this much faster than its roofline (tests/sim/test_profiles.py).
TOLERANCE = 0.15
# How far above its roofline a row may be. Real engines sit further above the roofline as the batch grows: the
# measured decode rows at batch 52-64 (H100, A100, 4xH100) are 1.26-1.48 x the roofline at their own conditions.
ROOFLINE_EXCESS = 0.5


@dataclass(frozen=True, slots=True)
class CalibrationRow:
    """One emulated quantity beside its reference figure. ``unit`` applies to both values."""

    profile: str
    quantity: str
    conditions: str
    unit: str
    emulated: float
    reference: float
    kind: str
    source: str

    @property
    def relative_difference(self) -> float:
        """(emulated - reference) / reference."""
        return (self.emulated - self.reference) / self.reference

    @property
    def bounds(self) -> tuple[float, float]:
        """The (low, high) range `relative_difference` must lie in: +-TOLERANCE around a published figure;
        -TOLERANCE to +ROOFLINE_EXCESS around a roofline, which real steps exceed but do not undercut."""
        if self.kind == "roofline":
            return (-TOLERANCE, ROOFLINE_EXCESS)
        return (-TOLERANCE, TOLERANCE)


def _chunks(profile: ServerProfile, prompt_tokens: int) -> list[tuple[int, int]]:
    """(chunk tokens, attention pairs) of each step that prefills a ``prompt_tokens`` prompt alone."""
    steps = []
    done = 0
    while done < prompt_tokens:
        chunk = min(profile.max_num_batched_tokens, prompt_tokens - done)
        # Same count as the engine: each new token attends to the context before the chunk and, causally, to on
        # average half of the chunk.
        steps.append((chunk, chunk * (done + (chunk + 1) // 2)))
        done += chunk
    return steps


def prefill_seconds(profile: ServerProfile, prompt_tokens: int) -> float:
    """Seconds to prefill one ``prompt_tokens`` prompt alone (its time to first token)."""
    return sum(profile.step_time(chunk, pairs, 0, 0) for chunk, pairs in _chunks(profile, prompt_tokens))


def decode_step_seconds(profile: ServerProfile, batch: int, context: int) -> float:
    """Seconds of one decode-only step of ``batch`` sequences holding ``context`` tokens each."""
    return profile.step_time(0, 0, batch, batch * context)


@dataclass(frozen=True, slots=True)
class _Roofline:
    """Datasheet and model figures of one profile, per GPU. Bytes, FLOPs, seconds."""

    bandwidth: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    weight_bytes: float
    tp_overhead_s: float  # tensor-parallel all-reduces per decode step (estimate; 0 without TP)
    tp_prefill_factor: float  # all-reduce share of prefill time (estimate; 1 without TP)
    flops_per_token: float  # 2 x non-embedding parameters (the lm_head runs for sampled tokens only)
    flops_per_pair: float  # 4 x layers x heads x head_dim
    kv_bytes_per_token: float

    def weight_read_s(self) -> float:
        return self.weight_bytes / (ETA_BW * self.bandwidth) + self.tp_overhead_s

    def compute_s(self, tokens: int, pairs: int) -> float:
        flops = tokens * self.flops_per_token + pairs * self.flops_per_pair
        return self.tp_prefill_factor * flops / (MFU * self.bf16_flops)

    def decode_s(self, batch: int, context: int) -> float:
        kv = batch * context * self.kv_bytes_per_token / (ETA_BW * self.bandwidth)
        return max(self.weight_read_s(), self.compute_s(batch, 0)) + kv

    def prefill_s(self, profile: ServerProfile, prompt_tokens: int) -> float:
        return sum(
            max(self.weight_read_s(), self.compute_s(chunk, pairs)) for chunk, pairs in _chunks(profile, prompt_tokens)
        )


_H100 = (3.35e12, 989e12)
_A100 = (2.039e12, 312e12)
_L4 = (300e9, 121e12)

_ROOFLINES = {
    "h100-llama3.1-8b": _Roofline(*_H100, 16.06e9, 0.0, 1.0, 13.96e9, 524_288, 131_072),
    "a100-llama3.1-8b": _Roofline(*_A100, 16.06e9, 0.0, 1.0, 13.96e9, 524_288, 131_072),
    "l4-llama3.2-3b": _Roofline(*_L4, 6.43e9, 0.0, 1.0, 5.64e9, 344_064, 114_688),
    "h100x4-llama3.1-70b": _Roofline(*_H100, 35.28e9, 1.6e-3, 1.12, 34.23e9, 655_360, 81_920),
}

_ROOFLINE_SOURCE = {
    "h100-llama3.1-8b": "https://www.nvidia.com/en-us/data-center/h100/",
    "a100-llama3.1-8b": "https://www.nvidia.com/en-us/data-center/a100/",
    "l4-llama3.2-3b": "https://www.nvidia.com/en-us/data-center/l4/",
    "h100x4-llama3.1-70b": "https://www.nvidia.com/en-us/data-center/h100/",
}


@dataclass(frozen=True, slots=True)
class _Published:
    """A published figure: ``kind`` is ``measured`` or ``scaled``; ``prompt`` > 0 means a TTFT, else a decode step
    of ``batch`` sequences holding ``context`` tokens each on average."""

    quantity: str
    batch: int
    context: int
    prompt: int
    value_ms: float
    kind: str
    source: str


_YOBITEL = "https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/"
# Raw `vllm benchmark_serving` results of 2024-09-07: ShareGPT prompts all sent at t=0, per-request `itls` lists.
# Tokens arrive in chunks of 10 (multi-step scheduling, `--num-scheduler-steps 10`, see the repository's
# benchmark_v0.md), and all requests share one step timeline after the last prefill, so a chunk interval / 10 is one
# decode step of the requests still running. Batch and mean context are counted from the file's `input_lens` and
# `output_lens`. The model is Meta-Llama-3 (BF16), the same architecture and size as Llama-3.1.
_LAMBDA = "https://github.com/LambdaLabsML/vllm-benchmark/blob/"
_LAMBDA_H100_80 = (
    _LAMBDA + "a4f9f4371a1ccac781293837fce2bce0cc6d25cc/results/prompt_80/1xH100-80GB-SXM/"
    "Meta-Llama-3-8B-Instruct_tp1_len2048.json"
)
_LAMBDA_H100_10 = _LAMBDA_H100_80.replace("prompt_80", "prompt_10")
_LAMBDA_A100_80 = (
    _LAMBDA + "a9b42a5f83bc39976bcb6bd44a96b2b15d820e10/results/prompt_80/1xA100-80GB-SXM/"
    "Meta-Llama-3-8B-Instruct_tp1_len2000.json"
)
_LAMBDA_A100_10 = _LAMBDA_A100_80.replace("prompt_80", "prompt_10")
_LAMBDA_70B_80 = (
    _LAMBDA + "a4f9f4371a1ccac781293837fce2bce0cc6d25cc/results/prompt_80/4xH100-80GB-SXM/"
    "Meta-Llama-3-70B-Instruct_tp4_len2048.json"
)
_LAMBDA_70B_10 = _LAMBDA_70B_80.replace("prompt_80", "prompt_10")
_LAMBDA_RUN = "vLLM run of 2024-09-07 streaming 10-token chunks"

_PUBLISHED: dict[str, tuple[_Published, ...]] = {
    "h100-llama3.1-8b": (
        _Published(
            "decode step",
            1,
            512,
            0,
            6.48,
            "measured",
            f"{_YOBITEL} — H100-80GB-HBM3, vLLM 0.21, Llama-3.1-8B-Instruct fp16, short chat prompts: TPOT p50 "
            "6.48 ms at concurrency 1 (context ~512 assumed)",
        ),
        _Published(
            "decode step",
            4,
            512,
            0,
            6.59,
            "measured",
            f"{_YOBITEL} — same run: TPOT p50 6.59 ms at concurrency 4",
        ),
        _Published(
            "decode step",
            1,
            614,
            0,
            70.58 / 10,
            "measured",
            f"{_LAMBDA_H100_10} — 1x H100-80GB-SXM, Meta-Llama-3-8B-Instruct BF16, {_LAMBDA_RUN}, 10 ShareGPT "
            "prompts at once: the last 30 chunks, one request left, 70.58 ms apart on average -> 7.06 ms per step",
        ),
        _Published(
            "decode step",
            16,
            528,
            0,
            79.27 / 10,
            "measured",
            f"{_LAMBDA_H100_80} — same setup, 80 prompts at once: chunk 33 of the 741-token request, 16 requests "
            "decoding, 79.27 ms -> 7.93 ms per step",
        ),
        _Published(
            "decode step",
            64,
            232,
            0,
            90.44 / 10,
            "measured",
            f"{_LAMBDA_H100_80} — same run: first chunk after the last prefill, 64 requests decoding, 90.44 ms -> "
            "9.04 ms per step",
        ),
    ),
    "a100-llama3.1-8b": (
        _Published(
            "decode step",
            1,
            1088,
            0,
            1000 / 75 * 1555 / 2039,
            "scaled",
            "https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on — A100 40GB, vLLM 0.23, "
            "Llama-3.1-8B-Instruct BF16, 1024 in / 128 out: ~75 tokens/s at concurrency 1 (13.3 ms), scaled by "
            "memory bandwidth 1,555 -> 2,039 GB/s",
        ),
        _Published(
            "time to first token",
            1,
            0,
            500,
            48.3,
            "measured",
            "https://docs.nvidia.com/nim/llama-3-1-nemotron-safety-guard-8b/1.10.1/performance.md — A100 80GB SXM, "
            "BF16, Llama-3.1-8B architecture (Nemotron Safety Guard 8B): TTFT 48.3 ms for 500 input tokens, "
            "concurrency 1",
        ),
        _Published(
            "decode step",
            1,
            653,
            0,
            113.76 / 10,
            "measured",
            f"{_LAMBDA_A100_10} — 1x A100-80GB-SXM, Meta-Llama-3-8B-Instruct BF16, {_LAMBDA_RUN}, 10 ShareGPT "
            "prompts at once: the last 23 chunks, one request left, 113.76 ms apart on average -> 11.38 ms per step",
        ),
        _Published(
            "decode step",
            16,
            528,
            0,
            125.44 / 10,
            "measured",
            f"{_LAMBDA_A100_80} — same setup, 80 prompts at once: chunk 33 of the 741-token request, 16 requests "
            "decoding, 125.44 ms -> 12.54 ms per step",
        ),
        _Published(
            "decode step",
            64,
            232,
            0,
            173.68 / 10,
            "measured",
            f"{_LAMBDA_A100_80} — same run: first chunk after the last prefill, 64 requests decoding, 173.68 ms -> "
            "17.37 ms per step",
        ),
    ),
    "h100x4-llama3.1-70b": (
        _Published(
            "decode step",
            1,
            730,
            0,
            170.27 / 10,
            "measured",
            f"{_LAMBDA_70B_10} — 4x H100-80GB-SXM, TP4, Meta-Llama-3-70B-Instruct BF16, {_LAMBDA_RUN}, 10 "
            "ShareGPT prompts at once: the last 7 chunks, one request left, 170.27 ms apart on average -> 17.03 ms "
            "per step",
        ),
        _Published(
            "decode step",
            16,
            432,
            0,
            182.36 / 10,
            "measured",
            f"{_LAMBDA_70B_80} — same setup, 80 prompts at once (17 returned no tokens): chunk 29 of the 741-token "
            "request, 16 requests decoding, 182.36 ms -> 18.24 ms per step",
        ),
        _Published(
            "decode step",
            52,
            186,
            0,
            205.01 / 10,
            "measured",
            f"{_LAMBDA_70B_80} — same run: first chunk after the last prefill, 52 requests decoding, 205.01 ms -> "
            "20.50 ms per step",
        ),
    ),
}


def _covered(batch: int, published: Sequence[_Published]) -> bool:
    """Whether a published decode row lies within a factor of two of ``batch`` (batch/2 < b <= 2 x batch)."""
    return any(not pub.prompt and batch / 2 < pub.batch <= 2 * batch for pub in published)


def calibration_rows(profile: ServerProfile) -> list[CalibrationRow]:
    """The calibration rows of ``profile``: published figures first, then the roofline rows for the prefill point and
    for each batch of `DECODE_BATCHES` that no published decode row covers (none within a factor of two).

    ValueError if ``profile`` has no calibration data (its name is not one of `PROFILES`).
    """
    try:
        roofline = _ROOFLINES[profile.name]
    except KeyError:
        raise ValueError(
            f"no calibration data for profile {profile.name!r}; known profiles: {', '.join(sorted(PROFILES))}"
        ) from None
    published = _PUBLISHED.get(profile.name, ())
    rows = []
    for pub in published:
        if pub.prompt:
            emulated = prefill_seconds(profile, pub.prompt)
            conditions = f"{pub.prompt}-token prompt alone"
        else:
            emulated = decode_step_seconds(profile, pub.batch, pub.context)
            conditions = f"batch {pub.batch}, mean context {pub.context} tokens"
        rows.append(
            CalibrationRow(
                profile.name, pub.quantity, conditions, "ms", emulated * 1e3, pub.value_ms, pub.kind, pub.source
            )
        )
    roofline_source = (
        f"{_ROOFLINE_SOURCE[profile.name]} — datasheet roofline at {ETA_BW:.0%} of memory bandwidth and "
        f"{MFU:.0%} of dense BF16 peak, max(weight read, compute) + KV read"
    )
    prompt = PREFILL_PROMPT_TOKENS
    rows.append(
        CalibrationRow(
            profile.name,
            "prefill throughput",
            f"{prompt}-token prompt in {profile.max_num_batched_tokens}-token chunks",
            "tokens/s",
            prompt / prefill_seconds(profile, prompt),
            prompt / roofline.prefill_s(profile, prompt),
            "roofline",
            roofline_source,
        )
    )
    context = DECODE_CONTEXT_TOKENS
    for batch in DECODE_BATCHES:
        if _covered(batch, published):
            continue
        rows.append(
            CalibrationRow(
                profile.name,
                "decode step",
                f"batch {batch}, {context} tokens of context each",
                "ms",
                decode_step_seconds(profile, batch, context) * 1e3,
                roofline.decode_s(batch, context) * 1e3,
                "roofline",
                roofline_source,
            )
        )
    return rows


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.2f}"


def markdown_table(rows: Sequence[CalibrationRow]) -> str:
    """A markdown table of ``rows``, one line per row."""
    lines = [
        "| Profile | Quantity | Conditions | Emulated | Reference | Kind | Difference | Source — figure |",
        "| --- | --- | --- | ---: | ---: | --- | ---: | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row.profile} | {row.quantity} ({row.unit}) | {row.conditions} | {_number(row.emulated)} | "
            f"{_number(row.reference)} | {row.kind} | {row.relative_difference:+.1%} | {row.source} |"
        )
    return "\n".join(lines)


def calibration_table() -> str:
    """The calibration table of every profile in `PROFILES`, as sim/README.md carries it."""
    return markdown_table([row for profile in PROFILES.values() for row in calibration_rows(profile)])


def main() -> None:
    print(calibration_table())


if __name__ == "__main__":
    main()
