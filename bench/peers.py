"""Peer routers for the routing-quality benchmark: vllm-router and sglang-router from PyPI, on loopback.

Each contender in `PEERS` is one router with one policy, run as its own process in front of the same emulated
servers as the picker. Both are Rust servers behind a Python launcher (``vllm-router``, ``sglang-router launch``)
and are optional (``pip install 'inferlb[peers]'``): `available` says why one cannot run, `start_peer` starts one
and returns once it routes to every worker.

What they ask the servers, observed against the emulator (vllm-router 0.1.17, sglang-router 0.3.2):

* vllm-router ``cache_aware``: for each completion, ``POST /v1/completions/render`` on every worker; for each chat,
  ``POST /v1/chat/completions/render`` and then ``POST /tokenize`` with the messages on every worker. It routes on
  characters (its prefix tree holds text), so these calls cost the servers work without steering the choice.
  vLLM 0.32 answers the render routes 403 unless started with ``--enable-scale-out``; so does the emulator.
* vllm-router ``consistent_hash``: no side calls; each request goes to the worker that owns its key on a hash ring
  (a session header or body field when the request has one, else the request's text).
* ``power_of_two`` (both): ``GET /get_load`` on every worker, every ``--worker-startup-check-interval`` seconds.
  vLLM has no such route (404), so both fall back to the requests they themselves have in flight per worker.
* sglang-router at start-up: an HTTP/2 preface (``PRI *``, to detect gRPC workers; the emulator's uvicorn logs
  "Invalid HTTP request received."), then ``/server_info``, ``/get_server_info``, ``/model_info`` and
  ``/get_model_info`` (404 on vLLM). The model is then "unknown": harmless, as the model is only used to pick workers
  in its multi-model mode, which is off.

Neither needs a tokenizer to route HTTP workers; the environment forbids Hugging Face downloads all the same.

``dynamo kv`` is NVIDIA Dynamo's HTTP frontend with its KV router (``ai-dynamo`` 1.6.1, at its defaults) and one
Dynamo worker per server, each forwarding to its server and relaying the server's KV events
(`inferlb.bench.dynamolive`). It is two processes, both of this Python (``.venv/dynamo``: the runtime pins an older
pydantic than the project's), and must run in a network namespace with loopback only, as Dynamo binds some sockets
on every interface (`make bench-dynamo-live`). The servers must publish KV events (``kv_events_ports``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import ipaddress
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

from inferlb.procs import ManagedProcess, ProcessError, find_tool, free_port
from inferlb.scorer.address import parse_address

__all__ = ["PEERS", "READY_TIMEOUT_S", "Peer", "PeerKind", "available", "start_peer"]

PeerKind = Literal["vllm-router", "sglang-router", "dynamo"]
Policy = Literal["cache_aware", "power_of_two", "consistent_hash", "kv"]

READY_TIMEOUT_S = 30.0

# kind -> (distribution, its Rust extension module, the version these flags were checked against)
_INSTALL: dict[str, tuple[str, str, str]] = {
    "vllm-router": ("vllm-router", "vllm_router_rs", "0.1.17"),
    "sglang-router": ("sglang-router", "sglang_router.sglang_router_rs", "0.3.2"),
    "dynamo": ("ai-dynamo", "dynamo._core", "1.6.1"),
}
# No Hugging Face downloads (neither needs a tokenizer here), and no proxy between a peer and its workers.
_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "NO_PROXY": "*",
    "no_proxy": "*",
}


@dataclass(frozen=True, slots=True)
class Peer:
    """One contender: the router ``kind`` run with routing ``policy``; ``name`` labels its results."""

    name: str
    kind: PeerKind
    policy: Policy


PEERS: tuple[Peer, ...] = (
    Peer("vllm-router cache_aware", "vllm-router", "cache_aware"),
    Peer("vllm-router power_of_two", "vllm-router", "power_of_two"),
    Peer("sglang-router cache_aware", "sglang-router", "cache_aware"),
    Peer("sglang-router power_of_two", "sglang-router", "power_of_two"),
    Peer("vllm-router consistent_hash", "vllm-router", "consistent_hash"),
    Peer("dynamo kv", "dynamo", "kv"),
)


def available(peer: Peer) -> str | None:
    """None if ``peer`` can be started here, else a one-line reason that says how to install it."""
    distribution, module, tested = _INSTALL[peer.kind]
    if peer.kind == "dynamo":
        return _dynamo_unavailable(peer, distribution, module, tested)
    install = f"pip install '{distribution}=={tested}' (or inferlb[peers])"
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return f"{peer.name}: {distribution} is not installed: {install}"
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    if not found:
        return f"{peer.name}: {distribution} is installed without its Rust extension {module}: {install}"
    try:
        find_tool(peer.kind)
    except ProcessError:
        return f"{peer.name}: the {peer.kind} command is not beside this Python nor on PATH: {install}"
    return None


def start_peer(
    peer: Peer,
    workers: Sequence[str],
    listen: str,
    workdir: Path,
    *,
    timeout_s: float = READY_TIMEOUT_S,
    kv_events_ports: Sequence[int] = (),
    profile: str = "h100-llama3.1-8b",
    helpers: list[ManagedProcess] | None = None,
) -> ManagedProcess:
    """Start ``peer`` on ``listen`` (a loopback ``ip:port``) in front of ``workers`` (``ip:port`` each, served as
    ``http://ip:port``), its output in ``workdir/NAME.log``; return once it reports every worker healthy.

    ``dynamo kv`` also needs each worker's KV-event port (``kv_events_ports``) and the servers' ``profile``; its
    workers' process is appended to ``helpers`` (the caller stops it after the returned frontend).

    ValueError for a bad or non-loopback ``listen`` or no workers; ProcessError (with the log's tail) if the peer is
    not installed, exits, or is not ready within ``timeout_s``. The caller stops the process (``stop()``).
    """
    host, port = parse_address(listen)
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"listen {listen!r} must be a loopback address: the peers are benchmark contenders only")
    if not workers:
        raise ValueError("start_peer needs at least one worker")
    for worker in workers:
        parse_address(worker)
    reason = available(peer)
    if reason is not None:
        raise ProcessError(reason)
    if peer.kind == "dynamo":
        return _start_dynamo(peer, workers, host, port, workdir, timeout_s, kv_events_ports, profile, helpers)
    argv = [find_tool(peer.kind), *_command(peer, host, port, [f"http://{w}" for w in workers])]
    log_path = workdir / f"{peer.name.replace(' ', '-')}.log"
    env = dict(_ENV)
    if peer.kind == "vllm-router":
        env["RUST_LOG"] = "warn"  # vllm-router 0.1.17 ignores its --log-level and logs every choice at INFO
    process = ManagedProcess(peer.name, argv, log_path, env=env).start()
    try:
        process.wait_ready(_routes_to(listen, len(workers)), timeout_s, f"routing to {len(workers)} workers")
    except BaseException:
        process.stop()
        raise
    return process


def _command(peer: Peer, host: str, port: int, urls: list[str]) -> list[str]:
    args = [
        # sglang-router binds 0.0.0.0 unless told otherwise, its metrics too.
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        peer.policy,
        "--worker-urls",
        *urls,
        # Both serve Prometheus metrics on 29000 by default: two peers (or a stale one) would collide.
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        # The start-up health wait sleeps this long between rounds (default 30 s), and power_of_two polls
        # /get_load at the same interval; 1 s makes start-up quick and costs the servers one 404 a second.
        "--worker-startup-check-interval",
        "1",
        # Per-request INFO lines (power_of_two logs every choice, sglang-router every request) would make logging
        # part of what is measured; warnings and errors still reach the log.
        "--log-level",
        "warning" if peer.kind == "vllm-router" else "warn",
    ]
    # Everything else stays at the routers' defaults (retries, circuit breaker, 60 s health checks, cache-aware
    # thresholds), as their users run them.
    return args if peer.kind == "vllm-router" else ["launch", *args]


def _routes_to(listen: str, workers: int) -> Callable[[], bool]:
    # Both answer /readiness with {"healthy_workers", "total_workers"}; sglang-router registers workers in the
    # background after it starts serving, so "it answers" is not yet "it routes to all of them".
    url = f"http://{listen}/readiness"

    def check() -> bool:
        response = httpx.get(url, timeout=1.0)
        return response.status_code == 200 and response.json().get("healthy_workers") == workers

    return check


def _dynamo_unavailable(peer: Peer, distribution: str, module: str, tested: str) -> str | None:
    install = (
        f"`make bench-dynamo-live` installs {distribution}=={tested} and ai-dynamo-runtime in .venv/dynamo; run "
        "the suite with that venv's Python"
    )
    try:
        importlib.metadata.version(distribution)
        found = importlib.util.find_spec(module) is not None
    except (importlib.metadata.PackageNotFoundError, ImportError):
        found = False
    if not found:
        return f"{peer.name}: {distribution} is not installed here: {install}"
    from inferlb.bench.dynamoreal import loopback_only

    outside = loopback_only()
    if outside:
        return (
            f"{peer.name}: Dynamo binds some sockets on every interface; run it in a network namespace with loopback "
            f"only (`make bench-dynamo-live` does), not beside {', '.join(outside)}"
        )
    return None


def _start_dynamo(
    peer: Peer,
    workers: Sequence[str],
    host: str,
    port: int,
    workdir: Path,
    timeout_s: float,
    kv_events_ports: Sequence[int],
    profile: str,
    helpers: list[ManagedProcess] | None,
) -> ManagedProcess:
    from inferlb.bench.dynamolive import dynamo_env

    if len(kv_events_ports) != len(workers):
        raise ValueError(f"{peer.name} needs each worker's KV-event port: {len(workers)} workers, "
                         f"{len(kv_events_ports)} ports")  # fmt: skip
    if helpers is None:  # its workers' process would outlive the run unseen
        raise ValueError(f"{peer.name} starts two processes: pass ``helpers`` to be given the workers' one")
    store = workdir / "dynamo-store"
    store.mkdir(parents=True, exist_ok=True)
    env = {**_ENV, **dynamo_env(store)}
    slug = peer.name.replace(" ", "-")
    argv = [sys.executable, "-m", "inferlb.bench.dynamolive", "--model-dir", str(workdir / "dynamo-model"),
            "--store", str(store), "--profile", profile]  # fmt: skip
    for worker, events in zip(workers, kv_events_ports, strict=True):
        argv += ["--server", worker, "--kv-events-port", str(events)]
    bridge = ManagedProcess(f"{peer.name} workers", argv, workdir / f"{slug}-workers.log", env=env).start()
    if helpers is not None:
        helpers.append(bridge)
    frontend_argv = [sys.executable, "-m", "dynamo.frontend", "--http-host", host, "--http-port", str(port),
                     "--router-mode", "kv", "--discovery-backend", "file", "--request-plane", "tcp",
                     "--event-plane", "zmq"]  # fmt: skip
    frontend = ManagedProcess(peer.name, frontend_argv, workdir / f"{slug}.log", env=env).start()
    ready = _dynamo_routes_to(f"{host}:{port}", len(workers))
    try:
        for process in (bridge, frontend):  # either may exit first
            process.wait_ready(ready, timeout_s, f"routing to {len(workers)} workers")
    except BaseException:
        frontend.stop()
        bridge.stop()
        raise
    return frontend


def _dynamo_routes_to(listen: str, workers: int) -> Callable[[], bool]:
    # /health lists the worker instances the frontend discovered; /v1/models the model once one registered it.
    def check() -> bool:
        health = httpx.get(f"http://{listen}/health", timeout=1.0)
        if health.status_code != 200 or len(health.json().get("instances", ())) != workers:
            return False
        return bool(httpx.get(f"http://{listen}/v1/models", timeout=1.0).json().get("data"))

    return check
