"""The ``inferlb`` command: serve (the picker), envoy-config, demo, sim (emulated inference servers), gpu-agent
(this node's GPUs from NVML over HTTP), heatmap (the latency heatmap of a file of spans), experiment report (an
experiment's verdicts from a file of spans)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from inferlb import configcmd
from inferlb.envoyconf import (
    BODY_MODES,
    CLUSTER_MODES,
    FALLBACK_POLICIES,
    TIERS,
    EnvoyConfigError,
    EnvoyOptions,
    render_bootstrap,
)
from inferlb.scorer.errors import ConfigError

# The subcommands that the simulator and the benchmarks serve. The product never imports inferlb.sim or
# inferlb.bench (DESIGN.md, "Layers"; the import contracts in pyproject.toml hold it), so these modules are named
# by string and imported only when their subcommand is the one invoked: `inferlb serve` and a running picker load
# neither. The simulator's has add_arguments(parser) and run(args); the bench harness's main(argv) parses its own.
SIM_COMMAND = "inferlb.sim.cli"
BENCH_COMMAND = "inferlb.bench.suites"
# Likewise the demo's arguments (its presets' names come from the routing core): building the parser imports only
# what it must, so that every command starts quickly; the config models load with the commands that read a config.
DEMO_COMMAND = "inferlb.demo"


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
    except (ConfigError, EnvoyConfigError, ValueError, OSError, ImportError) as exc:
        print(f"inferlb: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("inferlb: interrupted; everything it started has been stopped", file=sys.stderr)
        return 130


class _Parser(argparse.ArgumentParser):
    """An argument parser that can take its arguments from a module named by string (``arguments_from``: the
    module's ``add_arguments(parser)``), imported when this parser first parses, which for a subcommand's parser
    is only when that subcommand is invoked. Subparsers are of this class too."""

    def __init__(self, *args: Any, arguments_from: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._arguments_from = arguments_from

    def parse_known_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> tuple[Any, list[str]]:
        if self._arguments_from is not None:
            module, self._arguments_from = self._arguments_from, None
            importlib.import_module(module).add_arguments(self)
        return super().parse_known_args(args, namespace)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="inferlb", description="LLM-inference-aware load balancer for Envoy")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the picker (Envoy ext_proc gRPC service)")
    serve.add_argument("--config", required=True, type=Path, help="picker config YAML")
    serve.add_argument("--listen", help="override the config's listen address (ip:port)")
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="picker processes sharing state through Redis (config replicas), worker i on the listen and admin "
        "ports plus i (default 1)",
    )
    serve.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # set by the supervisor of --workers
    serve.set_defaults(run=_serve)

    configcmd.add_parser(sub)

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
    envoy.add_argument(
        "--request-timeout-s",
        type=float,
        default=30.0,
        help="how long a request may take to arrive, body included (408 after); the response is not bounded",
    )
    envoy.add_argument(
        "--request-headers-timeout-s", type=float, default=10.0, help="how long the request headers may take (408)"
    )
    envoy.add_argument(
        "--stream-idle-timeout-s",
        type=float,
        default=300.0,
        help="end a stream on which nothing moved either way for this long (a streamed answer keeps it alive)",
    )
    envoy.add_argument("--fallback-lb-policy", default="LEAST_REQUEST", choices=FALLBACK_POLICIES)
    envoy.add_argument("--access-log", default="/dev/stdout", help="access log path, or 'none'")
    envoy.add_argument(
        "--forward-header",
        action="append",
        default=[],
        metavar="NAME",
        help="also send this request header to the picker (repeatable)",
    )
    envoy.add_argument(
        "--tracing", action="store_true", help="send Envoy's own spans to the picker's OTLP receiver (otel.receiver)"
    )
    xds = envoy.add_mutually_exclusive_group()
    xds.add_argument(
        "--xds",
        dest="xds",
        action="store_true",
        default=None,
        help="the server clusters' endpoints and weights come from the picker over ADS (default: when the config "
        "names a discovery source)",
    )
    xds.add_argument(
        "--no-xds",
        dest="xds",
        action="store_false",
        help="the endpoints are written into the file (not with discovery)",
    )
    envoy.add_argument(
        "--cluster-mode",
        default="original-dst",
        choices=CLUSTER_MODES,
        help="how a picked endpoint is reached: any ip:port (original-dst) or only pool members, the picker's list "
        "tried in order with retries (override-host)",
    )
    envoy.add_argument(
        "--retries",
        type=int,
        default=2,
        help="override-host: retries of a request that never arrived, on the next endpoints the picker listed "
        "(at most the config's destinations - 1)",
    )
    envoy.add_argument(
        "--tier",
        default="per-request",
        choices=TIERS,
        help="per-request: the picker picks each request; weights: Envoy's own balancer over the picker's weights",
    )
    envoy.add_argument(
        "--body-mode",
        default="buffered",
        choices=BODY_MODES,
        help="how body routes reach the picker: buffered (whole), or full-duplex (FULL_DUPLEX_STREAMED, streamed)",
    )
    envoy.add_argument(
        "--picker-address",
        help="where Envoy reaches the picker, ip:port or dns-name:port (a name is re-resolved every second and each "
        "address health-checked); default: the config's listen address",
    )
    envoy.add_argument(
        "--picker-workers",
        type=int,
        default=1,
        help="the picker runs as `inferlb serve --workers N`: Envoy spreads streams over its N workers' ports",
    )
    envoy.add_argument("--out", type=Path, help="write here instead of stdout")
    envoy.set_defaults(run=_envoy_config)

    demo = sub.add_parser(
        "demo",
        help="Envoy + picker + emulated vLLM servers on loopback: the same traffic through Envoy's round robin and "
        "through inferlb while one server turns slow, a side-by-side table, a heatmap",
        arguments_from=DEMO_COMMAND,
    )
    demo.set_defaults(run=_demo)

    sim = sub.add_parser(
        "sim", help="run emulated vLLM-compatible inference servers on loopback", arguments_from=SIM_COMMAND
    )
    sim.set_defaults(run=_sim)

    agent = sub.add_parser(
        "gpu-agent",
        help="serve this node's GPU state from NVML over HTTP (GET /gpu, GET /healthz)",
        description="Serve this node's GPUs (utilisation, memory), read through NVML, as the GPU report the picker "
        "reads: GET /gpu and GET /healthz; both answer 503 with the reason while NVML reads fail.",
        epilog="exit status: 0 after SIGTERM/SIGINT; 2 on a bad argument or an address in use; 3 when NVML is not "
        "available (no pynvml, no NVIDIA driver or libnvidia-ml.so, or no GPU on this node)",
    )
    agent.add_argument("--listen", default="127.0.0.1:9400", help="ip:port to serve on (default 127.0.0.1:9400)")
    agent.add_argument("--interval-s", type=float, default=0.5, help="seconds between NVML samples (default 0.5)")
    agent.add_argument("--host", help="this node's name in the reports (default: the machine's hostname)")
    agent.set_defaults(run=_gpu_agent)

    heatmap = sub.add_parser(
        "heatmap",
        help="render the latency heatmap of an OTLP/JSON lines file of spans (PNG, optionally JSON and HTML)",
        description="Read llm_request spans from an OTLP/JSON lines file (as an OpenTelemetry collector's file "
        "exporter writes it) and render P95 TTFT per endpoint x time and requests per TTFT bucket x time.",
    )
    heatmap.add_argument("--from", dest="source", required=True, type=Path, metavar="FILE", help="OTLP/JSON lines")
    heatmap.add_argument("--out", required=True, type=Path, help="the PNG to write")
    heatmap.add_argument("--bucket-s", type=float, default=10.0, help="seconds per time bucket (default 10)")
    heatmap.add_argument("--json", type=Path, metavar="OUT.json", help="also write the grids as JSON")
    heatmap.add_argument("--html", type=Path, metavar="OUT.html", help="also write a self-contained HTML page")
    heatmap.set_defaults(run=_heatmap)

    experiment = sub.add_parser(
        "experiment", help="experiments between routing policies, offline: `inferlb experiment report --from FILE`"
    )
    actions = experiment.add_subparsers(dest="action", required=True, metavar="ACTION")
    report = actions.add_parser(
        "report",
        help="each experiment's arms and verdicts from an OTLP/JSON lines file of spans",
        description="Join the picker's inferlb.route spans (experiment, arm) with the servers' llm_request spans "
        "(TTFT, E2E, errors) by trace id and run the live experiments' sequential test on them.",
    )
    report.add_argument("--from", dest="source", required=True, type=Path, metavar="FILE", help="OTLP/JSON lines")
    report.add_argument("--control", help="the control arm (default: `control`, else the first routed)")
    report.add_argument("--alpha", type=float, default=0.05, help="false-verdict rate allowed (default 0.05)")
    report.add_argument("--min-samples", type=int, default=200, help="requests per arm before a verdict (200)")
    report.add_argument("--json", type=Path, metavar="OUT.json", help="also write the report as JSON")
    report.set_defaults(run=_experiment_report)

    # Everything after `bench` (or `conformance`), options included, is the bench harness's to parse (prefix_chars
    # leaves none to this parser), so that building this parser never imports the benchmarks.
    for name, text, run in (
        (
            "bench",
            "benchmarks: routing quality, the picker hop, pick cost, faults ... (`inferlb bench --help` lists them)",
            _bench,
        ),
        ("conformance", "check an Endpoint Picker against the protocol (`inferlb conformance --help`)", _conformance),
    ):
        passed_on = sub.add_parser(name, help=text, add_help=False, prefix_chars="\0")
        passed_on.add_argument("argv", nargs=argparse.REMAINDER)
        passed_on.set_defaults(run=run)
    return parser


def _bench(args: argparse.Namespace) -> int:
    result: int = importlib.import_module(BENCH_COMMAND).main(args.argv)
    return result


def _conformance(args: argparse.Namespace) -> int:
    """``inferlb conformance ...`` is ``inferlb bench conformance ...``."""
    result: int = importlib.import_module(BENCH_COMMAND).main(["conformance", *args.argv], prog="inferlb")
    return result


def _serve(args: argparse.Namespace) -> int:
    from inferlb.picker import serve
    from inferlb.scorer.address import parse_address
    from inferlb.scorer.config import load_config

    config = load_config(args.config)
    if args.listen:
        parse_address(args.listen)
        config = replace(config, listen=args.listen)
    if args.worker is None and args.workers != 1:
        from inferlb.workers import supervise

        extra = ["--listen", args.listen] if args.listen else []
        return supervise(
            config, args.config, args.workers, log_level=args.log_level, extra_args=extra, listen_override=args.listen
        )
    asyncio.run(serve(config, args.config, listen_override=args.listen, worker=args.worker))
    return 0


def _envoy_config(args: argparse.Namespace) -> int:
    from inferlb.scorer.config import load_config

    config = load_config(args.config)
    more_pickers: tuple[str, ...] = ()
    if args.picker_workers != 1:
        from inferlb.workers import check_workers, worker_addresses

        if args.picker_address is not None:
            raise EnvoyConfigError("--picker-workers names the workers' ports on this host: not with --picker-address")
        check_workers(config, args.picker_workers, "--picker-workers")
        more_pickers = tuple(worker_addresses(config, args.picker_workers)[1:])
    options = EnvoyOptions(
        listen=args.listen,
        admin=args.admin,
        fail_open=args.fail_open,
        message_timeout_ms=args.message_timeout_ms,
        request_timeout_ms=round(args.request_timeout_s * 1000),
        request_headers_timeout_ms=round(args.request_headers_timeout_s * 1000),
        stream_idle_timeout_ms=round(args.stream_idle_timeout_s * 1000),
        fallback_lb_policy=args.fallback_lb_policy,
        access_log_path=None if args.access_log == "none" else args.access_log,
        forward_headers=tuple(args.forward_header),
        tracing=args.tracing,
        xds=args.xds,
        cluster_mode=args.cluster_mode,
        retries=args.retries,
        tier=args.tier,
        picker_address=args.picker_address,
        more_pickers=more_pickers,
        body_mode=args.body_mode,
    )
    text = render_bootstrap(config, options)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from inferlb.demo import DemoOptions, run_demo
    from inferlb.demoscenario import ScenarioOptions

    # SIGTERM (a supervisor, `timeout`) unwinds like Ctrl-C, so the demo stops what it started. SIGINT is set
    # explicitly: a shell starts background jobs with it ignored, and Python would keep ignoring it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))

    scenario = ScenarioOptions(
        duration_s=args.duration, rate=args.rate, slow_at_s=args.slow_at, slowdown=args.slowdown, seed=args.seed
    )
    options = DemoOptions(
        backends=args.backends,
        quick=args.quick,
        requests=args.requests,
        concurrency=args.concurrency,
        policy=args.policy,
        scenario=scenario,
    )
    return run_demo(options, args.out)


def _sim(args: argparse.Namespace) -> int:
    result: int = importlib.import_module(SIM_COMMAND).run(args)
    return result


def _gpu_agent(args: argparse.Namespace) -> int:
    from inferlb.gpuagent import run_agent

    return run_agent(args.listen, args.interval_s, args.host)


def _experiment_report(args: argparse.Namespace) -> int:
    import json

    from inferlb.otel.experimentreport import experiment_report
    from inferlb.otel.heatmap import load_otlp_json_lines

    if not (0 < args.alpha < 1) or args.min_samples < 2:
        raise ValueError("--alpha must be in (0, 1) and --min-samples at least 2")
    report = experiment_report(
        load_otlp_json_lines(args.source), control=args.control, alpha=args.alpha, min_samples=args.min_samples
    )
    if not report["experiments"]:
        raise ValueError(f"{args.source}: no inferlb.route span names an experiment and an arm")
    for experiment in report["experiments"]:
        print(f"experiment {experiment['name']} (control: {experiment['control']})")
        for arm in experiment["arms"]:
            p50, p99 = arm["ttft_s"]["p50"], arm["ttft_s"]["p99"]
            rate = "-" if arm["error_rate"] is None else f"{arm['error_rate']:.2%}"
            ttft = "-" if p50 is None else f"{p50:.3g} / {p99:.3g} s"
            print(
                f"  {arm['name']}: {arm['requests']} requests, {arm['finished']} with an outcome, errors {rate}, "
                f"TTFT p50 / p99 {ttft}"
            )
        for arm, metrics in experiment["comparisons"].items():
            for metric, c in metrics.items():
                interval = "" if c["low"] is None else f" [{c['low']:+.4f}, {c['high']:+.4f}]"
                print(f"  {arm} vs {experiment['control']}, {metric}: {c['difference']:+.4f}{interval}: {c['verdict']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def _heatmap(args: argparse.Namespace) -> int:
    import os

    from inferlb.otel.heatmap import HeatmapAggregator, add_otlp_request, load_otlp_json_lines
    from inferlb.otel.render import render_html, render_json, render_png

    try:
        aggregator = HeatmapAggregator(bucket_s=args.bucket_s)
    except ValueError as exc:
        raise ValueError(f"--bucket-s: {exc}") from None
    spans = sum(add_otlp_request(aggregator, request) for request in load_otlp_json_lines(args.source))
    grid = aggregator.grid()
    if not grid["endpoints"]:
        raise ValueError(
            f"{args.source}: no llm_request span with an end time and an endpoint ({spans} LLM spans read; an "
            "endpoint comes from server.address + server.port on the span or its resource, or inferlb.endpoint)"
        )
    render_png(grid, args.out)
    written = [str(args.out)]
    if args.json:
        args.json.write_bytes(render_json(grid))
        written.append(str(args.json))
    if args.html:
        # Served next to the JSON, the page polls it; otherwise it is a static report.
        url = Path(os.path.relpath(args.json.resolve(), args.html.resolve().parent)).as_posix() if args.json else None
        args.html.write_text(render_html(grid, refresh_s=10.0 if url else None, json_url=url), encoding="utf-8")
        written.append(str(args.html))
    requests = sum(sum(row) for row in grid["count"])
    print(
        f"heatmap: {requests} requests on {len(grid['endpoints'])} endpoints in {len(grid['times'])} buckets of "
        f"{aggregator.bucket_s:g} s; wrote {', '.join(written)}"
    )
    skipped = {key: grid[key] for key in ("late", "dropped", "invalid", "unattributed") if grid[key]}
    if skipped:
        print(f"heatmap: not shown: {', '.join(f'{n} {key}' for key, n in skipped.items())}", file=sys.stderr)
    return 0
