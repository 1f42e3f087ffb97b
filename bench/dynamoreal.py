"""Dynamo's real KV router (``ai-dynamo-runtime``'s ``KvRouter``, its Rust scheduler) as a simulator policy, to check
the model of it (`inferlb.bench.peermodels.DynamoKv`) on a common run: the same trace, fleet, load and seed.

The router runs in this process with the runtime's local transports (file discovery in a scratch folder, TCP
request plane, ZMQ event plane: no NATS, no etcd). Each simulated server is one registered worker of one endpoint
(its own runtime, so its own instance id), with a `KvEventPublisher` that relays the server's cache events (the
simulator's `KVListener`) as vLLM's would. A request is routed with ``best_worker(tokens, request_id=...)``, which
also records it on the chosen worker; its first token is reported with ``mark_prefill_complete`` and its end with
``free``, at the points where the model takes them (`DynamoKv`).

The simulator's requests carry chained block hashes, not tokens: each block's 16 tokens are drawn from its hash
(equal hashes, equal tokens), so the router's own hashing of the tokens names the same blocks the servers cache;
a prompt's last, partial block gets tokens no other request has. Events reach the router's indexer through its
event plane: before each decision that follows new events the policy yields to the loop for ``event_wait_s``
(live, events lag the same way).

Needs ``ai-dynamo-runtime`` (``make bench-dynamo`` installs it in a venv of its own: it pins a pydantic older than
the project's). ``RuntimeError`` naming that where it is missing. The runtime binds some sockets (its event plane's
ZMQ publishers) on every interface, whatever host it is told: the policy refuses to start unless the process's
network namespace has loopback only (``make bench-dynamo`` runs the suite under ``unshare --net``).
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import tempfile
from collections.abc import Sequence
from typing import Any

from inferlb.sim.des import Arrival, FleetView, RequestRecord
from inferlb.sim.profiles import ServerProfile

__all__ = ["DYNAMO_RUNTIME_VERSION", "LOOPBACK_HOSTS", "RealDynamoKv", "block_key", "block_tokens", "loopback_only"]

DYNAMO_RUNTIME_VERSION = "1.6.1"
_ENDPOINT = "inferlb.backend.generate"
_MODEL = "bench-model"
_VOCAB = 1 << 31
# The runtime's settings of the hosts its sockets bind, where it takes one (the event plane's publishers do not).
LOOPBACK_HOSTS = ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST")


def block_tokens(block_hash: int, block_size: int) -> list[int]:
    """The ``block_size`` token ids of the block whose (chained) hash is ``block_hash``: a fixed draw from it."""
    draw = random.Random(block_hash)
    return [draw.randrange(_VOCAB) for _ in range(block_size)]


class _Relay:
    """One server's cache events, relayed to the router through its worker's publisher."""

    def __init__(self, publisher: Any, block_size: int, owner: RealDynamoKv) -> None:
        self.publisher, self.block_size, self.owner = publisher, block_size, owner

    def stored(self, hashes: list[int], parent: int | None, token_ids: Sequence[int]) -> None:
        tokens = [t for h in hashes for t in block_tokens(h, self.block_size)]
        self.publisher.publish_stored(tokens, [self.block_size] * len(hashes), [block_key(h) for h in hashes],
                                      None if parent is None else block_key(parent))  # fmt: skip
        self.owner.pending_events = True

    def removed(self, hashes: list[int]) -> None:
        self.publisher.publish_removed([block_key(h) for h in hashes])
        self.owner.pending_events = True

    def cleared(self) -> None:  # a restart; the bench's runs have none
        self.owner.pending_events = True


def loopback_only() -> list[str]:
    """The network interfaces of this process's namespace other than loopback (none: safe to start the runtime)."""
    return [name for _index, name in socket.if_nameindex() if name != "lo"]


def block_key(value: int) -> int:
    """A block hash as the publisher takes it (a signed 64-bit integer): its low 63 bits."""
    return value & 0x7FFF_FFFF_FFFF_FFFF


class RealDynamoKv:
    """Dynamo's ``KvRouter`` with its default config over the simulated servers (module docstring). Call `close`."""

    def __init__(self, profiles: Sequence[ServerProfile], seed: int, *, event_wait_s: float = 0.002) -> None:
        outside = loopback_only()
        if outside:
            raise RuntimeError(
                "Dynamo's runtime binds some of its sockets on every interface; run it in a network namespace with "
                f"loopback only (`make bench-dynamo` does: unshare --net); this one also has {', '.join(outside)}"
            )
        os.environ.setdefault("DYN_LOG", "error")  # before the import: the runtime logs every decision at info
        for name in LOOPBACK_HOSTS:  # the sockets that take a host bind to loopback (the event plane's do not)
            os.environ.setdefault(name, "127.0.0.1")
        try:
            from dynamo.llm import (
                KvEventPublisher,
                KvRouter,
                KvRouterConfig,
                ModelInput,
                ModelRuntimeConfig,
                ModelType,
                WorkerType,
                register_model,
            )
            from dynamo.runtime import DistributedRuntime
        except ImportError as error:
            raise RuntimeError(
                f"Dynamo's router needs ai-dynamo-runtime=={DYNAMO_RUNTIME_VERSION} ({error}); `make bench-dynamo` "
                "installs it in .venv/dynamo"
            ) from None
        sizes = {p.block_size for p in profiles}
        if len(sizes) != 1:
            raise ValueError(f"one block size across the fleet, not {sorted(sizes)}")
        self.block_size = sizes.pop()
        self.event_wait_s = event_wait_s
        self.pending_events = False
        self._seed = seed
        self._folder = tempfile.TemporaryDirectory(prefix="inferlb-dynamo-")
        os.environ["DYN_FILE_KV"] = self._folder.name  # the file discovery's root, read when a runtime starts
        self._loop = asyncio.new_event_loop()
        self._relays: list[_Relay] = []
        self._routed: dict[str, int] = {}
        self._prefilling: list[set[str]] = [set() for _ in profiles]

        async def handler(request: Any, context: Any = None) -> Any:  # never called: the policy only picks
            yield {"token_ids": [], "finish_reason": "stop"}

        async def start() -> tuple[Any, dict[int, int]]:
            loop = asyncio.get_running_loop()
            runtimes = [DistributedRuntime(loop, "file", "tcp", event_plane="zmq") for _ in profiles]
            endpoints = [runtime.endpoint(_ENDPOINT) for runtime in runtimes]
            self._serving = [asyncio.ensure_future(e.serve_endpoint(handler)) for e in endpoints]
            for endpoint, profile in zip(endpoints, profiles, strict=True):
                config = ModelRuntimeConfig()
                config.total_kv_blocks = profile.num_gpu_blocks
                config.max_num_seqs = profile.max_num_seqs
                config.max_num_batched_tokens = profile.max_num_batched_tokens
                config.kv_event_publishing_enabled = True
                await register_model(
                    ModelInput.Tokens, ModelType.Completions, endpoint, self._folder.name, _MODEL,
                    worker_type=WorkerType.Aggregated, kv_cache_block_size=self.block_size, runtime_config=config,
                    skip_model_assets=True,
                )  # fmt: skip
                self._relays.append(
                    _Relay(KvEventPublisher(endpoint, kv_block_size=self.block_size), self.block_size, self)
                )
            router = KvRouter(endpoints[0], self.block_size, KvRouterConfig())
            ids = {endpoint.connection_id(): i for i, endpoint in enumerate(endpoints)}
            for _ in range(200):  # the router learns its workers through discovery
                if len(await router.get_potential_loads([0] * self.block_size)) == len(endpoints):
                    break
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError("Dynamo's router did not discover every simulated worker within 10 s")
            self._runtimes = runtimes
            return router, ids

        self._router, self._index = self._loop.run_until_complete(start())
        self._listening = False

    def __call__(self, arrival: Arrival, view: FleetView) -> int:
        if not self._listening:
            for engine, relay in zip(view.engines, self._relays, strict=True):
                engine.cache.listener = relay
            self._listening = True
        return self._loop.run_until_complete(self._route(arrival, view))

    async def _route(self, arrival: Arrival, view: FleetView) -> int:
        for i, pending in enumerate(self._prefilling):  # first tokens since the last decision (as `DynamoKv`)
            if pending:
                for request in view.engines[i].running:
                    if request.id in pending and request.first_token_at is not None:
                        pending.discard(request.id)
                        await self._router.mark_prefill_complete(request.id)
        if self.pending_events:
            self.pending_events = False
            await asyncio.sleep(self.event_wait_s)
        tokens = self._tokens(arrival)
        worker, _rank, _overlap = await self._router.best_worker(tokens, request_id=arrival.id)
        chosen = self._index[worker]
        self._routed[arrival.id] = chosen
        self._prefilling[chosen].add(arrival.id)
        return chosen

    def _tokens(self, arrival: Arrival) -> list[int]:
        bs = self.block_size
        tokens = [t for h in arrival.prompt_hashes for t in block_tokens(h, bs)]
        tail = max(0, arrival.prompt_tokens - len(tokens))
        if tail:
            draw = random.Random(f"{self._seed}:{arrival.id}")
            tokens += [draw.randrange(_VOCAB) for _ in range(tail)]
        return tokens or [0]

    def finished(self, record: RequestRecord, now: float) -> None:
        """A request ended: free it on the router."""
        chosen = self._routed.pop(record.id, None)
        if chosen is None:
            return
        self._prefilling[chosen].discard(record.id)

        async def free() -> None:  # the router's calls need a running loop
            await self._router.free(record.id)

        self._loop.run_until_complete(free())

    def close(self) -> None:
        """Stop the workers' runtimes and the loop; remove the discovery folder."""

        async def stop() -> None:
            for runtime in self._runtimes:
                runtime.shutdown()
            for task in self._serving:
                task.cancel()
            await asyncio.sleep(0.05)

        try:
            self._loop.run_until_complete(stop())
        finally:
            self._loop.close()
            self._folder.cleanup()
