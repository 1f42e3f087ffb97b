"""``inferlb serve --workers N``: the ports each worker takes, the configs it refuses, and the supervisor's life
with real processes and a real Redis — workers that see each other, a killed worker started again, a worker
that cannot start stopping the group, and workers that stop when their supervisor is killed."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from inferlb.bench.redisserver import REDIS, RedisServer, redis_server
from inferlb.cli import main
from inferlb.picker import _signal_again
from inferlb.procs import ManagedProcess, find_tool, free_ports
from inferlb.scorer.config import load_config, parse_config
from inferlb.scorer.errors import ConfigError
from inferlb.workers import (
    HUNG_S,
    _Group,
    check_workers,
    worker_addresses,
    worker_config,
    worker_environment,
)

from .conftest import envoy_accepts, poll

needs_redis = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")


def _document(listen: str = "127.0.0.1:9002", admin: str | None = "127.0.0.1:9102", **more: object) -> dict:
    return {
        "listen": listen,
        "admin": admin,
        "pool": {"endpoints": [{"address": "127.0.0.1:8001", "models": ["m"]}]},
        "replicas": {"url": "redis://127.0.0.1:6379/0"},
        **more,
    }


def test_each_worker_listens_and_serves_its_admin_api_on_the_ports_plus_its_index() -> None:
    config = parse_config(_document())
    assert worker_config(config, 0) == config
    second = worker_config(config, 2)
    assert (second.listen, second.admin) == ("127.0.0.1:9004", "127.0.0.1:9104")
    assert worker_addresses(config, 3) == ["127.0.0.1:9002", "127.0.0.1:9003", "127.0.0.1:9004"]
    assert worker_config(parse_config(_document(admin=None)), 1).admin is None
    check_workers(config, 3)


@pytest.mark.parametrize(
    ("document", "workers", "says"),
    [
        ({**_document(), "replicas": None}, 2, "share routing state through Redis; set replicas.url"),
        (_document(otel={"receiver": "127.0.0.1:4317"}), 2, "set otel.latency_source: stream"),
        (
            _document(admin="127.0.0.1:9003"),
            2,
            "worker 1's listen 127.0.0.1:9003 is also worker 0's admin's port; listen and admin need ports at least "
            "the worker count apart (for example admin: 127.0.0.1:9004)",
        ),
        (
            _document(admin="127.0.0.1:9010", tls={"cert_file": "c", "key_file": "k", "health_listen": "0.0.0.0:9003"}),
            2,
            "worker 1's listen 127.0.0.1:9003 is also worker 0's tls.health_listen's port; listen, admin and "
            "tls.health_listen "
            "need ports at least the worker count apart (for example admin: 127.0.0.1:9004, tls.health_listen: "
            "0.0.0.0:9006)",
        ),
        (_document(listen="127.0.0.1:65535"), 2, "goes past port 65535"),
        (_document(), 0, "not between 1 and 64"),
        (_document(), 65, "not between 1 and 64"),
    ],
)
def test_a_config_the_workers_cannot_run_is_refused_with_the_fix(document: dict, workers: int, says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        check_workers(parse_config(document), workers)


def test_one_worker_needs_no_redis() -> None:
    check_workers(parse_config({**_document(), "replicas": None}), 1)


def test_envoy_config_spreads_streams_over_every_worker(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(yaml.safe_dump(_document()))
    out = tmp_path / "envoy.yaml"
    assert main(["envoy-config", "--config", str(path), "--picker-workers", "3", "--out", str(out)]) == 0
    text = out.read_text()
    for port in (9002, 9003, 9004):
        assert f"port_value: {port}}}" in text
    envoy_accepts(out)
    assert main(["envoy-config", "--config", str(path), "--picker-workers", "2", "--picker-address", "p:9002"]) == 2
    path.write_text(yaml.safe_dump({**_document(), "replicas": None}))
    assert main(["envoy-config", "--config", str(path), "--picker-workers", "2"]) == 2
    assert "--picker-workers 2: the workers share routing state" in capsys.readouterr().err


def _write_config(tmp_path: Path, redis: RedisServer, listen_port: int, admin_port: int, drain_s: float = 0) -> Path:
    secret = tmp_path / "redis-password"
    secret.write_text(redis.password)
    document = _document(
        listen=f"127.0.0.1:{listen_port}",
        admin=f"127.0.0.1:{admin_port}",
        drain_s=drain_s,
        replicas={"url": redis.url, "password": {"token_file": str(secret)}},
        signals={"scrape_metrics": False},
    )
    path = tmp_path / "picker.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


@dataclasses.dataclass
class _Running:
    """A supervisor running two workers: their config file, Redis, the workers' admin URLs and the supervisor's
    log."""

    supervisor: ManagedProcess
    config: Path
    redis: RedisServer
    admins: list[str]
    log: Path

    def serving(self) -> dict[int, int]:
        """Once both workers serve as replicas of each other (one peer each, through Redis): index -> pid."""
        poll(lambda: all(_gauge(u, "inferlb_replicas_peers") == 1 for u in self.admins), "each sees one peer", 30.0)
        found: dict[int, int] = poll(lambda: len(w := _workers(self.supervisor.pid)) == 2 and w, "two workers", 30.0)
        return found


@contextlib.contextmanager
def _two_workers(tmp_path: Path, drain_s: float = 0) -> Iterator[_Running]:
    with redis_server(tmp_path / "redis") as redis:
        listen, admin = free_ports(2), free_ports(2)
        config = _write_config(tmp_path, redis, listen, admin, drain_s=drain_s)
        argv = [find_tool("inferlb"), "serve", "--config", str(config), "--workers", "2"]
        log = tmp_path / "supervisor.log"
        supervisor = ManagedProcess("supervisor", argv, log).start()
        try:
            yield _Running(supervisor, config, redis, [f"http://127.0.0.1:{admin + i}" for i in range(2)], log)
        finally:
            supervisor.stop()


def _workers(supervisor: int) -> dict[int, int]:
    """The supervisor's live workers: index -> pid (from /proc)."""
    out = {}
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    for pid in map(int, children):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"--worker" in argv:
            out[int(argv[argv.index(b"--worker") + 1])] = pid
    return out


def _gauge(url: str, name: str) -> float | None:
    try:
        text = httpx.get(f"{url}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@needs_redis
def test_workers_see_each_other_a_killed_one_comes_back_and_all_stop_with_the_supervisor(tmp_path: Path) -> None:
    with _two_workers(tmp_path) as group:
        supervisor, admins = group.supervisor, group.admins
        workers = group.serving()  # each worker a replica of the other
        os.kill(workers[1], signal.SIGKILL)
        back = poll(lambda: (w := _workers(supervisor.pid)).get(1, workers[1]) != workers[1] and w, "restart", 30.0)
        poll(lambda: _gauge(admins[1], "inferlb_replicas_peers") == 1, "the restarted one sees its peer", 30.0)
        assert back[0] == workers[0]  # the other went on serving
        log = group.log.read_text()
        assert "worker 1 exited (status -9)" in log and "starting it again in 1 s" in log
        # The supervisor killed outright (no chance to stop them): the workers see it and stop.
        os.kill(supervisor.pid, signal.SIGKILL)
        poll(lambda: not any(_alive(pid) for pid in back.values()), "workers gone", 30.0)


@needs_redis
def test_a_worker_that_cannot_start_stops_the_whole_group_with_its_status(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as redis:
        listen, admin = free_ports(2), free_ports(2)
        config = _write_config(tmp_path, redis, listen, admin)
        with socket.socket() as taken:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            taken.bind(("127.0.0.1", admin + 1))  # worker 1's admin port
            taken.listen()
            argv = [find_tool("inferlb"), "serve", "--config", str(config), "--workers", "2"]
            supervisor = ManagedProcess("supervisor", argv, tmp_path / "supervisor.log").start()
            try:
                assert supervisor.proc is not None
                assert supervisor.proc.wait(60) == 2
            finally:
                supervisor.stop()
        log = (tmp_path / "supervisor.log").read_text()
        assert f"cannot bind 127.0.0.1:{admin + 1}" in log
        assert "worker 1 exited (status 2) before it served; stopping the other workers" in log


def _readyz(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code
    except httpx.HTTPError:
        return None


@needs_redis
def test_a_sigterm_to_the_whole_process_group_drains_the_workers(tmp_path: Path) -> None:
    # Ctrl-C, and systemd's default KillMode, signal every process of the group: each worker gets the signal
    # itself and again from the supervisor, at once. The copy must not cut the drain short.
    with _two_workers(tmp_path, drain_s=30) as group:
        supervisor, admins = group.supervisor, group.admins
        poll(lambda: all(_readyz(u) == 200 for u in admins), "both workers ready", 30.0)
        assert supervisor.proc is not None
        os.killpg(supervisor.proc.pid, signal.SIGTERM)
        # Draining: not ready, still answering (before, both had stopped within half a second).
        poll(lambda: all(_readyz(u) == 503 for u in admins), "both workers draining", 30.0)
        assert supervisor.proc.poll() is None


async def test_a_second_signal_cuts_the_drain_short_unless_it_is_the_first_ones_copy() -> None:
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()
    copy = asyncio.create_task(_signal_again(signalled, loop, loop.time() + 1000))
    signalled.set()  # within the window: the first signal's copy
    for _ in range(5):
        await asyncio.sleep(0)
    assert not copy.done() and not signalled.is_set()
    copy.cancel()
    later = asyncio.create_task(_signal_again(signalled, loop, loop.time()))
    signalled.set()  # after the window: an operator's second stop
    await asyncio.wait_for(later, 5)


@pytest.mark.parametrize("seed", [None, "", "random", "0"])
def test_the_workers_share_a_secret_hash_seed_unless_one_is_set(seed: str | None) -> None:
    # With "random" (or 0) each worker hashed prompts its own way: the prefix index was not shared.
    environ = {} if seed is None else {"PYTHONHASHSEED": seed}
    given = worker_environment(environ)["PYTHONHASHSEED"]
    assert given.isdigit() and 0 < int(given) <= 4294967295
    assert worker_environment({"PYTHONHASHSEED": "12345"})["PYTHONHASHSEED"] == "12345"


@needs_redis
def test_a_worker_is_not_started_again_from_a_file_that_moved_what_the_group_runs_with(tmp_path: Path) -> None:
    # It came back on the edited file's ports, which Envoy's bootstrap does not list (the others refused the edit).
    with _two_workers(tmp_path) as group:
        supervisor, admins = group.supervisor, group.admins
        workers = group.serving()
        original = group.config.read_text()
        moved_listen, moved_admin = free_ports(2), free_ports(2)
        _write_config(tmp_path, group.redis, moved_listen, moved_admin)
        os.kill(workers[1], signal.SIGKILL)
        poll(
            lambda: "worker 1 not started again: the config file changes listen, admin" in group.log.read_text(),
            "the refusal",
            30.0,
        )
        assert (
            1 not in _workers(supervisor.pid)
            and _gauge(f"http://127.0.0.1:{moved_admin + 1}", "inferlb_replicas_peers") is None
        )
        group.config.write_text(original)  # put back: the worker comes back where the group runs
        poll(lambda: _gauge(admins[1], "inferlb_replicas_peers") == 1, "worker 1 back on its own ports", 60.0)


@needs_redis
def test_a_hung_worker_is_killed_once_its_drain_and_grace_are_long_past(tmp_path: Path) -> None:
    # A worker stopped (or whose loop blocks) never exited: the supervisor waited for good, its ports held.
    with _two_workers(tmp_path, drain_s=0) as group:
        supervisor = group.supervisor
        poll(lambda: all(_readyz(u) == 200 for u in group.admins), "both workers ready", 30.0)
        workers = _workers(supervisor.pid)
        os.kill(workers[1], signal.SIGSTOP)
        assert supervisor.proc is not None
        supervisor.proc.send_signal(signal.SIGTERM)
        poll(lambda: supervisor.proc is not None and supervisor.proc.poll() is not None, "the group ended", 60.0)
        assert not _alive(workers[1])
        assert "workers 1 still running 5 s after the stop: killed" in group.log.read_text()


@needs_redis
def test_a_worker_that_hangs_is_killed_and_started_again(tmp_path: Path) -> None:
    # A worker stopped (or whose loop blocks) stayed so for good: the group served on one worker fewer.
    with _two_workers(tmp_path) as group:
        supervisor, admins = group.supervisor, group.admins
        poll(lambda: all(_readyz(u) == 200 for u in admins), "both workers ready", 30.0)
        workers = _workers(supervisor.pid)
        os.kill(workers[1], signal.SIGSTOP)
        back = poll(lambda: (w := _workers(supervisor.pid)).get(1, workers[1]) != workers[1] and w, "restart", 60.0)
        poll(lambda: _readyz(admins[1]) == 200, "the new worker 1 serving", 30.0)
        assert back[0] == workers[0]
        assert f"worker 1 (pid {workers[1]}) sent no heartbeat for 15 s: killed" in group.log.read_text()


class _Process:
    """Stands in for a worker's process: running until killed."""

    def __init__(self) -> None:
        self.returncode: int | None = None
        self.pid = 4242
        self.killed = False

    def kill(self) -> None:
        self.killed = True


def _group(tmp_path: Path, listen_override: str | None = None, **document: object) -> _Group:
    path = tmp_path / "picker.yaml"
    path.write_text(yaml.safe_dump(_document(listen="127.0.0.1:19010", admin="127.0.0.1:19020", **document)))
    config = load_config(path)
    if listen_override is not None:
        config = dataclasses.replace(config, listen=listen_override)
    return _Group(path, 2, [], {}, config, listen_override)


def test_a_restart_compares_the_file_as_the_workers_run_it_with_listen_over_it(tmp_path: Path) -> None:
    # With --listen, the file's own listen always differed from the group's: no worker was ever started again.
    group = _group(tmp_path, listen_override="127.0.0.1:19110")
    try:
        assert group.unfit() is None
        group.listen_override = None
        assert "changes listen" in (group.unfit() or "")
    finally:
        os.close(group.alive_read)
        os.close(group.alive_write)


def test_only_a_worker_that_said_it_serves_can_be_killed_as_hung(tmp_path: Path) -> None:
    # A restarted worker waiting for discovery has sent no heartbeat yet: it was killed as hung, again and again.
    group = _group(tmp_path)
    try:
        starting, serving = group.workers
        for worker in group.workers:
            worker.process = _Process()  # type: ignore[assignment]
            worker.ever_ready = True
            worker.started_at = worker.beat_at = time.monotonic() - 2 * HUNG_S
        serving.serving = True
        group.kill_hung()
        assert not starting.process.killed and serving.process.killed  # type: ignore[union-attr]
    finally:
        os.close(group.alive_read)
        os.close(group.alive_write)


def test_a_stop_waits_for_the_drain_the_file_says_now(tmp_path: Path) -> None:
    # drain_s reloaded from 0 to 30: the workers drain 30 s, and were killed 5 s into it.
    group = _group(tmp_path, drain_s=0)
    try:
        assert group.drain_s() == 0
        group.config_path.write_text(group.config_path.read_text().replace("drain_s: 0", "drain_s: 30"))
        assert group.drain_s() == 30
    finally:
        os.close(group.alive_read)
        os.close(group.alive_write)
