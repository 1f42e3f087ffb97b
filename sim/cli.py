"""``inferlb sim``: its arguments and the fleet it runs.

`inferlb.cli` names this module by string and imports it only when ``sim`` is the subcommand invoked, so the
picker's own commands never load the simulator (DESIGN.md, "Layers").
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

from inferlb.otel.tracing import PROTOCOLS
from inferlb.sim.fleet import build_fleet, parse_fault, run_fleet
from inferlb.sim.kvevents import DEFAULT_TOPIC, ENCODINGS
from inferlb.sim.profiles import PROFILES, fleet_of
from inferlb.sim.server import ServerOptions

__all__ = ["add_arguments", "run"]


def add_arguments(sim: argparse.ArgumentParser) -> None:
    """Add ``inferlb sim``'s arguments to its subparser."""
    where = sim.add_mutually_exclusive_group(required=True)
    where.add_argument("--listen", action="append", help="ip:port of one server; repeat for more")
    where.add_argument("--base-port", type=int, help="serve --replicas servers on consecutive ports from here")
    sim.add_argument("--replicas", type=int, default=1, help="how many servers with --base-port (default 1)")
    sim.add_argument("--host", default="127.0.0.1", help="address to bind with --base-port (default 127.0.0.1)")
    sim.add_argument(
        "--profile",
        default="h100-llama3.1-8b",
        help=f"GPU x model profile: {', '.join(PROFILES)}; or a mixed fleet, one profile per server in order: "
        "PROFILE:COUNT,... counting every server",
    )
    sim.add_argument("--model", action="append", help="served model name (default: the profile's); repeatable")
    sim.add_argument("--time-scale", type=float, default=1.0, help="engine seconds per wall second (default 1)")
    sim.add_argument("--seed", type=int, default=0, help="seed of server 0; server i gets seed+i")
    sim.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="serve /v1/completions/render, as `vllm serve --enable-scale-out` does (vLLM answers it 403 without)",
    )
    sim.add_argument("--jitter", type=float, default=0.02, help="log-normal sigma of step times (default 0.02)")
    sim.add_argument("--cold-start", action="store_true", help="start not ready, as after a crash")
    sim.add_argument("--cold-start-s", type=float, help="cold-start time in engine seconds (default: the profile's)")
    sim.add_argument("--max-tokens", type=int, default=128, help="output length when a request sets none")
    sim.add_argument("--kv-blocks", type=int, help="KV-cache blocks per server instead of the profile's (experiments)")
    sim.add_argument("--otlp-endpoint", help="send one llm_request span per request here (host:port or URL)")
    sim.add_argument("--otlp-protocol", default="grpc", choices=PROTOCOLS)
    sim.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="I:key=value",
        help="start-up fault of server I: slowdown=F, error_rate=P, hang=true, crash=true, cold_start_s=S, "
        "kv_events_pause=true, kv_events_drop=N (repeatable)",
    )
    sim.add_argument(
        "--kv-events-port",
        type=int,
        default=0,
        help="publish KV-cache events as vLLM does (ZMQ PUB) on this port of each server's host; server i uses "
        "PORT+i (default 0: off)",
    )
    sim.add_argument(
        "--kv-events-replay-port", type=int, default=0, help="serve replays (ZMQ ROUTER) here, server i at PORT+i"
    )
    sim.add_argument(
        "--kv-events-encoding",
        choices=ENCODINGS,
        default="map",
        help="events as maps tagged by 'type' (vLLM 0.32.0, the default) or arrays (older vLLM)",
    )
    sim.add_argument("--kv-events-topic", default=DEFAULT_TOPIC, help="ZMQ topic (default: empty, as vLLM's)")


def run(args: argparse.Namespace) -> int:
    """Serve the fleet ``args`` describe until SIGTERM/SIGINT; ValueError on a bad argument."""
    if args.listen:
        addresses = list(args.listen)
    else:
        if args.replicas < 1:
            raise ValueError(f"--replicas must be >= 1; got {args.replicas}")
        if not 1 <= args.base_port <= 65535 - args.replicas + 1:
            raise ValueError(f"--base-port {args.base_port} with --replicas {args.replicas} runs past port 65535")
        host = f"[{args.host}]" if ":" in args.host else args.host
        addresses = [f"{host}:{args.base_port + i}" for i in range(args.replicas)]
    faults: dict[int, dict[str, object]] = {}
    for text in args.fault:
        index, spec = parse_fault(text, len(addresses))
        faults.setdefault(index, {}).update(spec)
    profiles = fleet_of(args.profile, len(addresses))
    if args.kv_blocks is not None:
        if args.kv_blocks < 16:
            raise ValueError(f"--kv-blocks must be >= 16; got {args.kv_blocks}")
        profiles = [dataclasses.replace(p, num_gpu_blocks=args.kv_blocks) for p in profiles]
    options = ServerOptions(
        profile=profiles[0],
        models=tuple(args.model or ()),
        time_scale=args.time_scale,
        seed=args.seed,
        jitter=args.jitter,
        start_cold=args.cold_start,
        cold_start_s=args.cold_start_s,
        default_max_tokens=args.max_tokens,
        enable_scale_out=args.enable_scale_out,
    )
    kv_ports = (args.kv_events_port, args.kv_events_replay_port)
    for port in kv_ports:
        if port and not 1 <= port <= 65535 - len(addresses) + 1:
            raise ValueError(f"KV-events port {port} for {len(addresses)} servers runs past port 65535")
    if args.kv_events_replay_port and not args.kv_events_port:
        raise ValueError("--kv-events-replay-port needs --kv-events-port")
    options = dataclasses.replace(
        options, kv_events_encoding=args.kv_events_encoding, kv_events_topic=args.kv_events_topic
    )
    # One server at a time, so that server i gets its own KV-events ports (PORT+i) and still seed+i.
    servers = []
    for i, address in enumerate(addresses):
        own = dataclasses.replace(
            options,
            seed=args.seed + i,
            kv_events_port=args.kv_events_port + i if args.kv_events_port else 0,
            kv_events_replay_port=args.kv_events_replay_port + i if args.kv_events_replay_port else 0,
        )
        servers += build_fleet(
            [address],
            own,
            otlp_endpoint=args.otlp_endpoint,
            otlp_protocol=args.otlp_protocol,
            faults={0: faults[i]} if i in faults else None,
            profiles=profiles[i : i + 1],
        )
    asyncio.run(run_fleet(servers))
    return 0
