"""GPU x model profiles: the constants of the emulated engine's step-time model and its memory geometry.

The step-time model (`Profile.step_time`) of one engine step, as vLLM's V1 engine runs it (one forward pass over a
batch that mixes prefill chunks and decode tokens):

    t = step_s                      # launch/scheduling overhead and one read of the weights (the batch-1 floor)
      + prefill_token_s * P         # P: prompt tokens computed this step (compute-bound matmuls)
      + attention_pair_s * A        # A: sum over prefill chunks of chunk_tokens x context_tokens (causal attention)
      + decode_seq_s * D            # D: sequences decoding one token this step
      + kv_read_token_s * K         # K: KV-cache tokens the decode sequences read (memory-bound attention)

Every profile cites, next to its constants, the published measurements they were fitted to.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["PROFILES", "Profile", "get_profile"]


@dataclass(frozen=True, slots=True)
class Profile:
    """One GPU x model serving configuration. Immutable; times in seconds, sizes in bytes.

    ``num_gpu_blocks`` x ``block_size`` is the KV cache's capacity in tokens. ``gpu_count`` GPUs (tensor parallel
    degree) each have ``gpu_memory_bytes``; vLLM pre-allocates ``gpu_memory_utilization`` of it at start-up.
    """

    name: str
    gpu: str
    model: str
    gpu_count: int
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    block_size: int
    num_gpu_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    step_s: float
    prefill_token_s: float
    attention_pair_s: float
    decode_seq_s: float
    kv_read_token_s: float
    cold_start_s: float
    sources: tuple[str, ...]

    def step_time(self, prefill_tokens: int, attention_pairs: int, decode_seqs: int, kv_tokens: int) -> float:
        """Seconds one engine step takes (before jitter and fault slow-down)."""
        return (
            self.step_s
            + self.prefill_token_s * prefill_tokens
            + self.attention_pair_s * attention_pairs
            + self.decode_seq_s * decode_seqs
            + self.kv_read_token_s * kv_tokens
        )


_GIB = 1 << 30

# Provisional constants from a roofline estimate (H100 SXM: 3.35 TB/s, 989 TFLOPS dense BF16; Llama-3.1-8B BF16:
# 16 GB of weights, 128 KiB of KV per token); to be replaced by a fit to published measurements.
_H100_LLAMA8B = Profile(
    name="h100-llama3.1-8b",
    gpu="NVIDIA H100 80GB HBM3",
    model="meta-llama/Llama-3.1-8B-Instruct",
    gpu_count=1,
    gpu_memory_bytes=80 * _GIB,
    gpu_memory_utilization=0.9,
    block_size=16,
    num_gpu_blocks=29_000,
    max_num_batched_tokens=8192,
    max_num_seqs=256,
    max_model_len=131_072,
    step_s=6.0e-3,
    prefill_token_s=35e-6,
    attention_pair_s=2.0e-10,
    decode_seq_s=40e-6,
    kv_read_token_s=40e-9,
    cold_start_s=30.0,
    sources=("roofline estimate (provisional)",),
)

PROFILES = MappingProxyType({p.name: p for p in (_H100_LLAMA8B,)})


def get_profile(name: str) -> Profile:
    """The profile called ``name``; ValueError listing the known names otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known profiles: {', '.join(sorted(PROFILES))}") from None
