"""Our gateway under someone else's load tool: guidellm against Envoy + the picker + emulated vLLM servers.

    inferlb bench external --out bench/results [--quick]

1. Starts a local gateway: 4 emulated H100 + Llama-3.1-8B servers (``inferlb sim``, real time), the picker
   (policy ``default``) and a real Envoy with its access log.
2. Runs guidellm (its own venv, ``.venv/loadtool``) against the gateway's ``/v1/completions``, streamed, at a
   fixed request rate for a fixed number of requests, with synthetic prompts; it is killed if it outlives a
   deadline. Hugging Face's hub is never reached: the tokenizer guidellm sizes its prompts with is trained here.
3. Reads three views of the same requests: guidellm's JSON report (the client's clock), the servers' own request
   logs (``GET /admin/requests``: engine time, from arrival at the server) and Envoy's access log (from the first
   byte Envoy received to the last it sent). The counts must agree; the percentiles differ by what each one sees.
4. Writes ``external.json`` and ``external.md`` into ``--out``; the tool's raw report stays in the work folder.

Install the tool once: ``python3 -m venv .venv/loadtool && .venv/loadtool/bin/pip install "guidellm==0.8.1"
"torch==2.13.0"``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from inferlb.bench import offline_tokenizer
from inferlb.bench.report import cpu_model, header, table, write
from inferlb.bench.stats import percentile
from inferlb.procs import ManagedProcess
from inferlb.stack import LocalStack, StackOptions

__all__ = [
    "ExternalError",
    "Figures",
    "Plan",
    "add_arguments",
    "envoy_figures",
    "guidellm_version",
    "join_overhead",
    "parse_guidellm",
    "run",
    "server_figures",
]

TOOL = "guidellm"
TOOL_VERSION = "0.8.1"
MODEL = "llama-3.1-8b"
BACKENDS = 4
REPO = Path(__file__).resolve().parents[1]
DEFAULT_VENV = REPO / ".venv" / "loadtool"
# torch==2.13.0 takes the CPU build where the machine's wheel folder has it (2.13.0+cpu sorts above 2.13.0): 1.5 GB
# instead of 6 GB of CUDA libraries guidellm never uses here.
INSTALL = f'python3 -m venv .venv/loadtool && .venv/loadtool/bin/pip install "{TOOL}=={TOOL_VERSION}" "torch==2.13.0"'
COMPLETIONS = "/v1/completions"

# Trained on Faker's English (offline_tokenizer.py without files; guidellm draws its synthetic prompts from
# Faker too), a byte-level BPE of 2,048 tokens averages about 4.4 characters a token on those prompts: close to
# the emulated servers' own count (ceil(characters / 4)) and to Llama's tokenizer on English, so the prompt
# lengths guidellm asks for are about the lengths the servers see.

# Nothing the tool runs may reach for Hugging Face's hub, or phone home.
_OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    # guidellm spawns 10 worker processes by default, each importing torch: too many for a 2-core machine at 4 req/s.
    "GUIDELLM__MAX_WORKER_PROCESSES": "2",
}


class ExternalError(RuntimeError):
    """The load tool is missing, failed, ran past its deadline, or wrote a report this module cannot read."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What the tool sends: ``requests`` at ``rate`` per second (``constant`` or ``poisson`` arrivals), prompts of
    ``prompt_tokens`` (mean, stdev, min, max) and outputs of ``output_tokens`` tokens, all in the tool's tokenizer."""

    requests: int = 200
    rate: float = 4.0
    arrivals: str = "constant"
    prompt_tokens: tuple[int, int, int, int] = (1000, 400, 500, 2000)
    output_tokens: tuple[int, int, int, int] = (96, 20, 64, 128)
    seed: int = 42

    @property
    def sending_s(self) -> float:
        return self.requests / self.rate

    @property
    def deadline_s(self) -> float:
        """When the tool is killed: its start-up (about 20 s: spawning workers, making prompts) and the sending
        time, with room for a slow, shared machine."""
        return 120.0 + 3.0 * self.sending_s


@dataclass(frozen=True, slots=True)
class Figures:
    """One view of the run. Latencies in milliseconds; None where that view cannot see a figure."""

    source: str
    requests: int
    errors: int
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    e2e_p50_ms: float | None = None
    e2e_p99_ms: float | None = None
    queue_p50_ms: float | None = None
    queue_p99_ms: float | None = None
    requests_per_s: float | None = None
    output_tokens_per_s: float | None = None
    prompt_tokens_p50: float | None = None
    output_tokens: int | None = None


def _pct(values: Sequence[float], q: float) -> float | None:
    """The smallest value whose share of the sample reaches q%: guidellm's rule, so the columns compare."""
    return percentile(values, q, method="inverted_cdf")


def _at(document: Any, *path: str, where: str = "") -> Any:
    node = document
    for i, key in enumerate(path):
        if not isinstance(node, Mapping) or key not in node:
            raise ExternalError(f"{TOOL} report has no {where}{'.'.join(path[: i + 1])}")
        node = node[key]
    return node


def parse_guidellm(report: Mapping[str, Any]) -> Figures:
    """The client's figures from a guidellm 0.8 JSON report (its first benchmark). guidellm times each request
    from sending it to the first streamed token (TTFT) and to the end of the stream (request latency), and takes
    token counts from the server's ``usage``. Errors count errored and incomplete requests. ExternalError names
    the first field it cannot find."""
    benchmarks = _at(report, "benchmarks")
    if not isinstance(benchmarks, list) or not benchmarks:
        raise ExternalError(f"{TOOL} report has no benchmarks")
    metrics = _at(benchmarks[0], "metrics", where="benchmarks[0].")

    def ok(name: str, *path: str) -> Any:
        return _at(metrics, name, "successful", *path, where="benchmarks[0].metrics.")

    def pct(name: str, key: str, scale: float = 1.0) -> float:
        return float(ok(name, "percentiles", key)) * scale

    def total(key: str) -> int:
        return int(_at(metrics, "request_totals", key, where="benchmarks[0].metrics."))

    return Figures(
        source=f"{TOOL} (client)",
        requests=total("total"),
        errors=total("errored") + total("incomplete"),
        ttft_p50_ms=pct("time_to_first_token_ms", "p50"),
        ttft_p90_ms=pct("time_to_first_token_ms", "p90"),
        ttft_p99_ms=pct("time_to_first_token_ms", "p99"),
        e2e_p50_ms=pct("request_latency", "p50", 1000.0),
        e2e_p99_ms=pct("request_latency", "p99", 1000.0),
        requests_per_s=float(ok("requests_per_second", "mean")),
        output_tokens_per_s=float(ok("output_tokens_per_second", "mean")),
        prompt_tokens_p50=pct("prompt_token_count", "p50"),
        output_tokens=int(ok("output_token_count", "total_sum")),
    )


def guidellm_version(report: Mapping[str, Any]) -> str:
    return str(_at(report, "metadata", "guidellm_version"))


def server_figures(entries: Sequence[Mapping[str, Any]]) -> Figures:
    """The servers' figures from their request logs (``/admin/requests``, all servers together). Times are engine
    time from the request's arrival at the server. The rate spans the first arrival to the last finish; each
    server's clock starts at its own start-up, and ``inferlb sim`` starts them together, so they agree to a few
    milliseconds."""
    done = [e for e in entries if e["status"] == "finished"]
    span = 0.0
    if done:
        span = max(e["arrival_s"] + e["e2e_s"] for e in done) - min(e["arrival_s"] for e in done)
    output = sum(int(e["output_tokens"]) for e in done)
    ttft = [e["ttft_s"] * 1000.0 for e in done]
    e2e = [e["e2e_s"] * 1000.0 for e in done]
    queue = [e["queue_s"] * 1000.0 for e in done]
    return Figures(
        source="servers (/admin/requests)",
        requests=len(entries),
        errors=len(entries) - len(done),
        ttft_p50_ms=_pct(ttft, 50),
        ttft_p90_ms=_pct(ttft, 90),
        ttft_p99_ms=_pct(ttft, 99),
        e2e_p50_ms=_pct(e2e, 50),
        e2e_p99_ms=_pct(e2e, 99),
        queue_p50_ms=_pct(queue, 50),
        queue_p99_ms=_pct(queue, 99),
        requests_per_s=len(done) / span if span > 0 else None,
        output_tokens_per_s=output / span if span > 0 else None,
        prompt_tokens_p50=_pct([float(e["prompt_tokens"]) for e in done], 50),
        output_tokens=output,
    )


def envoy_figures(entries: Sequence[Mapping[str, Any]]) -> tuple[Figures, dict[str, Any]]:
    """Envoy's figures from its access log (completions only: the tool's ``/v1/models`` probe is left out), and
    where the requests went. The bootstrap logs ``%DURATION%`` (whole milliseconds, first byte in to last byte
    out) and no time to first byte, so Envoy gives E2E only."""
    mine = [e for e in entries if e.get("method") == "POST" and str(e.get("path", "")).startswith(COMPLETIONS)]
    durations = [float(e["duration_ms"]) for e in mine]
    figures = Figures(
        source="Envoy (access log)",
        requests=len(mine),
        errors=sum(1 for e in mine if int(e["status"]) != 200),
        e2e_p50_ms=_pct(durations, 50),
        e2e_p99_ms=_pct(durations, 99),
    )
    routing = {
        "by_upstream": dict(sorted(Counter(str(e["upstream"]) for e in mine).items())),
        "by_cluster": dict(sorted(Counter(str(e["cluster"]) for e in mine).items())),
    }
    return figures, routing


def join_overhead(report: Mapping[str, Any], entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Client minus server, per request, for the requests that can be told apart: no request id crosses from the
    tool to the servers' logs, but (prompt tokens, output tokens) is unique for most of them (both sides count
    with the server's tokenizer). Returns how many were joined and the p50/p99 of the differences in ms."""
    requests = _at(report, "benchmarks")[0]["requests"]["successful"]

    def unique(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[int, int], Mapping[str, Any]]:
        keyed = [((int(r["prompt_tokens"]), int(r["output_tokens"])), r) for r in rows]
        counts = Counter(key for key, _ in keyed)
        return {key: r for key, r in keyed if counts[key] == 1}

    client = unique(requests)
    server = unique([e for e in entries if e["status"] == "finished"])
    keys = sorted(client.keys() & server.keys())
    ttft = [client[k]["time_to_first_token_ms"] - server[k]["ttft_s"] * 1000.0 for k in keys]
    e2e = [client[k]["request_latency"] * 1000.0 - server[k]["e2e_s"] * 1000.0 for k in keys]
    return {
        "joined": len(keys),
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p99_ms": _pct(ttft, 99),
        "e2e_p50_ms": _pct(e2e, 50),
        "e2e_p99_ms": _pct(e2e, 99),
    }


def make_tokenizer(python: Path, folder: Path, vocab_size: int = 2048) -> Path:
    """A model folder that ``transformers.AutoTokenizer.from_pretrained(folder)`` loads offline: a byte-level BPE
    tokenizer trained by the tool venv's ``python`` (`inferlb.bench.offline_tokenizer`), its config and a Llama
    config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [str(python), str(offline_tokenizer.SCRIPT), str(folder), str(vocab_size)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise ExternalError(f"training the tokenizer failed:\n{done.stderr[-3000:]}")
    vocab = int(done.stdout.split()[-1])
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 32768,
    }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "max_position_embeddings": 32768,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2), encoding="utf-8")
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


def scenario(plan: Plan, target: str, tokenizer: Path, report_path: Path) -> dict[str, Any]:
    """guidellm's scenario file for ``plan`` against ``target``. Its health probe (``GET /health``) would get
    Envoy's 404 (only ``/v1/`` is routed), so it is pointed at ``/v1/models``, which crosses the gateway too."""
    prompt, output = plan.prompt_tokens, plan.output_tokens
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": target,
                "model": MODEL,
                "request_format": COMPLETIONS,
                "api_routes": {"/health": "v1/models"},
                "stream": True,
                "http2": False,
                "timeout": 120,
            },
            "profile": {"kind": plan.arrivals, "rate": [plan.rate]},
            "constraints": [
                {"kind": "max_requests", "count": plan.requests},
                {"kind": "max_duration", "seconds": 30.0 + 2.0 * plan.sending_s},
            ],
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": prompt[0],
                    "prompt_tokens_stdev": prompt[1],
                    "prompt_tokens_min": prompt[2],
                    "prompt_tokens_max": prompt[3],
                    "output_tokens": output[0],
                    "output_tokens_stdev": output[1],
                    "output_tokens_min": output[2],
                    "output_tokens_max": output[3],
                }
            ],
            "seed": {"kind": "static", "value": plan.seed},
            "outputs": [{"kind": "json", "path": str(report_path)}],
        }
    }


def tool_binary(venv: Path) -> Path:
    binary = venv / "bin" / TOOL
    if not binary.exists():
        raise ExternalError(f"{binary} not found: install the tool with `{INSTALL}`")
    return binary


def run_tool(venv: Path, plan: Plan, target: str, workdir: Path) -> dict[str, Any]:
    """Train the tokenizer, run guidellm for ``plan`` against ``target``, and return its JSON report. The tool
    runs in a process group of its own and is killed at ``plan.deadline_s``; its output is in ``guidellm.log``."""
    python, binary = venv / "bin" / "python", tool_binary(venv)
    tokenizer = make_tokenizer(python, workdir / "tokenizer")
    report_path = workdir / f"{TOOL}-report.json"
    scenario_path = workdir / "scenario.json"
    scenario_path.write_text(json.dumps(scenario(plan, target, tokenizer, report_path), indent=2), encoding="utf-8")
    argv = [str(binary), "run", "--scenario", str(scenario_path), "--disable-console-interactive"]
    env = {**_OFFLINE_ENV, "HF_HOME": str(workdir / "hf")}
    process = ManagedProcess(TOOL, argv, workdir / f"{TOOL}.log", env=env).start()
    if process.proc is None:
        raise ExternalError(f"{TOOL} did not start")
    try:
        code = process.proc.wait(plan.deadline_s)
    except subprocess.TimeoutExpired:
        process.kill()
        raise ExternalError(f"{TOOL} ran past its {plan.deadline_s:.0f} s deadline:\n{process.log_tail()}") from None
    if code != 0 or not report_path.exists():
        raise ExternalError(f"{TOOL} failed (exit {code}):\n{process.log_tail()}")
    try:
        return json.loads(report_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ExternalError(f"{report_path} is not JSON: {exc}") from exc


def server_log(endpoints: Sequence[str]) -> list[dict[str, Any]]:
    """Every server's finished requests, each entry tagged with its server."""
    entries: list[dict[str, Any]] = []
    for address in endpoints:
        reply = httpx.get(f"http://{address}/admin/requests", timeout=10.0)
        reply.raise_for_status()
        entries += [{**e, "server": address} for e in reply.json()["requests"]]
    return entries


def access_log(stack: LocalStack, expected: int, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """Envoy's access log once it holds ``expected`` completions, or whatever it holds at the deadline (Envoy
    flushes it every 100 ms)."""
    deadline = time.monotonic() + timeout_s
    while True:
        entries = stack.access_log()
        if envoy_figures(entries)[0].requests >= expected or time.monotonic() > deadline:
            return entries
        time.sleep(0.1)  # a poll interval, bounded by the deadline


def measure(plan: Plan, venv: Path, workdir: Path) -> dict[str, Any]:
    """Start the gateway, run the tool through it, and gather the three views."""
    tool_binary(venv)  # before starting anything
    options = StackOptions(backends=BACKENDS, models=(MODEL,), policy="default", picker_log_level="warning")
    with LocalStack(options, workdir / "stack") as stack:
        print(f"gateway {stack.gateway_url}, servers {', '.join(stack.endpoints)}", flush=True)
        started = time.monotonic()
        raw = run_tool(venv, plan, stack.gateway_url, workdir)
        tool_wall_s = time.monotonic() - started
        tool = parse_guidellm(raw)
        entries = server_log(stack.endpoints)
        envoy, routing = envoy_figures(access_log(stack, tool.requests))
    servers = server_figures(entries)
    return {
        "tool": {"name": TOOL, "version": guidellm_version(raw), "wall_s": round(tool_wall_s, 1)},
        "figures": [asdict(f) for f in (tool, servers, envoy)],
        "counts_agree": tool.requests == servers.requests == envoy.requests == plan.requests,
        "client_minus_server": join_overhead(raw, entries),
        "tool_warnings": [str(w.get("message", w)).rstrip(".") for w in raw["benchmarks"][0].get("warnings", [])],
        "routing": routing,
        "server_prompt_tokens": {
            "min": min((e["prompt_tokens"] for e in entries), default=None),
            "max": max((e["prompt_tokens"] for e in entries), default=None),
        },
    }


_ROWS = [
    ("requests", "requests", "{:.0f}"),
    ("errors", "errors", "{:.0f}"),
    ("TTFT p50 (ms)", "ttft_p50_ms", "{:.1f}"),
    ("TTFT p90 (ms)", "ttft_p90_ms", "{:.1f}"),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.1f}"),
    ("E2E p50 (ms)", "e2e_p50_ms", "{:.0f}"),
    ("E2E p99 (ms)", "e2e_p99_ms", "{:.0f}"),
    ("queue p50 (ms)", "queue_p50_ms", "{:.2f}"),
    ("queue p99 (ms)", "queue_p99_ms", "{:.2f}"),
    ("requests/s", "requests_per_s", "{:.2f}"),
    ("output tokens/s", "output_tokens_per_s", "{:.0f}"),
    ("prompt tokens p50", "prompt_tokens_p50", "{:.0f}"),
    ("output tokens", "output_tokens", "{:.0f}"),
]


def _markdown(report: dict[str, Any]) -> str:
    plan, tool, figures = report["plan"], report["tool"], report["figures"]
    joined = report["client_minus_server"]
    lines = [
        f"# Our gateway under {tool['name']} {tool['version']}",
        "",
        f"{report['date']}; `{report['command']}`; {report['machine']}; CPU: {report['cpu_model']}; "
        f"load average at start {report['load_average']}; wall time {report['wall_s']} s "
        f"({tool['name']} itself: {tool['wall_s']} s).",
        "",
        f"{tool['name']} (`openai_http` backend, `{COMPLETIONS}`, streamed) sent {plan['requests']} requests at "
        f"{plan['rate']:g} req/s ({plan['arrivals']} arrivals) through Envoy and the picker (policy `default`) to "
        f"{BACKENDS} emulated H100 + Llama-3.1-8B servers in real time. Synthetic prompts of "
        f"{plan['prompt_tokens'][0]} ± {plan['prompt_tokens'][1]} tokens in [{plan['prompt_tokens'][2]}, "
        f"{plan['prompt_tokens'][3]}] by the tool's tokenizer ({report['server_prompt_tokens']['min']} to "
        f"{report['server_prompt_tokens']['max']} by the servers' count), outputs of {plan['output_tokens'][2]} "
        f"to {plan['output_tokens'][3]} tokens.",
        "",
    ]
    lines += table(
        ["", *(f["source"] for f in figures)],
        ([label, *(None if f[key] is None else fmt.format(f[key]) for f in figures)] for label, key, fmt in _ROWS),
    )
    routing = report["routing"]
    lines += [
        "",
        f"Counts agree (tool = servers = Envoy = planned): **{'yes' if report['counts_agree'] else 'NO'}**. "
        "Routed by the picker: "
        + ", ".join(f"{k} {v}" for k, v in routing["by_cluster"].items())
        + "; per server: "
        + ", ".join(f"{k} {v}" for k, v in routing["by_upstream"].items())
        + ".",
        "",
        f"Client minus server, per request ({joined['joined']} requests joined on their (prompt, output) token "
        f"counts): TTFT p50 {_ms(joined['ttft_p50_ms'])}, p99 {_ms(joined['ttft_p99_ms'])}; E2E p50 "
        f"{_ms(joined['e2e_p50_ms'])}, p99 {_ms(joined['e2e_p99_ms'])}. Where the E2E gap lies, from the p50s: "
        f"client minus Envoy {_gap(figures[0], figures[2])} (the client and its loopback leg), Envoy minus servers "
        f"{_gap(figures[2], figures[1])} (the picker hop, Envoy's two legs, the last event's write).",
        "",
        f"{tool['name']}'s own warnings: " + ("; ".join(report["tool_warnings"]) or "none") + ".",
        "",
        "## Why the columns differ",
        "",
        f"- **{tool['name']}** times each request on the client, from sending it to the first streamed token (TTFT) "
        "and to the end of the stream (E2E). That includes the loopback hops, Envoy buffering the body for the "
        "picker, the picker's decision (one ext_proc gRPC round trip), Envoy forwarding to the server, and the "
        "first SSE event coming back through Envoy, and the tool's own event loop and parsing on a busy 2-core "
        "machine. Its token counts come from the servers' `usage`, so they match the servers' request by request "
        "(that is what the join above relies on).",
        "- **The servers** report engine time from the request's arrival at the server: none of the gateway is in "
        "it. Their TTFT is queueing plus prefill, their E2E ends at the last decode step, before the last event "
        "is written. At this rate the servers barely queue, so most of the client-server gap is the gateway path "
        "plus the client.",
        "- **Envoy** logs `%DURATION%` (whole ms, from the first byte it received from the client to the last byte "
        "it sent): the picker hop and the server's time, without the client. The bootstrap logs no time to first "
        "byte, so Envoy has no TTFT column.",
        "- Requests/s and output tokens/s: the tool divides by its own measured span (first request sent to last "
        "response done), the servers by first arrival to last finish, so both are close to the offered rate when "
        "nothing backs up. Every percentile is a nearest rank (the smallest value whose share reaches p), guidellm's "
        "rule, so the p99 of a few hundred requests is one of the slowest two or three. Where n * p is a whole "
        "number, guidellm's running float sum of 1/n can fall just short of p and take the next rank: that is "
        "why a p50 of the same token counts can differ between the first two columns.",
        "",
    ]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} ms"


def _gap(outer: dict[str, Any], inner: dict[str, Any]) -> str:
    if outer["e2e_p50_ms"] is None or inner["e2e_p50_ms"] is None:
        return "—"
    return _ms(outer["e2e_p50_ms"] - inner["e2e_p50_ms"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--quick", action="store_true", help="60 requests instead of 200")
    parser.add_argument("--requests", type=int, default=None, help="requests to send (default 200, --quick 60)")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--arrivals", choices=("constant", "poisson"), default="constant")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"the venv that has {TOOL}")


def run(args: argparse.Namespace) -> int:
    requests = args.requests if args.requests is not None else (60 if args.quick else 200)
    if requests < 1 or args.rate <= 0:
        print("inferlb bench external: error: --requests must be >= 1 and --rate > 0", file=sys.stderr)
        return 2
    plan = Plan(requests=requests, rate=args.rate, arrivals=args.arrivals)
    workdir = Path(tempfile.mkdtemp(prefix="inferlb-external-"))  # tokenizer, scenario, the tool's report, logs
    print(f"working files in {workdir}", flush=True)
    load = os.getloadavg()
    started = time.monotonic()
    try:
        measured = measure(plan, args.venv, workdir)
    except ExternalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report = {
        **header(args.command),
        "cpu_model": cpu_model(),
        "load_average": " ".join(f"{x:.2f}" for x in load),
        "wall_s": round(time.monotonic() - started, 1),
        "workdir": str(workdir),
        "plan": asdict(plan),
        **measured,
    }
    markdown = _markdown(report)
    write(args.out, "external", report, markdown)
    print(markdown)
    return 0 if report["counts_agree"] else 1


if __name__ == "__main__":
    from inferlb.bench.suites import script

    raise SystemExit(script(sys.modules[__name__]))
