"""Membership under load, through a real Envoy with emulated servers: endpoints that join, leave and die.

    inferlb bench membership --out bench/results [--source etcd|file ...] [--quick]

One run per discovery source, each the same timeline under an open-loop load (``bench/faultload.py``, ~100
requests/s of streamed completions, 10% long) over four emulated servers, each its own process:

- at the start the pool is servers 0, 1 and 3 (server 0 listed in the config file; 1 and 3 in the source);
- ``join``: server 2 is added to the source; it should get requests within a second and follow its slow-start
  ramp (its share of the decisions, in half-second bins, is plotted against the ramp's fraction);
- ``leave``: server 1 is removed from the source with requests in flight; it should get no new request, its
  streams should finish, and no client should see an error;
- ``kill``: server 3 is SIGKILLed (it stays in the source, as a crashed process would until its orchestrator
  notices); what it costs beyond the requests that were in flight on it, and how many Envoy retried.

The runs: etcd (a real etcd, keys under a prefix), the config file (rewritten; the picker looks at it every
quarter of a second) and Kubernetes (Pods, and a Service's EndpointSlice, in the in-repo API server,
bench/kubeapi.py: no real one can run here) with Envoy's ORIGINAL_DST cluster; etcd with the Override Host
cluster (the picker names its best three, Envoy retries a request that never arrived on the next); and etcd
without slow start, to show what the ramp prevents. Then `bench/weightdelay.py`: a pushed weight, timed to
Envoy's ACK and to its effect.

Results: ``membership.json`` (one object per scenario and run, with at least ``scenario``, ``sent``, ``errors``,
``first_request_after_join_s``, ``retries``), ``membership.md`` and ``membership-ramp.png``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from inferlb.bench import weightdelay
from inferlb.bench.etcdserver import delete, etcd_server, put
from inferlb.bench.kubeapi import endpoint_slice, pod
from inferlb.bench.report import header, table, write
from inferlb.bench.resilience import read_records, start_load, wait_load
from inferlb.envoyconf import EnvoyOptions
from inferlb.procs import ManagedProcess, free_port, http_ok, stop_all
from inferlb.stack import LocalStack, StackOptions, start_sim

__all__ = ["SOURCES", "add_arguments", "run"]

MODEL = "m"
SOURCES = ("etcd", "file", "kubernetes", "kubernetes-slices")
# (source, Envoy's cluster mode) of each run: ORIGINAL_DST with both sources, and Override Host with retries.
# The last runs without slow start, to show what it prevents.
RUNS = (
    ("etcd", "original-dst", True),
    ("file", "original-dst", True),
    ("kubernetes", "original-dst", True),
    ("kubernetes-slices", "original-dst", True),
    ("etcd", "override-host", True),
    ("etcd", "original-dst", False),
)
PREFIX = "/inferlb/bench/"
BIN_S = 0.5


@dataclass(frozen=True, slots=True)
class Timeline:
    rate: float = 100.0
    duration_s: float = 14.0
    join_at_s: float = 2.5
    leave_at_s: float = 7.0
    kill_at_s: float = 10.5
    ramp_s: float = 8.0
    min_fraction: float = 0.1
    short_tokens: int = 16
    long_tokens: int = 200


QUICK = Timeline(rate=40.0, duration_s=8.0, join_at_s=1.5, leave_at_s=4.5, kill_at_s=6.0, ramp_s=4.0)


def _entry(address: str) -> dict[str, Any]:
    return {"address": address, "models": [MODEL]}


class Source:
    """Where the run's pool comes from, and the two changes made to it."""

    name: str
    stack: LocalStack | None = None  # the run's, once it runs

    def addresses(self) -> list[str]:
        """The four servers' addresses."""
        return [f"127.0.0.1:{free_port()}" for _ in range(4)]

    def picker_pool(self, static: str, members: list[str]) -> dict[str, Any]:
        raise NotImplementedError

    def add(self, address: str) -> None:
        raise NotImplementedError

    def remove(self, address: str) -> None:
        raise NotImplementedError


class EtcdMembers(Source):
    name = "etcd"

    def __init__(self, url: str) -> None:
        self.url = url

    def picker_pool(self, static: str, members: list[str]) -> dict[str, Any]:
        for address in members:
            put(self.url, PREFIX + address, _entry(address))
        return {"endpoints": [_entry(static)], "discovery": {"etcd": {"urls": [self.url], "prefix": PREFIX}}}

    def add(self, address: str) -> None:
        put(self.url, PREFIX + address, _entry(address))

    def remove(self, address: str) -> None:
        delete(self.url, PREFIX + address)


class KubeMembers(Source):
    """Pods in the in-repo API server (bench/kubeapi.py, its own process): each server a Pod with an IP of its
    own (127.0.0.1x on loopback) and the one target port."""

    name = "kubernetes"

    def __init__(self, url: str, port: int) -> None:
        self.url = url
        self.port = port

    def addresses(self) -> list[str]:
        return [f"127.0.0.{11 + i}:{self.port}" for i in range(4)]

    def _pod(self, address: str) -> dict[str, Any]:
        ip = address.rsplit(":", 1)[0]
        return pod(f"server-{ip.rsplit('.', 1)[1]}", ip, {"app": "bench"}, models=MODEL)

    def picker_pool(self, static: str, members: list[str]) -> dict[str, Any]:
        for address in members:
            self.add(address)
        kubernetes = {
            "namespace": "default",
            "selector": {"app": "bench"},
            "target_ports": [self.port],
            "api_url": self.url,
            "token_file": None,
            "ca_file": None,
        }
        return {"endpoints": [_entry(static)], "discovery": {"kubernetes": kubernetes}}

    def add(self, address: str) -> None:
        httpx.post(f"{self.url}/api/v1/namespaces/default/pods", json=self._pod(address), timeout=5).raise_for_status()

    def remove(self, address: str) -> None:
        name = self._pod(address)["metadata"]["name"]
        httpx.delete(f"{self.url}/api/v1/namespaces/default/pods/{name}", timeout=5).raise_for_status()


class KubeSliceMembers(KubeMembers):
    """A Service's EndpointSlice in the in-repo API server: the servers are its endpoints; one that leaves is
    first marked terminating (not ready), as Kubernetes does while its Pod shuts down."""

    name = "kubernetes-slices"
    slice_name = "bench-slice-1"

    def __init__(self, url: str, port: int) -> None:
        super().__init__(url, port)
        self.ready: dict[str, bool] = {}

    def picker_pool(self, static: str, members: list[str]) -> dict[str, Any]:
        for address in members:
            self.ready[address.rsplit(":", 1)[0]] = True
        self._put()
        kubernetes: dict[str, Any] = {"namespace": "default", "service": "bench", "models": [MODEL]}
        kubernetes.update(api_url=self.url, token_file=None, ca_file=None)
        return {"endpoints": [_entry(static)], "discovery": {"kubernetes": kubernetes}}

    def _put(self) -> None:
        listed = list(self.ready.items())
        terminating = tuple(ip for ip, ready in listed if not ready)
        body = endpoint_slice(self.slice_name, "bench", listed, (self.port,), terminating=terminating)
        path = f"{self.url}/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/{self.slice_name}"
        httpx.put(path, json=body, timeout=5).raise_for_status()

    def add(self, address: str) -> None:
        self.ready[address.rsplit(":", 1)[0]] = True
        self._put()

    def remove(self, address: str) -> None:
        self.ready[address.rsplit(":", 1)[0]] = False
        self._put()


class FileMembers(Source):
    name = "file"

    def __init__(self) -> None:
        self.listed: list[str] = []

    def picker_pool(self, static: str, members: list[str]) -> dict[str, Any]:
        self.listed = [static, *members]
        return {"endpoints": [_entry(a) for a in self.listed]}

    def _rewrite(self) -> None:
        stack = self.stack
        assert stack is not None, "the run's stack is set once it runs"
        document = yaml.safe_load(stack.config_path.read_text(encoding="utf-8"))
        document["pool"]["endpoints"] = [_entry(a) for a in self.listed]
        staged = stack.config_path.with_suffix(".new")
        staged.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
        staged.replace(stack.config_path)  # one rename: the picker never reads half a file

    def add(self, address: str) -> None:
        self.listed.append(address)
        self._rewrite()

    def remove(self, address: str) -> None:
        self.listed.remove(address)
        self._rewrite()


@contextmanager
def kube_api(workdir: Path) -> Iterator[str]:
    """The in-repo Kubernetes API server in its own process; yields its URL."""
    address = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "inferlb.bench.kubeapi", "--listen", address]
    process = ManagedProcess("kubernetes API", argv, workdir / "kubeapi.log").start()
    try:
        url = f"http://{address}"
        process.wait_ready(http_ok(f"{url}/api/v1/namespaces/default/pods"), 30, "serving")
        yield url
    finally:
        process.stop()


def _at(started: float, offset: float) -> float:
    """Sleep until ``offset`` seconds into the run (a point of the timeline, not a wait for readiness)."""
    time.sleep(max(0.0, started + offset - time.time()))
    return time.time()


def _run(
    source: Source,
    timeline: Timeline,
    workdir: Path,
    command: str,
    cluster_mode: str = "original-dst",
    slow_start: bool = True,
) -> list[dict[str, Any]]:
    addresses = source.addresses()
    servers = [start_sim([a], workdir / f"server-{i}.log", "--model", MODEL) for i, a in enumerate(addresses)]
    pool = source.picker_pool(addresses[0], [addresses[1], addresses[3]])
    pool["slow_start"] = {"ramp_s": timeline.ramp_s if slow_start else 0, "min_fraction": timeline.min_fraction}
    override = cluster_mode == "override-host"
    options = StackOptions(
        models=(MODEL,),
        policy="default",
        servers=tuple(addresses),
        # With Override Host the picker names its best three: Envoy retries a request that never arrived.
        picker_config={"pool": pool, **({"destinations": 3} if override else {})},
        envoy=EnvoyOptions(cluster_mode=cluster_mode, xds=True if override else None),
    )
    try:
        with LocalStack(options, workdir) as stack:
            source.stack = stack
            retries_before = _retries(stack)
            records_path = workdir / "records.jsonl"
            load = start_load(
                stack, records_path, timeline.rate, timeline.duration_s, timeline.short_tokens, timeline.long_tokens
            )
            started = time.time() + 0.2  # faultload's own start offset
            joined = _at(started, timeline.join_at_s)
            source.add(addresses[2])
            left = _at(started, timeline.leave_at_s)
            source.remove(addresses[1])
            killed = _at(started, timeline.kill_at_s)
            servers[3].kill()
            wait_load(load, timeline.duration_s + 300)
            retries = _retries(stack) - retries_before
            log = {entry.get("request_id", ""): entry for entry in _settled_log(stack, records_path)}
    finally:
        stop_all(servers)
    records = read_records(records_path)
    for record in records:
        entry = log.get(record["request_id"], {})
        # Where it went: the upstream Envoy connected to (after any retry), else the server that answered, else the
        # picker's first choice.
        upstream = entry.get("upstream") or ""
        record["picked"] = (
            upstream if upstream not in ("", "-") else record["server"] or (entry.get("picked") or "").split(",")[0]
        )
        # A refused request has no client-side end time (faultload stops at its status); Envoy's log has its length.
        record["first_choice"] = (entry.get("picked") or "").split(",")[0]
        seconds = record["e2e_s"] if record["e2e_s"] is not None else _number(entry.get("duration_ms")) / 1000
        record["end"] = record["sent"] + seconds
    facts = {
        "source": source.name,
        "cluster_mode": cluster_mode,
        "slow_start": slow_start,
        "rate": timeline.rate,
        "duration_s": timeline.duration_s,
        "command": command,
    }
    return [
        {**_join(records, addresses[2], joined, left, timeline), "retries": retries, **facts},
        {**_leave(records, addresses[1], left, killed, addresses[3]), "retries": retries, **facts},
        {**_kill(records, addresses[3], killed), "retries": retries, **facts},
    ]


def _settled_log(stack: LocalStack, records_path: Path) -> list[dict[str, Any]]:
    """Envoy's access log once it holds an entry per request sent (it flushes every 100 ms)."""
    wanted = len(read_records(records_path))
    deadline = time.monotonic() + 10
    entries = stack.access_log()
    while len(entries) < wanted and time.monotonic() < deadline:
        time.sleep(0.1)  # a poll interval, bounded by the deadline
        entries = stack.access_log()
    return entries


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _retries(stack: LocalStack) -> int:
    counters = stack.envoy_counters("cluster.")
    return sum(v for k, v in counters.items() if k.endswith(".upstream_rq_retry"))


def _failed(record: dict[str, Any]) -> bool:
    return bool(record["status"] != 200 or record["cut"])


def _window(records: list[dict[str, Any]], low: float, high: float) -> list[dict[str, Any]]:
    return [r for r in records if low <= r["sent"] < high]


def _join(
    records: list[dict[str, Any]], joiner: str, joined: float, until: float, timeline: Timeline
) -> dict[str, Any]:
    after = _window(records, joined, until)
    to_joiner = [r for r in after if r["picked"] == joiner]
    first = min((r["sent"] for r in to_joiner), default=None)
    bins = []
    t = joined
    while t < until:
        window = _window(records, t, t + BIN_S)
        share = sum(r["picked"] == joiner for r in window) / len(window) if window else None
        elapsed = t + BIN_S / 2 - joined
        ramp = min(1.0, timeline.min_fraction + (1 - timeline.min_fraction) * elapsed / timeline.ramp_s)
        bins.append({"t_s": round(elapsed, 2), "share": None if share is None else round(share, 3), "ramp": ramp})
        t += BIN_S
    return {
        "scenario": "join",
        "sent": len(after),
        "errors": sum(map(_failed, after)),
        "first_request_after_join_s": None if first is None else round(first - joined, 3),
        "joiner_requests": len(to_joiner),
        "joiner_share": round(len(to_joiner) / len(after), 3) if after else None,
        "ramp_s": timeline.ramp_s,
        "share_bins": bins,
    }


def _leave(records: list[dict[str, Any]], leaver: str, left: float, until: float, victim: str) -> dict[str, Any]:
    # The requests of this window on the server killed next are the kill's to count, not the leave's.
    window = [r for r in _window(records, left, until) if r["picked"] != victim]
    on_leaver = [r for r in records if r["picked"] == leaver]
    in_flight = [r for r in on_leaver if r["sent"] < left < r["end"]]
    # A decision made in the few ms between the change and the picker applying it is not a new request after it.
    late = [r for r in on_leaver if r["sent"] > left + 0.25]
    drained = max((r["end"] for r in in_flight), default=left)
    return {
        "scenario": "leave",
        "sent": len(window),
        "errors": sum(map(_failed, window)) + sum(map(_failed, in_flight)),
        "first_request_after_join_s": None,
        "in_flight_at_leave": len(in_flight),
        "in_flight_failed": sum(map(_failed, in_flight)),
        "sent_to_leaver_after_0_25_s": len(late),
        "drained_after_s": round(drained - left, 3),
    }


def _kill(records: list[dict[str, Any]], victim: str, killed: float) -> dict[str, Any]:
    window = [r for r in records if r["sent"] >= killed]
    in_flight = [r for r in records if r["picked"] == victim and r["sent"] < killed < r["end"]]
    failed_after = [r for r in window if _failed(r)]
    last = max((r["sent"] for r in failed_after), default=None)
    return {
        "scenario": "kill",
        "sent": len(window),
        "errors": len(failed_after) + sum(map(_failed, in_flight)),
        "first_request_after_join_s": None,
        "in_flight_at_kill": len(in_flight),
        "in_flight_failed": sum(map(_failed, in_flight)),
        "failed_after_kill": len(failed_after),
        "last_failure_after_s": None if last is None else round(last - killed, 3),
        "sent_to_victim_after_kill": sum(r["picked"] == victim for r in window),
        # The picker's first choice was the dead server, and Envoy served the request from the next one listed.
        "served_by_next_choice": sum(r["first_choice"] == victim and r["picked"] != victim for r in window),
    }


def _plot(results: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3.6), dpi=110)
    joins = [r for r in results if r["scenario"] == "join" and r.get("share_bins")]
    for result in joins:
        bins = [b for b in result["share_bins"] if b["share"] is not None]
        label = f"{result['source']}, {result['cluster_mode']}" + ("" if result["slow_start"] else ", no slow start")
        axes.plot([b["t_s"] for b in bins], [b["share"] for b in bins], marker="o", label=label)
    if joins:
        ramp = joins[0]["share_bins"]
        axes.plot(
            [b["t_s"] for b in ramp],
            [b["ramp"] for b in ramp],
            "k--",
            label="the ramp's fraction (before its idle speed-up)",
        )
        axes.axhline(0.25, color="grey", linewidth=0.8, linestyle=":", label="a fair share (1 of 4)")
    axes.set_xlabel("seconds since the server joined")
    axes.set_ylabel("its share of the requests")
    axes.set_ylim(0, 1.05)
    axes.set_title("A joining server's share of the traffic under slow start")
    axes.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def _markdown(results: list[dict[str, Any]], command: str) -> str:
    meta = header(command)
    lines = [
        "# Membership under load",
        "",
        f"{meta['date']} · `{command}` · {meta['machine']}",
        "",
        "Real Envoy, the picker (`default` preset), four emulated servers each in its own process, an open-loop",
        "load of streamed completions (bench/faultload.py). Errors: client-visible failures (a status other than",
        "200, or a stream cut short). Retries: Envoy's `upstream_rq_retry`, over the whole run.",
        "",
    ]
    rows = []
    for r in results:
        if r["scenario"] == "weight-update":
            continue
        if r["scenario"] == "join":
            detail = f"first request {r['first_request_after_join_s']} s after the join; share {r['joiner_share']}"
        elif r["scenario"] == "leave":
            detail = (
                f"{r['in_flight_at_leave']} in flight at the removal ({r['in_flight_failed']} failed), "
                f"{r['sent_to_leaver_after_0_25_s']} sent there later; drained after {r['drained_after_s']} s"
            )
        else:
            detail = (
                f"{r['in_flight_at_kill']} in flight on it ({r['in_flight_failed']} failed); "
                f"{r['failed_after_kill']} sent after the kill failed, the last {r['last_failure_after_s']} s after; "
                f"{r['served_by_next_choice']} picked it first and were served by the next listed"
            )
        ramp = "on" if r["slow_start"] else "off"
        rows.append([r["source"], r["cluster_mode"], ramp, r["scenario"], r["sent"], r["errors"], r["retries"], detail])
    head = ["source", "Envoy cluster", "slow start", "scenario", "sent", "errors", "retries", "what happened"]
    lines += table(head, rows, "llllrrrl")
    lines += ["", "![a joining server's share under slow start](membership-ramp.png)", ""]
    updates = [r for r in results if r["scenario"] == "weight-update"]
    if updates:
        lines += [
            "## A pushed weight, to its effect on Envoy's split (weights tier)",
            "",
            "The picker's control plane pushes 1000:1 between two servers, then 1:1000; Envoy's ACK of the new",
            "version, and the first of ten requests in a row to the newly favoured server, timed from the push",
            "(bench/weightdelay.py). The bootstrap sets `update_merge_window: 0s` on the EDS clusters; Envoy's",
            "default is 1 s, measured beside it.",
            "",
        ]
        lines += table(
            ["Envoy merge window", "rounds", "ACK after (median)", "effect after (median)", "effect after (max)"],
            [
                [
                    f"{r['eds_merge_window_ms']} ms",
                    len(r["rounds"]),
                    _seconds(r["ack_s_median"]),
                    _seconds(r["effect_s_median"]),
                    _seconds(r["effect_s_max"]),
                ]
                for r in updates
            ],
        )
        lines.append("")
    return "\n".join(lines) + "\n"


def _seconds(value: float | None) -> str | None:
    return None if value is None else f"{value * 1000:.1f} ms"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--source", action="append", choices=SOURCES, help="run only these (repeatable)")
    parser.add_argument("--quick", action="store_true", help="a short run at a low rate")
    parser.add_argument("--workdir", type=Path, help="keep each run's logs here (default: a temporary folder)")


def run(args: argparse.Namespace) -> int:
    timeline = QUICK if args.quick else Timeline()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="inferlb-membership-") as temporary:
        folder = args.workdir or Path(temporary)
        for name, mode, ramped in RUNS:
            if args.source and name not in args.source:
                continue
            workdir = folder / f"{name}-{mode}{'' if ramped else '-no-slow-start'}"
            workdir.mkdir(parents=True, exist_ok=True)
            what = "" if ramped else ", no slow start"
            print(f"membership: {name}, {mode}{what}, {timeline.duration_s:g} s at {timeline.rate:g} req/s", flush=True)
            if name == "etcd":
                with etcd_server(workdir) as url:
                    results += _run(EtcdMembers(url), timeline, workdir, args.command, mode, ramped)
            elif name in ("kubernetes", "kubernetes-slices"):
                kind = KubeMembers if name == "kubernetes" else KubeSliceMembers
                with kube_api(workdir) as url:
                    results += _run(kind(url, free_port("127.0.0.11")), timeline, workdir, args.command, mode, ramped)
            else:
                results += _run(FileMembers(), timeline, workdir, args.command, mode, ramped)
            for result in results[-3:]:
                print({k: v for k, v in result.items() if k not in ("share_bins", "command")}, flush=True)
        if not args.source:
            print("weight updates: push to effect, with and without Envoy's merge window", flush=True)
            results += weightdelay.measure(folder / "weights", rounds=4 if args.quick else 10)
            for result in results[-2:]:
                print({k: v for k, v in result.items() if k != "rounds"}, flush=True)
    name = "membership-quick" if args.quick else "membership"
    write(args.out, name, results, _markdown(results, args.command))
    if not args.quick:
        print(f"wrote {_plot(results, args.out / 'membership-ramp.png')}")
    return 0


if __name__ == "__main__":
    from inferlb.bench.suites import script

    raise SystemExit(script(sys.modules[__name__]))
