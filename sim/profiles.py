"""GPU x model profiles: the constants of the emulated engine's step-time model and its memory geometry.

The step-time model (`ServerProfile.step_time`) of one engine step, as vLLM's V1 engine runs it (one forward pass over a
batch that mixes prefill chunks and decode tokens):

    t = step_s                      # launch/scheduling overhead and one read of the weights (the batch-1 floor)
      + prefill_token_s * P         # P: prompt tokens computed this step (compute-bound matmuls)
      + attention_pair_s * A        # A: sum over prefill chunks of chunk_tokens x context_tokens (causal attention)
      + decode_seq_s * D            # D: sequences decoding one token this step
      + kv_read_token_s * K         # K: KV-cache tokens the decode sequences read (memory-bound attention)

How the constants were fitted (details next to each profile, the published figures in ``sources`` and, as data, in
`inferlb.sim.calibration`):

* ``step_s``: the measured batch-1 time per output token where one is published for a current vLLM (H100 and A100
  Llama-3.1-8B), less the per-sequence and KV-read share; elsewhere the weight bytes read at ``ETA_BW`` of the
  datasheet memory bandwidth (the fraction the two measured pairs reach).
* ``kv_read_token_s``: KV bytes per token (per GPU) read at ``ETA_BW`` of the datasheet bandwidth.
* ``prefill_token_s`` and ``attention_pair_s``: linear-layer FLOPs per token (2 x non-embedding parameters) and
  attention FLOPs per query/key pair (4 x layers x heads x head_dim), at ``MFU`` of the datasheet dense BF16 peak.
  ``MFU`` is the value that reproduces the one published prefill measurement found (a 500-token TTFT on A100).
* ``decode_seq_s``: where a pair's decode was measured from batch 1 to batch 52-64 (H100, A100 and 4xH100 with
  Llama-3 8B/70B, one vLLM run each, see `inferlb.sim.calibration`), the least-squares slope of step time against
  batch over the whole run, with the KV read fixed at ``kv_read_token_s`` and the run's own floor (0.8-1.8 ms above
  ``step_s``: an older vLLM) left out. The slopes are 0.5-1.1 x ``prefill_token_s``: at these batch sizes the
  decode matmuls do not hide under the weight reads. L4 keeps 0.3 x ``prefill_token_s``, an earlier fit to the
  H100 growth from 1 to 4 sequences, which the batch-64 runs show is too low.

Memory: ``num_gpu_blocks`` is computed as vLLM does (`MemoryPlan.gpu_blocks`): ``gpu_memory_utilization`` x the
GPU's memory, less this GPU's weight shard and the activation/non-torch reserve of vLLM's profiling run, divided by
``block_size`` x KV bytes per token per GPU.

Limits: the model is additive where real kernels overlap (weight reads hide under prefill compute), ignores CUDA
graph padding, sampler cost and CPU scheduling gaps; prefill rests on one 500-token A100 measurement and every L4
constant on datasheet rooflines (see sim/README.md, "Calibration").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby
from types import MappingProxyType

__all__ = [
    "ETA_BW",
    "MEMORY_PLANS",
    "MFU",
    "PROFILES",
    "MemoryPlan",
    "ServerProfile",
    "fleet_name",
    "fleet_of",
    "get_profile",
    "parse_fleet",
]


@dataclass(frozen=True, slots=True)
class ServerProfile:
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


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """One GPU's memory budget for a profile, as vLLM computes it at start-up. Sizes in bytes, per GPU.

    ``weight_bytes`` is this GPU's shard of the weights (BF16: 2 bytes x parameters / tensor-parallel degree),
    ``kv_bytes_per_token`` this GPU's share of one token's K and V over all layers, ``reserve_bytes`` the activation
    peak plus non-torch memory that vLLM's profiling run finds (an estimate here, stated per profile).
    """

    weight_bytes: int
    kv_bytes_per_token: int
    reserve_bytes: int

    def kv_bytes(self, gpu_memory_bytes: int, utilization: float) -> float:
        """Bytes left for the KV cache: ``utilization`` x memory, less weights and reserve."""
        return utilization * gpu_memory_bytes - self.weight_bytes - self.reserve_bytes

    def gpu_blocks(self, gpu_memory_bytes: int, utilization: float, block_size: int) -> int:
        """KV blocks of ``block_size`` tokens that fit (vLLM's ``num_gpu_blocks``); ValueError if none fit."""
        blocks = int(self.kv_bytes(gpu_memory_bytes, utilization) // (block_size * self.kv_bytes_per_token))
        if blocks <= 0:
            raise ValueError(
                f"no KV blocks fit: {utilization} x {gpu_memory_bytes} bytes minus {self.weight_bytes} of weights "
                f"and {self.reserve_bytes} of reserve leaves nothing; raise gpu_memory_utilization or use more GPUs"
            )
        return blocks


_GIB = 1 << 30
_MIB = 1 << 20

# Fraction of datasheet memory bandwidth that batch-1 decode reaches in vLLM, overheads included: H100 SXM
# 16.06 GB / 3.35 TB/s = 4.79 ms against 6.48 ms measured (0.74); A100 40GB is reported at "roughly 77%".
ETA_BW = 0.75
# Fraction of datasheet dense BF16 peak reached by prefill: fitted to the 500-token TTFT of 48.3 ms measured on
# A100 80GB SXM (184 of 312 TFLOPS), then assumed for the other GPUs (no prefill measurement found for them).
MFU = 0.59

_BLOCK = 16
_UTIL = 0.9  # vLLM's default --gpu-memory-utilization

# Model facts (config.json): Llama-3.1-8B 32 layers x 8 KV heads x 128 head_dim -> 2*32*8*128*2 = 131072 bytes of
# KV per token; 8,030,261,248 parameters. Llama-3.2-3B: 28 layers x 8 KV heads x 128 -> 114688 bytes per token;
# 3,212,749,824 parameters. Llama-3.1-70B: 80 layers x 8 KV heads x 128 -> 327680 bytes per token, 81920 per GPU at
# TP4 (2 KV heads each); 70,553,706,496 parameters.
_PARAMS_8B = 8_030_261_248
_PARAMS_3B = 3_212_749_824
_PARAMS_70B = 70_553_706_496

# Total memory as nvidia-smi reports it: H100 80GB HBM3 81559 MiB, A100-SXM4-80GB 81920 MiB, L4 23034 MiB.
_H100_MEM = 81559 * _MIB
_A100_MEM = 81920 * _MIB
_L4_MEM = 23034 * _MIB

_URL_H100 = "https://www.nvidia.com/en-us/data-center/h100/"
_URL_A100 = "https://www.nvidia.com/en-us/data-center/a100/"
_URL_L4 = "https://www.nvidia.com/en-us/data-center/l4/"
_URL_8B = "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json"
_URL_3B = "https://huggingface.co/meta-llama/Llama-3.2-3B-Instruct/blob/main/config.json"
_URL_70B = "https://huggingface.co/meta-llama/Llama-3.1-70B-Instruct/blob/main/config.json"
_URL_DEFAULTS = "https://github.com/vllm-project/vllm/blob/main/vllm/engine/arg_utils.py"
_URL_H100_DECODE = "https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/"
_URL_A100_DECODE = "https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on"
_URL_A100_TTFT = "https://docs.nvidia.com/nim/llama-3-1-nemotron-safety-guard-8b/1.10.1/performance.md"
_URL_LAMBDA = "https://github.com/LambdaLabsML/vllm-benchmark/blob"

_SRC_DEFAULTS = (
    f"{_URL_DEFAULTS} — vLLM V1 online-serving defaults: GPUs with >= 70 GiB other than A100 get "
    "max_num_batched_tokens 8192 and max_num_seqs 1024; all others 2048 and 256"
)
_SRC_MFU = f"{_URL_A100_TTFT} — A100 80GB SXM, BF16, Llama-3.1-8B architecture: TTFT 48.3 ms for 500 input tokens"

MEMORY_PLANS: Mapping[str, MemoryPlan] = MappingProxyType(
    {
        # Reserve: ~1.5 GiB activation peak for an 8192-token profiling batch (MLP intermediate 8192 x 14336 x 2 x 2
        # bytes, logits for up to 1024 sequences) plus non-torch memory; an estimate, not a measurement.
        "h100-llama3.1-8b": MemoryPlan(2 * _PARAMS_8B, 131_072, 2 * _GIB),
        # 2048-token profiling batch: a smaller activation peak.
        "a100-llama3.1-8b": MemoryPlan(2 * _PARAMS_8B, 131_072, 1 * _GIB),
        "l4-llama3.2-3b": MemoryPlan(2 * _PARAMS_3B, 114_688, 819 * _MIB),
        # Per GPU at TP4; the reserve adds NCCL/custom all-reduce buffers.
        "h100x4-llama3.1-70b": MemoryPlan(2 * _PARAMS_70B // 4, 81_920, 3 * _GIB),
    }
)


def _blocks(name: str, gpu_memory_bytes: int) -> int:
    return MEMORY_PLANS[name].gpu_blocks(gpu_memory_bytes, _UTIL, _BLOCK)


# H100 SXM 3.35 TB/s, 989 dense BF16 TFLOPS. Batch-1 decode measured at 6.48 ms/token (vLLM 0.21, short chat
# prompts, ~512 tokens of context assumed) and 6.59 ms at 4 concurrent requests.
_H100_LLAMA8B = ServerProfile(
    name="h100-llama3.1-8b",
    gpu="NVIDIA H100 80GB HBM3 (SXM)",
    model="meta-llama/Llama-3.1-8B-Instruct",
    gpu_count=1,
    gpu_memory_bytes=_H100_MEM,
    gpu_memory_utilization=_UTIL,
    block_size=_BLOCK,
    num_gpu_blocks=_blocks("h100-llama3.1-8b", _H100_MEM),  # 28,019 blocks = 448k tokens
    max_num_batched_tokens=8192,  # vLLM default for H100 online serving
    max_num_seqs=1024,  # vLLM default for H100 online serving
    max_model_len=131_072,
    step_s=6.44e-3,  # 6.48 ms measured at batch 1, less 12.5 us per sequence and 512 x 52.2 ns of KV read
    prefill_token_s=23.9e-6,  # 13.96 GFLOP per token / (0.59 x 989 TFLOPS)
    attention_pair_s=0.90e-9,  # 524,288 FLOP per pair / (0.59 x 989 TFLOPS)
    decode_seq_s=12.5e-6,  # least-squares slope of the measured batch 1-64 run; gives 6.60 ms at 4 (6.59 measured)
    kv_read_token_s=52.2e-9,  # 131,072 bytes / (0.75 x 3.35 TB/s)
    cold_start_s=45.0,  # estimate: 16 GB of safetensors from local NVMe (~10 s) + torch.compile and graph capture
    sources=(
        f"{_URL_H100_DECODE} — H100-80GB-HBM3, vLLM 0.21, Llama-3.1-8B-Instruct fp16: TPOT p50 6.48 ms at "
        "concurrency 1 and 6.59 ms at concurrency 4 (fits step_s)",
        f"{_URL_LAMBDA}/a4f9f4371a1ccac781293837fce2bce0cc6d25cc/results/prompt_80/1xH100-80GB-SXM/"
        "Meta-Llama-3-8B-Instruct_tp1_len2048.json — 1x H100-80GB-SXM, "
        "Meta-Llama-3-8B-Instruct BF16, vLLM run of 2024-09-07: decode steps of 7.2 ms with 2 requests to 9.04 ms "
        "with 64 (fits decode_seq_s)",
        f"{_URL_H100} — H100 SXM: 3.35 TB/s memory bandwidth, 989 TFLOPS dense BF16 (1,979 with sparsity)",
        _SRC_MFU + " (fits MFU 0.59, carried to H100 for prefill_token_s and attention_pair_s)",
        f"{_URL_8B} — 32 layers, 8 KV heads, head_dim 128, hidden 4096, vocab 128256 (131,072 KV bytes per token)",
        _SRC_DEFAULTS,
    ),
)

# A100 SXM 80GB: 2,039 GB/s, 312 dense BF16 TFLOPS. Batch-1 decode measured on the 40GB part (1,555 GB/s) at
# ~75 tokens/s = 13.3 ms per token with 1024-1152 tokens of context; scaled by bandwidth: 10.17 ms on 80GB. Decode
# from batch 1 to 64 measured on the 80GB part with an older vLLM (about 10% slower at batch 1).
_A100_LLAMA8B = ServerProfile(
    name="a100-llama3.1-8b",
    gpu="NVIDIA A100-SXM4-80GB",
    model="meta-llama/Llama-3.1-8B-Instruct",
    gpu_count=1,
    gpu_memory_bytes=_A100_MEM,
    gpu_memory_utilization=_UTIL,
    block_size=_BLOCK,
    num_gpu_blocks=_blocks("a100-llama3.1-8b", _A100_MEM),  # 28,693 blocks = 459k tokens
    max_num_batched_tokens=2048,  # vLLM excludes A100 from the large-GPU defaults
    max_num_seqs=256,
    max_model_len=131_072,
    step_s=10.0e-3,  # 10.17 ms scaled batch-1 figure, less 75 us per sequence and 1088 x 85.7 ns of KV read
    prefill_token_s=75.8e-6,  # 13.96 GFLOP per token / 184 TFLOPS (the TTFT fit)
    attention_pair_s=2.85e-9,  # 524,288 FLOP per pair / 184 TFLOPS
    decode_seq_s=75.0e-6,  # least-squares slope of the measured batch 1-64 run (11.2 ms at 2 to 17.37 ms at 64)
    kv_read_token_s=85.7e-9,  # 131,072 bytes / (0.75 x 2.039 TB/s)
    cold_start_s=50.0,  # estimate, as for H100 with slower compile and graph capture
    sources=(
        f"{_URL_A100_DECODE} — A100 40GB, vLLM 0.23, Llama-3.1-8B-Instruct BF16, 1024 in / 128 out: about 75 "
        "tokens/s at concurrency 1, 'roughly 77%' of the bandwidth ceiling (fits step_s after a 1555/2039 "
        "bandwidth scaling)",
        _SRC_MFU + " (fits prefill_token_s and attention_pair_s)",
        f"{_URL_LAMBDA}/a9b42a5f83bc39976bcb6bd44a96b2b15d820e10/results/prompt_80/1xA100-80GB-SXM/"
        "Meta-Llama-3-8B-Instruct_tp1_len2000.json — 1x A100-80GB-SXM, "
        "Meta-Llama-3-8B-Instruct BF16, vLLM run of 2024-09-07: decode steps of 11.2 ms with 2 requests to "
        "17.37 ms with 64 (fits decode_seq_s)",
        f"{_URL_A100} — A100 SXM 80GB: 2,039 GB/s memory bandwidth, 312 TFLOPS dense BF16; A100 40GB: 1,555 GB/s",
        f"{_URL_8B} — 32 layers, 8 KV heads, head_dim 128, hidden 4096, vocab 128256 (131,072 KV bytes per token)",
        _SRC_DEFAULTS,
    ),
)

# L4: 300 GB/s, 121 dense BF16 TFLOPS (242 with sparsity), 72 W. No published measurement of this pair was found:
# every constant is the datasheet roofline at the efficiencies measured on H100/A100. KV capacity is 126k tokens,
# below 131072, so vLLM would refuse max_model_len 131072; 32768 is used.
_L4_LLAMA3B = ServerProfile(
    name="l4-llama3.2-3b",
    gpu="NVIDIA L4 24GB",
    model="meta-llama/Llama-3.2-3B-Instruct",
    gpu_count=1,
    gpu_memory_bytes=_L4_MEM,
    gpu_memory_utilization=_UTIL,
    block_size=_BLOCK,
    num_gpu_blocks=_blocks("l4-llama3.2-3b", _L4_MEM),  # 7,876 blocks = 126k tokens
    max_num_batched_tokens=2048,  # vLLM default below 70 GiB
    max_num_seqs=256,
    max_model_len=32_768,
    step_s=28.6e-3,  # 6.43 GB of weights / (0.75 x 300 GB/s)
    prefill_token_s=79.0e-6,  # 5.64 GFLOP per token / (0.59 x 121 TFLOPS)
    attention_pair_s=4.82e-9,  # 344,064 FLOP per pair / (0.59 x 121 TFLOPS)
    decode_seq_s=23.7e-6,  # 0.3 x prefill_token_s (no measurement; the measured pairs fit 0.5-1.1 x)
    kv_read_token_s=510e-9,  # 114,688 bytes / (0.75 x 300 GB/s)
    cold_start_s=35.0,  # estimate: 6.4 GB of weights + compile and graph capture
    sources=(
        f"{_URL_L4} — L4: 300 GB/s memory bandwidth, 242 TFLOPS BF16 with sparsity (121 dense), 24 GB",
        f"{_URL_H100_DECODE} — H100 batch-1 TPOT 6.48 ms (sets ETA_BW 0.75, carried to L4)",
        _SRC_MFU + " (sets MFU 0.59, carried to L4)",
        f"{_URL_3B} — 28 layers, 24 heads, 8 KV heads, head_dim 128, hidden 3072, tied embeddings (114,688 KV bytes "
        "per token)",
        _SRC_DEFAULTS,
    ),
)

# 4x H100 SXM, TP4 over NVLink. step_s, prefill and KV read: per-GPU rooflines (a quarter of the weights, FLOPs and
# KV heads each) at the measured efficiencies, plus estimated tensor-parallel costs. Decode from batch 1 to 52 was
# measured (Llama-3-70B BF16, older vLLM): 17.03 ms at batch 1, 9% above step_s, as the same run's 8B H100 figure is
# above the current vLLM's; decode_seq_s is fitted to that run.
_H100X4_LLAMA70B = ServerProfile(
    name="h100x4-llama3.1-70b",
    gpu="4x NVIDIA H100 80GB HBM3 (SXM, NVLink)",
    model="meta-llama/Llama-3.1-70B-Instruct",
    gpu_count=4,
    gpu_memory_bytes=_H100_MEM,
    gpu_memory_utilization=_UTIL,
    block_size=_BLOCK,
    num_gpu_blocks=_blocks("h100x4-llama3.1-70b", _H100_MEM),  # 29,350 blocks = 470k tokens
    max_num_batched_tokens=8192,
    max_num_seqs=1024,
    max_model_len=131_072,
    step_s=15.6e-3,  # 35.3 GB per GPU / (0.75 x 3.35 TB/s) = 14.0 ms + 160 all-reduces x ~10 us (estimate)
    prefill_token_s=65.7e-6,  # 34.2 GFLOP per token per GPU / (0.59 x 989 TFLOPS) + 12% all-reduce (estimate)
    attention_pair_s=1.12e-9,  # 655,360 FLOP per pair per GPU / (0.59 x 989 TFLOPS)
    decode_seq_s=70.0e-6,  # least-squares slope of the measured batch 1-52 run (17.3 ms at 2 to 20.50 ms at 52)
    kv_read_token_s=32.6e-9,  # 81,920 bytes per GPU / (0.75 x 3.35 TB/s)
    cold_start_s=90.0,  # estimate: 35 GB per rank in parallel, NCCL set-up, compile and graph capture
    sources=(
        f"{_URL_H100} — H100 SXM: 3.35 TB/s memory bandwidth, 989 TFLOPS dense BF16, 900 GB/s NVLink",
        f"{_URL_H100_DECODE} — H100 batch-1 TPOT 6.48 ms for Llama-3.1-8B (sets ETA_BW 0.75)",
        _SRC_MFU + " (sets MFU 0.59, carried to H100)",
        f"{_URL_LAMBDA}/a4f9f4371a1ccac781293837fce2bce0cc6d25cc/results/prompt_80/4xH100-80GB-SXM/"
        "Meta-Llama-3-70B-Instruct_tp4_len2048.json — 4x H100-80GB-SXM, "
        "TP4, Meta-Llama-3-70B-Instruct BF16, vLLM run of 2024-09-07: decode steps of 17.3 ms with 2 requests to "
        "20.50 ms with 52 (fits decode_seq_s)",
        f"{_URL_70B} — 80 layers, 64 heads, 8 KV heads, head_dim 128, hidden 8192, vocab 128256 (327,680 KV bytes "
        "per token, 81,920 per GPU at TP4)",
        _SRC_DEFAULTS,
    ),
)

PROFILES: Mapping[str, ServerProfile] = MappingProxyType(
    {p.name: p for p in (_H100_LLAMA8B, _A100_LLAMA8B, _L4_LLAMA3B, _H100X4_LLAMA70B)}
)


def get_profile(name: str) -> ServerProfile:
    """The profile called ``name``; ValueError listing the known names otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known profiles: {', '.join(sorted(PROFILES))}") from None


def parse_fleet(text: str) -> tuple[ServerProfile, ...]:
    """A fleet given as ``PROFILE:COUNT[,PROFILE:COUNT...]`` (``h100-llama3.1-8b:8,l4-llama3.2-3b:8``; a bare
    ``PROFILE`` is one server), one profile per server in the order given. ValueError naming the fault: an unknown
    profile, a count that is not a positive integer, an empty fleet, or profiles whose KV blocks differ in size
    (the servers of one pool must hash a prompt into the same blocks)."""
    shape = "expected PROFILE:COUNT[,PROFILE:COUNT...], e.g. h100-llama3.1-8b:8,l4-llama3.2-3b:8"
    fleet: list[ServerProfile] = []
    for part in text.split(","):
        name, sep, count_text = part.strip().partition(":")
        if not name:
            raise ValueError(f"bad fleet {text!r}: an empty entry; {shape}")
        profile = get_profile(name)
        count = 1
        if sep:
            try:
                count = int(count_text)
            except ValueError:
                count = 0
            if count < 1:
                raise ValueError(f"bad fleet {text!r}: {count_text!r} is not a positive server count; {shape}")
        fleet += [profile] * count
    sizes = {p.block_size for p in fleet}
    if len(sizes) > 1:
        raise ValueError(f"bad fleet {text!r}: its profiles use KV blocks of {sorted(sizes)} tokens; one size only")
    return tuple(fleet)


def fleet_name(fleet: Sequence[ServerProfile]) -> str:
    """The canonical ``PROFILE:COUNT,...`` of a fleet (runs of one profile counted), what `parse_fleet` reads;
    the plain profile name for a fleet of one profile."""
    runs = [(name, len(list(group))) for name, group in groupby(p.name for p in fleet)]
    if len(runs) == 1:
        return runs[0][0]
    return ",".join(f"{name}:{count}" for name, count in runs)


def fleet_of(profile: str, servers: int) -> list[ServerProfile]:
    """One profile per server: ``servers`` of the profile named, or the fleet ``PROFILE:COUNT,...`` describes
    (`parse_fleet`), which must count ``servers``. ValueError otherwise."""
    if ":" not in profile and "," not in profile:
        return [get_profile(profile)] * servers
    fleet = list(parse_fleet(profile))
    if len(fleet) != servers:
        raise ValueError(f"the fleet {profile!r} counts {len(fleet)} servers, not {servers}")
    return fleet
