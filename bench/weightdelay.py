"""How long a pushed endpoint weight takes to change Envoy's traffic split (the weights tier).

Real Envoy in the weights tier (every /v1/ route to the fallback cluster, LEAST_REQUEST over EDS weights) in front
of two emulated servers; the control plane is inferlb's own (`filter.xds.ControlPlane`), run here on the picker's
address so that the weights are set by the benchmark, not by scores. A client sends short requests one after
another (one in flight, so LEAST_REQUEST picks by weight alone). Each round pushes 1000:1 for one server, waits
until it takes nine in ten requests, then pushes 1:1000 and times:

- ``ack_s``: from the push to Envoy's ACK of the new version (it has applied it);
- ``effect_s``: from the push to the first of ten requests in a row to the newly favoured server.

Done with the bootstrap's ``update_merge_window: 0s`` and with Envoy's default of 1 s, which holds an update back
to merge it with the next: the difference is the delay the bootstrap avoids.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import httpx
from envoy.service.discovery.v3 import ads_pb2_grpc

from inferlb.bench.stats import median
from inferlb.envoyconf import EnvoyOptions, render_bootstrap
from inferlb.filter.xds import ControlPlane, Member
from inferlb.picker import XDS_CLUSTERS
from inferlb.procs import free_port, stop_all
from inferlb.scorer.address import parse_address
from inferlb.stack import LocalStack, StackOptions, start_sim

__all__ = ["measure"]

MODEL = "m"
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 1}


class _Plane:
    """The control plane's gRPC server on a thread of its own (the benchmark's client is synchronous)."""

    def __init__(self, address: str) -> None:
        self.control = ControlPlane(XDS_CLUSTERS)
        self.address = address
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: grpc.aio.Server | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self._ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self.control, self._server)
        self._server.add_insecure_port(self.address)
        await self._server.start()

    def __enter__(self) -> _Plane:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the control plane did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(0), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    def publish(self, members: list[Member]) -> tuple[str, float]:
        """Push ``members``; the version and the monotonic time of the push."""
        done = asyncio.run_coroutine_threadsafe(self._publish(members), self.loop)
        return done.result(5)

    async def _publish(self, members: list[Member]) -> tuple[str, float]:
        self.control.publish(members)
        return str(self.control.version), self.control.stats.published_at

    def acked(self, version: str) -> float | None:
        return self.control.stats.acked_at.get(version)


def _favour(plane: _Plane, servers: list[tuple[str, int]], heavy: int) -> tuple[str, float]:
    return plane.publish([Member(h, p, 1000 if i == heavy else 1) for i, (h, p) in enumerate(servers)])


def _rounds(
    stack: LocalStack, plane: _Plane, addresses: list[str], rounds: int, budget_s: float = 10.0
) -> list[dict[str, Any]]:
    servers = [parse_address(a) for a in addresses]
    out = []
    with httpx.Client(base_url=stack.gateway_url, timeout=5) as client:

        def served() -> str:
            return client.post("/v1/completions", json=BODY).headers.get("x-inferlb-sim-server", "")

        for r in range(rounds):
            old, new = r % 2, 1 - r % 2
            _favour(plane, servers, old)
            recent: list[str] = []
            deadline = time.monotonic() + budget_s
            while time.monotonic() < deadline:  # until the old favourite takes nine in ten
                recent = [*recent[-19:], served()]
                if len(recent) == 20 and recent.count(addresses[old]) >= 18:
                    break
            version, pushed = _favour(plane, servers, new)
            run, effect, sent = 0, None, 0
            deadline = pushed + budget_s
            while time.monotonic() < deadline:
                at = time.monotonic()
                sent += 1
                if served() == addresses[new]:
                    run += 1
                    if run == 1:
                        first = at
                    if run == 10:
                        effect = first - pushed
                        break
                else:
                    run = 0
            acked = plane.acked(version)
            out.append(
                {
                    "ack_s": None if acked is None else round(acked - pushed, 4),
                    "effect_s": None if effect is None else round(effect, 4),
                    "requests": sent,
                }
            )
    return out


def measure(workdir: Path, *, rounds: int = 6, merge_windows_ms: tuple[int, ...] = (0, 1000)) -> list[dict[str, Any]]:
    """One row per merge window: the rounds and their medians."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    servers = [start_sim([a], workdir / f"weights-server-{i}.log", "--model", MODEL) for i, a in enumerate(addresses)]
    results = []
    try:
        for window in merge_windows_ms:
            envoy = EnvoyOptions(xds=True, tier="weights", eds_merge_window_ms=window, access_log_path=None)
            stack = LocalStack(
                StackOptions(models=(MODEL,), servers=tuple(addresses), envoy=envoy), workdir / f"w{window}"
            )
            stack.workdir.mkdir(parents=True, exist_ok=True)
            options = replace(envoy, listen=stack.gateway_address, admin=stack.admin_address)
            stack.envoy_path.write_text(render_bootstrap(stack.config, options), encoding="utf-8")
            with _Plane(stack.picker_address) as plane:
                _favour(plane, [parse_address(a) for a in addresses], 0)
                try:
                    stack.start_envoy()
                    measured = _rounds(stack, plane, addresses, rounds)
                finally:
                    stack.stop()
            acks = [m["ack_s"] for m in measured if m["ack_s"] is not None]
            effects = [m["effect_s"] for m in measured if m["effect_s"] is not None]
            results.append(
                {
                    "scenario": "weight-update",
                    "eds_merge_window_ms": window,
                    "sent": sum(m["requests"] for m in measured),
                    "errors": 0,
                    "first_request_after_join_s": None,
                    "retries": 0,
                    "ack_s_median": median(acks),
                    "effect_s_median": median(effects),
                    "effect_s_max": max(effects) if effects else None,
                    "rounds": measured,
                }
            )
    finally:
        stop_all(servers)
    return results
