"""A whole gateway on loopback: emulated inference servers, the picker and a real Envoy, each its own process.

``inferlb demo``, the integration tests and the benchmarks all use it, so they exercise the same wiring a
deployment has: the rendered bootstrap, the console scripts, real sockets.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import yaml

from inferlb.envoyconf import EnvoyOptions, render_bootstrap
from inferlb.procs import ManagedProcess, find_tool, free_port, free_ports, grpc_serving, http_ok, stop_all
from inferlb.scorer.address import format_address, parse_address
from inferlb.scorer.config import Config, parse_config

READY_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class StackOptions:
    """The shape of a local gateway. ``backends`` emulated servers (``inferlb sim``, GPU x model ``profile``,
    ``time_scale``, plus any ``sim_args``) all serve ``models``.

    ``servers`` names servers that are already running instead (no emulated servers are started then), and
    ``picker_command`` replaces ``inferlb serve`` (it gets ``--config FILE`` appended and must serve gRPC
    health); the benchmarks use both.
    """

    backends: int = 3
    servers: tuple[str, ...] = ()
    picker_command: tuple[str, ...] = ()
    models: tuple[str, ...] = ("demo-model",)
    policy: str = "least-request"
    profile: str = "h100-llama3.1-8b"
    time_scale: float = 1.0
    sim_args: tuple[str, ...] = ()
    spans: bool = False  # the picker runs an OTLP receiver and the emulated servers send it their spans
    latency_source: str = "spans"  # the picker's otel.latency_source; "stream": it times responses itself
    heatmap_bucket_s: float | None = None  # the picker's otel.heatmap_bucket_s (None: the config's default)
    envoy_concurrency: int = 2
    envoy: EnvoyOptions = field(default_factory=EnvoyOptions)
    picker_log_level: str = "info"
    # On SIGTERM the picker keeps answering this long; 0 here, so that stopping a local stack takes no time.
    picker_drain_s: float = 0.0
    picker_config: Mapping[str, Any] = field(default_factory=dict)  # more keys of the picker's YAML
    # Picker processes (replicas) behind the one Envoy, each with its own ports and the same config otherwise
    # (give them `replicas:` in picker_config to share state); picker_env: more environment for each.
    pickers: int = 1
    # The (first) picker runs as `inferlb serve --workers N`: worker i on its listen and admin ports plus i.
    picker_workers: int = 1
    picker_env: Mapping[str, str] = field(default_factory=dict)
    # The emulated servers publish KV events (in this encoding: "map", as vLLM 0.32, or the older "array") and the
    # picker follows them (config kv_events, the emulator's tokenizer); None: no events.
    kv_events: str | None = None
    endpoint_labels: tuple[Mapping[str, str], ...] = ()  # the pool's endpoints' labels, in order (default none)
    # The models the picker is told each endpoint serves, in order (default: all of ``models``, which they do).
    endpoint_models: tuple[tuple[str, ...], ...] = ()
    speeds: Mapping[str, Any] | None = None  # the picker's pool.speeds (relative speeds by an endpoint label)


def start_envoy(bootstrap: Path, log_path: Path, admin_url: str, concurrency: int = 2) -> ManagedProcess:
    """Envoy on the bootstrap file ``bootstrap``, once its admin API at ``admin_url`` says it is ready."""
    argv = [
        find_tool("envoy"),
        "-c",
        str(bootstrap),
        "--concurrency",
        str(concurrency),
        "--disable-hot-restart",
        "--log-level",
        "warning",
        # The access log is read back by the demo and the tests; Envoy's default flush interval is 10 s.
        "--file-flush-interval-msec",
        "100",
    ]
    envoy = ManagedProcess("envoy", argv, log_path).start()
    try:
        envoy.wait_ready(http_ok(f"{admin_url}/ready"), READY_TIMEOUT_S, "ready")
    except BaseException:
        envoy.stop()
        raise
    return envoy


def start_sim(addresses: Sequence[str], log_path: Path, *args: str) -> ManagedProcess:
    """Start ``inferlb sim`` serving ``addresses`` (plus ``args``) as its own process; return once every server
    answers ``/health``. ProcessError (with the log's tail) if it exits or is not ready within READY_TIMEOUT_S."""
    argv = [find_tool("inferlb"), "sim", *args]
    for address in addresses:
        argv += ["--listen", address]
    process = ManagedProcess("emulated servers", argv, log_path).start()
    try:
        for address in addresses:
            process.wait_ready(http_ok(f"http://{address}/health"), READY_TIMEOUT_S, f"serving on {address}")
    except BaseException:
        process.stop()
        raise
    return process


class LocalStack:
    """Starts and stops the processes; ``with LocalStack(...) as stack:`` stops everything on any exit."""

    def __init__(self, options: StackOptions, workdir: Path) -> None:
        self.options = options
        self.workdir = workdir
        self.endpoints = list(options.servers) or [f"127.0.0.1:{free_port()}" for _ in range(options.backends)]
        workers = options.picker_workers
        self.picker_address = f"127.0.0.1:{free_ports(workers) if workers > 1 else free_port()}"
        self.picker_admin_address = f"127.0.0.1:{free_ports(workers) if workers > 1 else free_port()}"
        # The other replicas' (listen, admin) addresses, and their processes once started.
        self.replica_addresses = [
            (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}") for _ in range(options.pickers - 1)
        ]
        self.replicas: list[ManagedProcess] = []
        self.receiver_address = f"127.0.0.1:{free_port()}" if options.spans else None
        # Server i publishes KV events on kv_ports[0] + i and answers replays on kv_ports[1] + i.
        count = len(self.endpoints)
        self.kv_ports = (free_ports(count), free_ports(count)) if options.kv_events else None
        self.gateway_address = f"127.0.0.1:{free_port()}"
        self.admin_address = f"127.0.0.1:{free_port()}"
        self.access_log_path = workdir / "access.log"
        self.config_path = workdir / "picker.yaml"
        # The admin API's bearer token (a file, as a Kubernetes Secret would be mounted): reads of the config,
        # decisions and endpoints and every write need it; send `admin_headers`.
        self.admin_token = secrets.token_hex(24)
        self.admin_token_path = workdir / "admin-token"
        self.envoy_path = workdir / "envoy.yaml"
        self.config: Config = parse_config(self._config_document())
        self.backends: ManagedProcess | None = None
        self.picker: ManagedProcess | None = None
        self.envoy: ManagedProcess | None = None

    @property
    def gateway_url(self) -> str:
        return f"http://{self.gateway_address}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.admin_address}"

    @property
    def admin_headers(self) -> dict[str, str]:
        """The header the picker's admin API wants on its protected routes."""
        return {"authorization": f"Bearer {self.admin_token}"}

    @property
    def picker_admin_url(self) -> str:
        """The picker's admin API (``/endpoints``, ``/decisions``, ``/config``, ``/metrics``)."""
        return f"http://{self.picker_admin_address}"

    @property
    def worker_addresses(self) -> list[tuple[str, str]]:
        """The first picker's workers' (listen, admin) addresses (one pair without ``picker_workers``)."""
        return [
            (_plus(self.picker_address, i), _plus(self.picker_admin_address, i))
            for i in range(self.options.picker_workers)
        ]

    @property
    def picker_admin_urls(self) -> list[str]:
        """Every picker replica's (and worker's) admin API, the first picker's first."""
        pickers = [*self.worker_addresses, *self.replica_addresses]
        return [f"http://{admin}" for _, admin in pickers]

    def _config_document(self, listen: str | None = None, admin: str | None = None) -> dict[str, Any]:
        return {
            "listen": listen or self.picker_address,
            "admin": admin or self.picker_admin_address,
            **({"otel": self._otel()} if self._otel() else {}),
            "policy": self.options.policy,
            "drain_s": self.options.picker_drain_s,
            "admin_auth": {"token_file": str(self.admin_token_path)},
            "pool": {
                "endpoints": [self._endpoint(a) for a in self.endpoints],
                **({"speeds": dict(self.options.speeds)} if self.options.speeds else {}),
            },
            **({"kv_events": self._kv_events()} if self.kv_ports is not None else {}),
            **self.options.picker_config,
        }

    def _kv_events(self) -> dict[str, Any]:
        assert self.kv_ports is not None
        port, replay_port = self.kv_ports
        return {
            "port": port,
            "replay_port": replay_port,
            "ports": {a: port + i for i, a in enumerate(self.endpoints)},
            "replay_ports": {a: replay_port + i for i, a in enumerate(self.endpoints)},
            "tokenizers": {model: "pieces" for model in self.options.models},
        }

    def _otel(self) -> dict[str, Any]:
        otel: dict[str, Any] = {"receiver": self.receiver_address} if self.receiver_address else {}
        if self.options.latency_source != "spans":
            otel["latency_source"] = self.options.latency_source
        if self.options.heatmap_bucket_s is not None:
            otel["heatmap_bucket_s"] = self.options.heatmap_bucket_s
        return otel

    def _endpoint(self, address: str) -> dict[str, Any]:
        index = self.endpoints.index(address)
        models = self.options.endpoint_models[index] if index < len(self.options.endpoint_models) else None
        entry: dict[str, Any] = {"address": address, "models": list(models or self.options.models)}
        labels = self.options.endpoint_labels
        if index < len(labels) and labels[index]:
            entry["labels"] = dict(labels[index])
        if not self.options.servers:  # emulated servers show their GPUs at /gpu, in the GPU agent's schema
            entry["gpu"] = {"url": f"http://{address}/gpu"}
        return entry

    def __enter__(self) -> LocalStack:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LocalStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Envoy appends to its access log; a log left by an earlier run in the same folder would be read as ours.
        self.access_log_path.unlink(missing_ok=True)
        self.admin_token_path.write_text(self.admin_token + "\n", encoding="utf-8")
        self.admin_token_path.chmod(0o600)
        self.config_path.write_text(yaml.safe_dump(self._config_document(), sort_keys=False), encoding="utf-8")
        for i, (listen, admin) in enumerate(self.replica_addresses, 1):
            document = self._config_document(listen, admin)
            (self.workdir / f"picker-{i}.yaml").write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
        envoy_options = replace(
            self.options.envoy,
            listen=self.gateway_address,
            admin=self.admin_address,
            access_log_path=str(self.access_log_path),
            more_pickers=tuple(listen for listen, _ in [*self.worker_addresses[1:], *self.replica_addresses]),
        )
        self.envoy_path.write_text(render_bootstrap(self.config, envoy_options), encoding="utf-8")
        if not self.options.servers:
            self.start_backends()
        if envoy_options.picker:
            self.start_picker()
        self.start_envoy()
        return self

    def start_backends(self) -> None:
        options = self.options
        args = ["--profile", options.profile, "--time-scale", str(options.time_scale), *options.sim_args]
        if self.receiver_address is not None:
            args += ["--otlp-endpoint", self.receiver_address]
        if self.kv_ports is not None:
            args += ["--kv-events-port", str(self.kv_ports[0]), "--kv-events-replay-port", str(self.kv_ports[1])]
            args += ["--kv-events-encoding", str(self.options.kv_events)]
        for model in options.models:
            args += ["--model", model]
        self.backends = start_sim(self.endpoints, self.workdir / "backends.log", *args)

    def picker_serving(self, listen: str) -> Callable[[], bool]:
        """The readiness check of the picker at ``listen`` (over TLS, trusting what Envoy trusts, with ``tls``)."""
        tls = self.config.tls
        if tls is None:
            return grpc_serving(listen)
        return grpc_serving(listen, root_certificates=Path(tls.ca_file or tls.cert_file).read_bytes())

    def start_picker(self) -> None:
        argv = list(self.options.picker_command) or [
            find_tool("inferlb"),
            "--log-level",
            self.options.picker_log_level,
            "serve",
        ]
        env = dict(self.options.picker_env) or None
        workers = ["--workers", str(self.options.picker_workers)] if self.options.picker_workers > 1 else []
        self.picker = ManagedProcess(
            "picker", [*argv, "--config", str(self.config_path), *workers], self.workdir / "picker.log", env
        )
        self.picker.start()
        for listen, _ in self.worker_addresses:
            self.picker.wait_ready(self.picker_serving(listen), READY_TIMEOUT_S, f"serving on {listen}")
        for i, (listen, _) in enumerate(self.replica_addresses, 1):
            config = self.workdir / f"picker-{i}.yaml"
            replica = ManagedProcess(
                f"picker-{i}", [*argv, "--config", str(config)], self.workdir / f"picker-{i}.log", env
            )
            self.replicas.append(replica)
            replica.start().wait_ready(self.picker_serving(listen), READY_TIMEOUT_S, "serving")
        if self.options.picker_command:
            return  # another picker (the hop benchmark's do-nothing one) serves gRPC only
        # The admin API comes up after the gRPC server (after the span receiver's process, where there is one).
        processes = [self.picker] * len(self.worker_addresses) + self.replicas
        for process, url in zip(processes, self.picker_admin_urls, strict=True):
            process.wait_ready(http_ok(f"{url}/healthz"), READY_TIMEOUT_S, "admin API")

    def start_envoy(self) -> None:
        self.envoy = start_envoy(
            self.envoy_path, self.workdir / "envoy.log", self.admin_url, self.options.envoy_concurrency
        )

    def stop(self) -> None:
        stop_all([p for p in (self.envoy, self.picker, *self.replicas, self.backends) if p is not None])

    def pause(self) -> None:
        """Stop every process of the stack (SIGSTOP), the front door first, until `resume`: a benchmark that
        measures one stack of several keeps the idle ones' scrapes and timers off the cores meanwhile."""
        for process in (self.envoy, self.picker, *self.replicas, self.backends):
            if process is not None:
                process.pause()

    def resume(self) -> None:
        """Continue the processes `pause` stopped, the servers first and the front door last."""
        for process in (self.backends, *self.replicas, self.picker, self.envoy):
            if process is not None:
                process.resume()

    def envoy_counters(self, prefix: str = "") -> dict[str, int]:
        """Envoy's counters and gauges whose names start with ``prefix`` (from the admin /stats endpoint)."""
        text = httpx.get(f"{self.admin_url}/stats", params={"filter": f"^{prefix}"}, timeout=5.0).text
        out: dict[str, int] = {}
        for line in text.splitlines():
            name, sep, value = line.partition(": ")
            if sep and value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    def wait_picker_marked_down(self, timeout_s: float = 10.0) -> float:
        """Wait until Envoy's health check of the picker has failed (full-duplex fail-open bootstraps check it);
        the seconds waited. TimeoutError if it has not within ``timeout_s``."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            lines = httpx.get(f"{self.admin_url}/clusters", timeout=5.0).text.splitlines()
            flags = [line for line in lines if line.startswith("inferlb_picker::") and "::health_flags::" in line]
            if flags and all("failed_active_hc" in line for line in flags):
                return time.monotonic() - start
            time.sleep(0.05)
        raise TimeoutError(f"Envoy's health check did not mark the picker down within {timeout_s} s")

    def access_log(self) -> list[dict[str, Any]]:
        """Envoy's access log so far, one dict per finished request. Envoy flushes it every 100 ms, so poll for
        the entries you expect rather than reading once."""
        if not self.access_log_path.exists():
            return []
        lines = self.access_log_path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]


def _plus(address: str, ports: int) -> str:
    host, port = parse_address(address)
    return format_address(host, port + ports)
