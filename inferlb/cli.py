"""The ``inferlb`` command: serve (the picker), envoy-config, demo, standin."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from inferlb.envoyconf import FALLBACK_POLICIES, EnvoyConfigError, EnvoyOptions, render_bootstrap
from inferlb.scorer.config import load_config
from inferlb.scorer.errors import ConfigError
from inferlb.scorer.presets import PRESET_NAMES


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request at INFO; the demo's readiness polls would drown the output.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        result: int = args.run(args)
        return result
    except (ConfigError, EnvoyConfigError, ValueError) as exc:
        print(f"inferlb: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("inferlb: interrupted; everything it started has been stopped", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferlb", description="LLM-inference-aware load balancer for Envoy")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the picker (Envoy ext_proc gRPC service)")
    serve.add_argument("--config", required=True, type=Path, help="picker config YAML")
    serve.add_argument("--listen", help="override the config's listen address (ip:port)")
    serve.set_defaults(run=_serve)

    envoy = sub.add_parser("envoy-config", help="render the Envoy bootstrap for a picker config")
    envoy.add_argument("--config", required=True, type=Path, help="picker config YAML (pool and picker address)")
    envoy.add_argument("--listen", default="127.0.0.1:8080", help="Envoy's listener for clients (ip:port)")
    envoy.add_argument("--admin", default="127.0.0.1:9901", help="Envoy's admin listener (ip:port)")
    mode = envoy.add_mutually_exclusive_group()
    mode.add_argument(
        "--fail-open",
        dest="fail_open",
        action="store_true",
        default=True,
        help="picker down: send requests to the fallback cluster (default)",
    )
    mode.add_argument(
        "--fail-closed", dest="fail_open", action="store_false", help="picker down: fail requests with a 5xx"
    )
    envoy.add_argument("--message-timeout-ms", type=int, default=1000, help="how long Envoy waits for a pick")
    envoy.add_argument("--fallback-lb-policy", default="LEAST_REQUEST", choices=FALLBACK_POLICIES)
    envoy.add_argument("--access-log", default="/dev/stdout", help="access log path, or 'none'")
    envoy.add_argument(
        "--forward-header",
        action="append",
        default=[],
        metavar="NAME",
        help="also send this request header to the picker (repeatable)",
    )
    envoy.add_argument("--out", type=Path, help="write here instead of stdout")
    envoy.set_defaults(run=_envoy_config)

    demo = sub.add_parser("demo", help="Envoy + picker + stand-in servers on loopback, a burst of traffic, a summary")
    demo.add_argument("--backends", type=int, default=3)
    demo.add_argument("--requests", type=int, default=120)
    demo.add_argument("--concurrency", type=int, default=8)
    demo.add_argument("--policy", default="least-request", choices=PRESET_NAMES)
    demo.add_argument("--out", type=Path, default=Path("demo-out"), help="logs and rendered configs go here")
    demo.set_defaults(run=_demo)

    standin = sub.add_parser("standin", help="run OpenAI-compatible stand-in backends (for demos and tests)")
    standin.add_argument("--listen", action="append", required=True, help="ip:port; repeat for more servers")
    standin.add_argument("--model", action="append", help="served model name; repeatable")
    standin.add_argument("--token-delay-ms", type=float, default=5.0, help="pause between streamed tokens")
    standin.set_defaults(run=_standin)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from inferlb.picker import serve
    from inferlb.scorer.address import parse_address

    config = load_config(args.config)
    if args.listen:
        parse_address(args.listen)
        config = replace(config, listen=args.listen)
    asyncio.run(serve(config))
    return 0


def _envoy_config(args: argparse.Namespace) -> int:
    options = EnvoyOptions(
        listen=args.listen,
        admin=args.admin,
        fail_open=args.fail_open,
        message_timeout_ms=args.message_timeout_ms,
        fallback_lb_policy=args.fallback_lb_policy,
        access_log_path=None if args.access_log == "none" else args.access_log,
        forward_headers=tuple(args.forward_header),
    )
    text = render_bootstrap(load_config(args.config), options)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from inferlb.demo import DemoOptions, run_demo

    # SIGTERM (a supervisor, `timeout`) unwinds like Ctrl-C, so the demo stops what it started. SIGINT is set
    # explicitly: a shell starts background jobs with it ignored, and Python would keep ignoring it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))

    options = DemoOptions(
        backends=args.backends, requests=args.requests, concurrency=args.concurrency, policy=args.policy
    )
    return run_demo(options, args.out)


def _standin(args: argparse.Namespace) -> int:
    from inferlb.sim.standin import StandinOptions, serve

    options = StandinOptions(models=tuple(args.model or ("stand-in",)), token_delay_s=args.token_delay_ms / 1000)
    asyncio.run(serve(args.listen, options))
    return 0
