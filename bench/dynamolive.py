"""Dynamo's serving stack (``ai-dynamo`` 1.6.1: its HTTP frontend with the KV router) in front of emulated servers,
as a live peer of the routing-quality benchmark (`inferlb.bench.peers`, "dynamo kv"):

    python -m inferlb.bench.dynamolive --server ADDR --kv-events-port PORT [...] --model-dir DIR --store DIR

A Dynamo deployment is a frontend (HTTP, tokenizer, router) and workers that register a model with it. Dynamo's
workers embed the engine (vLLM, SGLang, TensorRT-LLM); the emulator is an HTTP server, so this process runs one
worker per emulated server (each with a runtime of its own, hence an instance id of its own) that forwards each
request it is given to its server and streams the answer back. The frontend (``python -m dynamo.frontend``) is a
process of its own that `inferlb.bench.peers` starts beside this one; both find each other through Dynamo's file
discovery in ``--store``.

**Tokens.** The frontend tokenizes each prompt with the model's Hugging Face tokenizer and routes on the token ids.
The model folder this module writes (`write_model`) has one token per character: a Dynamo block of
`BLOCK_CHARS` (64) tokens is then exactly one of the emulator's blocks (16 tokens of 4 characters,
`inferlb.sim.tokens`), so the router's block counts, overlaps and prefill tokens over the block size are the
emulator's. A worker turns the ids back into the prompt's text and sends the text, so the server sees what the
other contenders send it. Each output token of the server is one token of the answer.

**KV events.** Each server publishes vLLM's ZMQ events (`inferlb.sim.kvevents`), whose block hashes cover the
emulator's own token ids. Dynamo's router hashes the tokens it is told a block holds, so each worker relays its
server's events through Dynamo's ``KvEventPublisher`` with the block's characters as its tokens, looked up from the
prompts the worker forwarded (`BlockTexts`); a block whose text it never saw (none in these runs: a server stores
only blocks of prompts it was sent) is counted and skipped.

Needs ``ai-dynamo`` and ``ai-dynamo-runtime`` (`make bench-dynamo-live` installs both in ``.venv/dynamo``), and a
network namespace with loopback only: Dynamo's runtime binds some sockets on every interface.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson

from inferlb.bench.dynamoreal import LOOPBACK_HOSTS, block_key, loopback_only
from inferlb.scorer.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventError,
    decode_frames,
)
from inferlb.sim.profiles import PROFILES, get_profile
from inferlb.sim.tokens import CHARS_PER_TOKEN, block_hashes

__all__ = ["BLOCK_CHARS", "ENDPOINT", "VOCAB", "BlockTexts", "dynamo_env", "main", "write_model"]

ENDPOINT = "inferlb.backend.generate"
# The emulator's block: 16 tokens of CHARS_PER_TOKEN characters (every profile's block size).
_SERVER_BLOCK_TOKENS = 16
BLOCK_CHARS = _SERVER_BLOCK_TOKENS * CHARS_PER_TOKEN
# One token per character: printable ASCII and the newline (the trace's prompts use 64 of them).
VOCAB: dict[str, int] = {
    "<unk>": 0,
    "<s>": 1,
    "</s>": 2,
    **{chr(c): 3 + i for i, c in enumerate([*range(32, 127), 10])},
}
_CHARS = {i: c for c, i in VOCAB.items() if len(c) == 1}
_ANSWER_TOKEN = VOCAB["a"]

logger = logging.getLogger("inferlb.bench.dynamolive")


def dynamo_env(store: Path) -> dict[str, str]:
    """The environment both Dynamo processes need: file discovery under ``store``, sockets that take a host on
    loopback, warnings (the frontend still logs one line per routed request), no Hugging Face downloads."""
    env = {name: "127.0.0.1" for name in LOOPBACK_HOSTS}
    env |= {"DYN_FILE_KV": str(store), "DYN_LOG": "warn", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return env


def write_model(folder: Path) -> None:
    """Write the model folder the workers register and the frontend loads: a one-token-per-character tokenizer
    (``tokenizer.json``), its ``tokenizer_config.json`` and a ``config.json`` (no weights: nothing runs a model)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    limit = 1 << 22  # characters: far above any trace's prompt
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": limit,
        "add_bos_token": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), "utf-8")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "max_position_embeddings": limit,
        "bos_token_id": VOCAB["<s>"],
        "eos_token_id": VOCAB["</s>"],
        "vocab_size": len(VOCAB),
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
    }
    (folder / "config.json").write_text(json.dumps(config), "utf-8")


def served_model(server: str) -> str:
    """The first model ``server`` (``ip:port``) lists at ``/v1/models``. HTTPError, or ValueError for none."""
    response = httpx.get(f"http://{server}/v1/models", timeout=10.0)
    response.raise_for_status()
    models = [m.get("id") for m in response.json().get("data", ()) if isinstance(m, dict)]
    if not models or not isinstance(models[0], str):
        raise ValueError("no model listed at /v1/models")
    return models[0]


def prompt_text(token_ids: Sequence[int]) -> str:
    """The text of the frontend's token ids (`VOCAB`); an id outside it (none from this tokenizer) becomes ``?``."""
    return "".join(_CHARS.get(t, "?") for t in token_ids)


class BlockTexts:
    """The text of each full emulator block of the prompts a worker forwarded, by the emulator's block hash, the
    ``capacity`` most recent (far above what a server's cache holds in these runs). Not thread-safe: one event loop."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1; got {capacity}")
        self.capacity = capacity
        self._texts: OrderedDict[int, str] = OrderedDict()
        self.unknown = 0  # stored blocks whose text was never seen (skipped)

    def remember(self, text: str) -> None:
        """Note the blocks of a prompt about to be sent to the server."""
        for j, block_hash in enumerate(block_hashes(text, _SERVER_BLOCK_TOKENS)):
            self._texts[block_hash] = text[j * BLOCK_CHARS : (j + 1) * BLOCK_CHARS]
            self._texts.move_to_end(block_hash)
        while len(self._texts) > self.capacity:
            self._texts.popitem(last=False)

    def tokens(self, hashes: Sequence[int]) -> list[int] | None:
        """The Dynamo tokens of the blocks ``hashes`` (in order), or None if any block's text is unknown."""
        texts = [self._texts.get(h) for h in hashes]
        if any(t is None for t in texts):
            self.unknown += len(hashes)
            return None
        return [VOCAB[c] for text in texts for c in text or ""]


def relay(batch: EventBatch, texts: BlockTexts, publisher: Any) -> None:
    """Publish one server event batch through Dynamo's ``KvEventPublisher`` (hashes as its signed 64-bit ids)."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            tokens = texts.tokens(event.block_hashes)
            if tokens is None:
                continue
            parent = None if event.parent_block_hash is None else block_key(int(event.parent_block_hash))
            hashes = [block_key(int(h)) for h in event.block_hashes]
            publisher.publish_stored(tokens, [BLOCK_CHARS] * len(hashes), hashes, parent)
        elif isinstance(event, BlockRemoved):
            publisher.publish_removed([block_key(int(h)) for h in event.block_hashes])
        elif isinstance(event, AllBlocksCleared):  # a server restart; these runs have none
            logger.warning("a server cleared its cache; Dynamo 1.6.1's publisher has no event for that, not relayed")


async def _answer(client: httpx.AsyncClient, server: str, model: str, request: dict[str, Any], texts: BlockTexts
                  ) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
    text = prompt_text(request.get("token_ids") or ())
    texts.remember(text)
    stop = request.get("stop_conditions") or {}
    body: dict[str, Any] = {"model": model, "prompt": text, "stream": True}
    if stop.get("max_tokens"):
        body["max_tokens"] = stop["max_tokens"]
    async with client.stream("POST", f"http://{server}/v1/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread())[:200].decode("utf-8", "replace")
            yield {
                "token_ids": [],
                "finish_reason": f"error: server {server} answered {response.status_code}: {detail}",
            }
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in orjson.loads(line[6:]).get("choices", ()):
                if choice.get("text"):
                    yield {"token_ids": [_ANSWER_TOKEN]}
    yield {"token_ids": [], "finish_reason": "length"}


async def serve(args: argparse.Namespace) -> None:
    """Register one worker per server, relay the servers' KV events, serve until SIGTERM or SIGINT."""
    import zmq
    import zmq.asyncio
    from dynamo.llm import KvEventPublisher, ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    profile = get_profile(args.profile)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None))
    context = zmq.asyncio.Context()
    runtimes = [DistributedRuntime(loop, "file", "tcp", event_plane="zmq") for _ in args.server]
    tasks: list[asyncio.Future[Any]] = []

    def handler(server: str, texts: BlockTexts) -> Any:
        async def generate(request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
            async for out in _answer(client, server, args.model, request, texts):
                yield out

        return generate

    async def follow(port: int, texts: BlockTexts, publisher: Any) -> None:
        socket = context.socket(zmq.SUB)
        socket.connect(f"tcp://127.0.0.1:{port}")
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        while True:
            frames = await socket.recv_multipart()
            try:
                _sequence, batch = decode_frames(frames)
            except KVEventError as error:  # the emulator's own events: a bug to see, not a reason to stop relaying
                logger.warning("port %d: undecodable KV event message skipped: %s", port, error)
                continue
            relay(batch, texts, publisher)

    all_texts = []
    for runtime, server, port in zip(runtimes, args.server, args.kv_events_port, strict=True):
        endpoint = runtime.endpoint(ENDPOINT)
        texts = BlockTexts()
        all_texts.append(texts)
        tasks.append(asyncio.ensure_future(endpoint.serve_endpoint(handler(server, texts))))
        config = ModelRuntimeConfig()
        config.total_kv_blocks = profile.num_gpu_blocks
        config.max_num_seqs = profile.max_num_seqs
        config.max_num_batched_tokens = profile.max_num_batched_tokens * CHARS_PER_TOKEN
        config.kv_event_publishing_enabled = True
        await register_model(
            ModelInput.Tokens, ModelType.Completions, endpoint, str(args.model_dir), args.model,
            worker_type=WorkerType.Aggregated, kv_cache_block_size=BLOCK_CHARS, runtime_config=config,
        )  # fmt: skip
        tasks.append(asyncio.ensure_future(follow(port, texts, KvEventPublisher(endpoint, kv_block_size=BLOCK_CHARS))))
    logger.warning("serving %d workers for %s", len(runtimes), ", ".join(args.server))
    await stop.wait()
    unknown = sum(t.unknown for t in all_texts)
    if unknown:
        logger.warning("%d stored blocks were not relayed: their text was never forwarded", unknown)
    for runtime in runtimes:
        runtime.shutdown()
    for task in tasks:
        task.cancel()
    await client.aclose()
    context.destroy(linger=0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", required=True, help="an emulated server's ip:port (repeat)")
    parser.add_argument("--kv-events-port", type=int, action="append", required=True, help="its KV events (repeat)")
    parser.add_argument("--model", help="the served model name (default: the first server's first model)")
    parser.add_argument("--model-dir", type=Path, required=True, help="the model folder (written here)")
    parser.add_argument("--store", type=Path, required=True, help="Dynamo's file discovery folder")
    parser.add_argument("--profile", default="h100-llama3.1-8b", choices=sorted(PROFILES))
    args = parser.parse_args(argv)
    if len(args.server) != len(args.kv_events_port):
        parser.error("one --kv-events-port per --server")
    outside = loopback_only()
    if outside:
        parser.error(f"Dynamo binds some sockets on every interface; run in a loopback-only namespace, not {outside}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    os.environ.update(dynamo_env(args.store))  # read by the runtime when it starts
    if args.model is None:
        try:
            args.model = served_model(args.server[0])
        except (httpx.HTTPError, ValueError) as error:
            parser.error(f"--model not given and {args.server[0]} did not name its model: {error}")
    write_model(args.model_dir)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
