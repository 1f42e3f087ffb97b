"""Several picker processes on one node: ``inferlb serve --workers N``.

One picker process routes on one core (the GIL: about 1.5k requests/s here with buffered bodies). With
``--workers N`` a small supervisor starts N full pickers, each its own process, and keeps them running:

* **Ports.** Worker ``i`` (0 to N-1) listens on the config's ``listen`` port plus ``i``, and serves its admin API
  on ``admin``'s port plus ``i``: Envoy's picker cluster lists the N addresses (``inferlb envoy-config
  --picker-workers N``) and spreads streams over them per stream, and Prometheus scrapes each worker. One port
  shared with SO_REUSEPORT would look simpler, but the kernel spreads *connections* over the processes and Envoy
  keeps a few long-lived HTTP/2 connections to a picker (one per Envoy worker thread): all of one Envoy's
  streams could land on one worker. Separate ports let Envoy balance every stream and health-check each worker.
* **Shared state.** The workers are replicas of one picker and share routing state through Redis (``replicas:``
  in the config, required): each routes as if it saw every worker's decisions. They share prefix hashes only
  with the same ``PYTHONHASHSEED``; where none is set the supervisor picks one secret seed for its workers.
* **Life.** SIGTERM or SIGINT goes to every worker (each drains as one picker does); a second one cuts the
  drain short. A worker that exits before it has ever started stops the whole group (a port in use, an
  unreadable secret: the same error would come again); one that dies later is started again after a pause
  that doubles from ``RESTART_PAUSE_S`` up to ``MAX_RESTART_PAUSE_S``, and is reset once a worker has run for
  ``STABLE_S``. Each worker tells the supervisor it is serving through a pipe (``READY_FD_ENV``).
* **Not shared.** Spans come to one OTLP receiver address, so ``otel.receiver`` is refused with workers (each
  worker can time the responses it observes: ``otel.latency_source: stream``); each worker scrapes every
  endpoint's metrics itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from inferlb.scorer.address import format_address, parse_address
from inferlb.scorer.config import OTEL_FIXED_AT_START, Config, load_config
from inferlb.scorer.errors import ConfigError

__all__ = [
    "MAX_WORKERS",
    "READY_FD_ENV",
    "SUPERVISOR_FD_ENV",
    "check_workers",
    "say_ready",
    "supervise",
    "watch_supervisor",
    "worker_addresses",
    "worker_config",
]

logger = logging.getLogger(__name__)

MAX_WORKERS = 64
READY_FD_ENV = "INFERLB_WORKER_READY_FD"  # a worker writes one byte to this file descriptor once it serves
# ... and then one every HEARTBEAT_S from its event loop; a worker silent for HUNG_S (stopped, its loop blocked) is
# killed by the supervisor and started again (Envoy's health check has passed it over within a second already).
HEARTBEAT_S = 1.0
HUNG_S = 15.0
# A worker watches this file descriptor (a pipe's read end whose write end only the supervisor holds): at its end
# of file the supervisor is gone (killed, even with SIGKILL), and the worker stops as if sent SIGTERM.
SUPERVISOR_FD_ENV = "INFERLB_SUPERVISOR_FD"
RESTART_PAUSE_S = 1.0
# A stopping worker still running this long after its drain (``drain_s``; its grace for open streams is 2 s) is hung.
STOP_MARGIN_S = 5.0
MAX_RESTART_PAUSE_S = 30.0
STABLE_S = 60.0  # a worker that ran this long restarts after the first pause again
_HASH_SEED_MAX = (1 << 32) - 1


def _shifted(address: str, by: int, name: str) -> str:
    host, port = parse_address(address)
    if port + by > 65535:
        raise ConfigError(f"{name}: {address!r} plus {by} worker ports goes past port 65535; choose a lower port")
    return format_address(host, port + by)


def worker_config(config: Config, index: int) -> Config:
    """The config worker ``index`` runs: ``listen``, ``admin`` (and ``tls.health_listen``) on their ports plus
    ``index``."""
    if index == 0:
        return config
    admin = None if config.admin is None else _shifted(config.admin, index, "admin")
    tls = config.tls
    if tls is not None and tls.health_listen is not None:
        tls = replace(tls, health_listen=_shifted(tls.health_listen, index, "tls.health_listen"))
    return replace(config, listen=_shifted(config.listen, index, "listen"), admin=admin, tls=tls)


def worker_addresses(config: Config, workers: int) -> list[str]:
    """Where the ``workers`` workers of ``config`` listen for Envoy (the first is ``config.listen``)."""
    return [worker_config(config, i).listen for i in range(workers)]


def check_workers(config: Config, workers: int, flag: str = "--workers") -> None:
    """ConfigError unless ``config`` can run as ``workers`` workers (given by the command-line option ``flag``)."""
    if not 1 <= workers <= MAX_WORKERS:
        raise ConfigError(f"{flag}: {workers} is not between 1 and {MAX_WORKERS}")
    if workers == 1:
        return
    if config.replicas is None:
        raise ConfigError(
            f"{flag} {workers}: the workers share routing state through Redis; set replicas.url in the config "
            "(README, 'Replicas'), or run one worker"
        )
    if config.otel.receiver is not None:
        raise ConfigError(
            f"{flag} {workers}: otel.receiver takes the servers' spans at one address, which one worker of "
            f"{workers} would hold; set otel.latency_source: stream (each worker times the responses it sees) "
            "and remove otel.receiver, or run one worker"
        )
    taken: dict[int, list[tuple[str, str]]] = {}  # port -> (host, whose) of each listener on it
    for index in range(workers):
        worker = worker_config(config, index)
        health = None if worker.tls is None else worker.tls.health_listen
        for name, address in (("listen", worker.listen), ("admin", worker.admin), ("tls.health_listen", health)):
            if address is None:
                continue
            host, port = parse_address(address)
            for other, whose in taken.get(port, ()):
                if host == other or _WILDCARDS & {host, other}:  # one on every address takes the port on each
                    raise ConfigError(
                        f"{flag} {workers}: worker {index}'s {name} {address} is also {whose}'s port; "
                        f"{_spread(config, workers)}"
                    )
            taken.setdefault(port, []).append((host, f"worker {index}'s {name}"))


_WILDCARDS = frozenset({"0.0.0.0", "::"})


def _spread(config: Config, workers: int) -> str:
    """How to space the ports of ``config``'s listeners so that ``workers`` workers fit: an example."""
    port = parse_address(config.listen)[1]
    fields = [("admin", config.admin)]
    if config.tls is not None and config.tls.health_listen is not None:
        fields.append(("tls.health_listen", config.tls.health_listen))
    listed = ["listen", *(name for name, address in fields if address is not None)]
    names = " and ".join([", ".join(listed[:-1]), listed[-1]])
    examples = ", ".join(
        f"{name}: {format_address(parse_address(address)[0], port + workers * i)}"
        for i, (name, address) in enumerate(fields, 1)
        if address is not None
    )
    return f"{names} need ports at least the worker count apart (for example {examples})"


def say_ready(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Tell the supervisor (if any) that this worker serves: one byte down the pipe it gave; then, with ``loop``,
    one every `HEARTBEAT_S` from that loop, so that the supervisor sees a worker that hangs."""
    fd_text = os.environ.pop(READY_FD_ENV, None)
    if fd_text is None:
        return
    fd = int(fd_text)
    try:
        os.write(fd, b"r")
    except OSError:
        os.close(fd)
        return
    if loop is None:
        os.close(fd)
        return
    os.set_blocking(fd, False)

    def beat() -> None:
        try:
            os.write(fd, b"h")
        except BlockingIOError:
            pass  # the supervisor has not read the last ones yet: it knows this worker is alive
        except OSError:
            os.close(fd)  # the supervisor is gone (watch_supervisor stops this worker)
            return
        loop.call_later(HEARTBEAT_S, beat)

    loop.call_later(HEARTBEAT_S, beat)


def watch_supervisor(loop: asyncio.AbstractEventLoop) -> None:
    """In a worker: send this process SIGTERM once the supervisor is gone (see `SUPERVISOR_FD_ENV`)."""
    fd_text = os.environ.pop(SUPERVISOR_FD_ENV, None)
    if fd_text is None:
        return
    fd = int(fd_text)

    def on_readable() -> None:
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            logger.error("the supervisor of this worker is gone: stopping")
            os.kill(os.getpid(), signal.SIGTERM)

    loop.add_reader(fd, on_readable)


@dataclass(slots=True)
class _Worker:
    index: int
    process: asyncio.subprocess.Process | None = None
    ready: asyncio.Future[bool] | None = None
    started_at: float = 0.0
    ever_ready: bool = False
    pause_s: float = RESTART_PAUSE_S
    beat_at: float = 0.0  # when its last heartbeat came (monotonic)
    serving: bool = False  # whether its current process said it serves (heartbeats come from then on)


# What a worker takes from the config file only when it starts, and which the group's workers must agree on: a worker
# restarted from a file edited in one of these would come back on other ports (Envoy's bootstrap lists the group's),
# or share state, serve TLS or count requests otherwise than the others (a running worker refuses such an edit).
FIXED_AT_START = ("listen", "admin", "tls", "replicas", "kv_events", "destinations", "discovery")


def fixed_changes(started: Config, now: Config) -> list[str]:
    """The settings a running worker refuses to change (`FIXED_AT_START`, and the like) in which ``now`` differs
    from ``started``."""
    changed = [name for name in FIXED_AT_START if getattr(started, name) != getattr(now, name)]
    if started.discovery is not None and started.allowed_networks != now.allowed_networks:
        changed.append("allowed_networks")
    if started.inflight.end != now.inflight.end:
        changed.append("inflight.end")
    changed += [
        f"otel.{name}"
        for name in ("receiver", "latency_source", *OTEL_FIXED_AT_START)
        if getattr(started.otel, name) != getattr(now.otel, name)
    ]
    if (started.quotas is None) != (now.quotas is None):
        changed.append("quotas (on or off)")
    if now.max_body_bytes > started.max_body_bytes:
        changed.append("max_body_bytes (raised)")
    return changed


class _Group:
    def __init__(
        self,
        config_path: Path,
        workers: int,
        argv_prefix: list[str],
        env: dict[str, str],
        config: Config,
        listen_override: str | None = None,
    ) -> None:
        self.config_path = config_path
        self.config = config  # as the group started: a restarted worker must run with the same fixed settings
        self.listen_override = listen_override  # `--listen`, which a worker applies over the file's
        self.workers = [_Worker(i) for i in range(workers)]
        self.argv_prefix = argv_prefix
        self.env = env
        self.stopping = False
        # Every worker inherits the read end; only the supervisor holds the write end (closed when it dies).
        self.alive_read, self.alive_write = os.pipe()
        os.set_inheritable(self.alive_write, False)

    async def start(self, worker: _Worker) -> None:
        loop = asyncio.get_running_loop()
        read_fd, write_fd = os.pipe()
        ready: asyncio.Future[bool] = loop.create_future()
        worker.ready = ready

        def on_readable() -> None:
            try:
                said = os.read(read_fd, 64)
            except OSError:
                said = b""
            if not said:  # the worker exited (or closed it)
                loop.remove_reader(read_fd)
                os.close(read_fd)
                if not ready.done():
                    ready.set_result(False)
                return
            worker.beat_at = time.monotonic()
            if not ready.done():
                ready.set_result(said[:1] == b"r")

        loop.add_reader(read_fd, on_readable)
        worker.serving = False
        env = {**self.env, READY_FD_ENV: str(write_fd), SUPERVISOR_FD_ENV: str(self.alive_read)}
        argv = [*self.argv_prefix, "--config", str(self.config_path), "--worker", str(worker.index)]
        try:
            worker.process = await asyncio.create_subprocess_exec(*argv, env=env, pass_fds=(write_fd, self.alive_read))
        finally:
            os.close(write_fd)  # the worker holds its own copy; EOF (no byte) once it exits
        worker.started_at = time.monotonic()

    def unfit(self) -> str | None:
        """Why the config file cannot start a worker of this group now (None: it can)."""
        try:
            now = self.current()
        except ConfigError as exc:
            return f"the config file is refused ({exc})"
        changed = fixed_changes(self.config, now)
        if changed:
            return (
                f"the config file changes {', '.join(changed)}, which the running workers took at start-up: put "
                "it back, or restart the whole group (inferlb serve --workers) with the new file"
            )
        return None

    def current(self) -> Config:
        """The config file as a worker would run it now (with `--listen` over it); ConfigError."""
        now = load_config(self.config_path)
        return now if self.listen_override is None else replace(now, listen=self.listen_override)

    def drain_s(self) -> float:
        """How long the workers drain at a stop: the file's ``drain_s`` now (a reload may have changed it), or the
        group's start-up one if the file cannot be read."""
        try:
            return max(self.current().drain_s, self.config.drain_s)
        except ConfigError:
            return self.config.drain_s

    def kill_hung(self) -> None:
        """Kill each serving worker whose heartbeat has not come for `HUNG_S` (its exit starts it again)."""
        now = time.monotonic()
        for worker in self.workers:
            process = worker.process
            if process is None or process.returncode is not None or not worker.serving:
                continue  # one still starting (waiting for discovery, say) has sent no heartbeat yet
            if now - max(worker.beat_at, worker.started_at) > HUNG_S:
                logger.error(
                    "worker %d (pid %d) sent no heartbeat for %.0f s: killed", worker.index, process.pid, HUNG_S
                )
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                worker.beat_at = now  # once: its exit comes next

    def signal_all(self, signum: int) -> None:
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signum)


async def _run_group(group: _Group) -> int:
    loop = asyncio.get_running_loop()
    signals: asyncio.Queue[int] = asyncio.Queue()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, signals.put_nowait, signum)
    try:
        for worker in group.workers:
            await group.start(worker)
        exits: dict[asyncio.Future[int | None], _Worker] = {asyncio.ensure_future(_exit(w)): w for w in group.workers}
        readies: dict[asyncio.Future[bool], _Worker] = {asyncio.ensure_future(_ready(w)): w for w in group.workers}
        signalled: asyncio.Future[int] = asyncio.ensure_future(signals.get())
        restarts: dict[asyncio.Future[None], _Worker] = {}
        status = 0
        # Once stopping: the workers' drain and grace, and then a margin; a worker still running after that (hung:
        # stopped, or its loop blocked) is killed, so that the group ends and its ports are let go.
        deadline: asyncio.Future[None] | None = None
        tick: asyncio.Future[None] = asyncio.ensure_future(asyncio.sleep(HEARTBEAT_S))
        while exits or restarts:
            if group.stopping and deadline is None:
                stop_after_s = group.drain_s() + STOP_MARGIN_S
                deadline = asyncio.ensure_future(asyncio.sleep(stop_after_s))
            waiting: list[asyncio.Future[Any]] = [*exits, *readies, *restarts, signalled, tick]
            if deadline is not None and not deadline.done():
                waiting.append(deadline)
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if tick in done:
                tick = asyncio.ensure_future(asyncio.sleep(HEARTBEAT_S))
                if not group.stopping:
                    group.kill_hung()
            if deadline is not None and deadline in done:
                running = [w.index for w in group.workers if w.process is not None and w.process.returncode is None]
                if running:
                    logger.error(
                        "workers %s still running %.0f s after the stop: killed",
                        ", ".join(map(str, running)),
                        stop_after_s,
                    )
                    group.signal_all(signal.SIGKILL)
            if signalled in done:
                got = signal.Signals(signalled.result()).name
                if not group.stopping:
                    logger.info("got %s: stopping %d workers", got, len(group.workers))
                group.stopping = True
                group.signal_all(signal.SIGTERM)  # a second one cuts the workers' drain short
                for pending in restarts:
                    pending.cancel()
                restarts.clear()
                signalled = asyncio.ensure_future(signals.get())
            for future in [f for f in done if f in readies]:
                worker = readies.pop(future)
                if future.result():
                    worker.ever_ready = worker.serving = True
                    logger.info("worker %d (pid %d) serving", worker.index, _pid(worker))
            for future in [f for f in done if f in restarts]:
                worker = restarts.pop(future)
                if not group.stopping:
                    problem = group.unfit()
                    if problem is not None:
                        logger.error(
                            "worker %d not started again: %s; trying again in %.0f s",
                            worker.index,
                            problem,
                            worker.pause_s,
                        )
                        restarts[asyncio.ensure_future(asyncio.sleep(worker.pause_s))] = worker
                        worker.pause_s = min(worker.pause_s * 2, MAX_RESTART_PAUSE_S)
                        continue
                    await group.start(worker)
                    exits[asyncio.ensure_future(_exit(worker))] = worker
                    readies[asyncio.ensure_future(_ready(worker))] = worker
            for future in [f for f in done if f in exits]:
                worker = exits.pop(future)
                code = future.result()
                if group.stopping:
                    continue
                if not worker.ever_ready:
                    logger.error(
                        "worker %d exited (status %s) before it served; stopping the other workers", worker.index, code
                    )
                    status = 2 if code in (None, 0) else 128 - code if code < 0 else code  # killed: 128 + signal
                    group.stopping = True
                    group.signal_all(signal.SIGTERM)
                    continue
                ran_s = time.monotonic() - worker.started_at
                worker.pause_s = RESTART_PAUSE_S if ran_s >= STABLE_S else worker.pause_s
                logger.error(
                    "worker %d exited (status %s) after %.0f s; starting it again in %.0f s",
                    worker.index,
                    code,
                    ran_s,
                    worker.pause_s,
                )
                restarts[asyncio.ensure_future(asyncio.sleep(worker.pause_s))] = worker
                worker.pause_s = min(worker.pause_s * 2, MAX_RESTART_PAUSE_S)
        signalled.cancel()
        tick.cancel()
        if deadline is not None:
            deadline.cancel()
        for future in readies:
            future.cancel()
        return status
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        group.signal_all(signal.SIGKILL)
        os.close(group.alive_read)
        os.close(group.alive_write)


async def _exit(worker: _Worker) -> int | None:
    assert worker.process is not None
    return await worker.process.wait()


async def _ready(worker: _Worker) -> bool:
    assert worker.ready is not None
    return await worker.ready


def _pid(worker: _Worker) -> int:
    return worker.process.pid if worker.process is not None else 0


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The workers' environment: ``environ`` with PYTHONHASHSEED set to a secret number where it is not one already.
    Prefix hashes agree between processes only under one seed; "random" and 0 are no seed to share (with them each
    worker would hash its own way, and the prefix index would not be shared)."""
    from inferlb.scorer.replicas import hash_seed_problem  # here: the supervisor itself routes nothing

    env = dict(environ)
    problem = hash_seed_problem(env.get("PYTHONHASHSEED", ""))
    if problem is not None:
        if env.get("PYTHONHASHSEED"):
            logger.warning("%s: the workers get a secret seed of their own instead", problem)
        env["PYTHONHASHSEED"] = str(secrets.randbelow(_HASH_SEED_MAX) + 1)
    return env


def supervise(
    config: Config,
    config_path: Path,
    workers: int,
    *,
    log_level: str = "info",
    extra_args: Sequence[str] = (),
    listen_override: str | None = None,
) -> int:
    """Run ``workers`` workers of the picker configured by ``config_path`` (already loaded as ``config``, with
    ``extra_args`` of ``inferlb serve`` such as ``--listen``) until SIGTERM or SIGINT; the exit status (0, or the
    status of a worker that could not start)."""
    check_workers(config, workers)
    env = worker_environment(os.environ)
    argv = [sys.executable, "-m", "inferlb", "--log-level", log_level, "serve", *extra_args]
    addresses = ", ".join(worker_addresses(config, workers))
    logger.info("inferlb picker: %d workers on %s", workers, addresses)
    return asyncio.run(_run_group(_Group(config_path, workers, argv, env, config, listen_override)))
