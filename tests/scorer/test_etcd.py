"""The etcd discovery source (scorer/etcd.py) against a real etcd server: the endpoints under a prefix, watched;
bad entries skipped with a reason; the last membership kept while etcd is away; a member that hangs left for the
next; every failure reported and retried, never the end of the source; password auth."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from inferlb.bench.etcdserver import ETCD, delete, etcd_server, put
from inferlb.procs import free_port
from inferlb.scorer.config import EndpointConfig, parse_config
from inferlb.scorer.discovery import Resolver, resolve_host
from inferlb.scorer.etcd import EtcdSource, prefix_end
from inferlb.scorer.networks import Networks

from ..conftest import Published, needs_etcd, until

pytestmark = needs_etcd

PREFIX = "/inferlb/test/"
LOOPBACK = Networks.of(("127.0.0.0/8",))


def source(*urls: str, resolve: Resolver | None = None, **etcd) -> EtcdSource:
    config = parse_config(
        {
            "pool": {
                "allowed_networks": ["127.0.0.0/8"],
                "discovery": {"etcd": {"urls": list(urls), "prefix": PREFIX, **etcd}},
            }
        }
    )
    assert config.discovery is not None
    return EtcdSource(config.discovery.etcd, config.allowed_networks, resolve=resolve or fake_resolve)


async def fake_resolve(host: str, port: int) -> list[str]:
    return {"gpu-a.internal": ["127.0.0.21", "127.0.0.22"]}.get(host, [])


needs_etcdctl = pytest.mark.skipif(
    ETCD is None or shutil.which("etcdctl") is None, reason="needs etcd and etcdctl (Debian: etcd-server, etcd-client)"
)
PASSWORD = "etcd-test-password-0123456789"


@pytest.fixture
def etcd(tmp_path: Path):
    with etcd_server(tmp_path) as url:
        yield url


def etcdctl(url: str, *args: str, user: str | None = None) -> None:
    login = [f"--user=root:{PASSWORD}"] if user else []
    env = {"ETCDCTL_API": "3", "PATH": "/usr/bin"}
    subprocess.run(["etcdctl", f"--endpoints={url}", *login, *args], check=True, capture_output=True, env=env)


def auth_on(url: str) -> None:
    """etcd's auth turned on, with one user: root, whose password is `PASSWORD`."""
    for args in (["role", "add", "root"], ["user", "add", f"root:{PASSWORD}"], ["user", "grant-role", "root", "root"]):
        etcdctl(url, *args)
    etcdctl(url, "auth", "enable")


def etcd_pid(url: str) -> int:
    """The process of the etcd (one this test started) that serves ``url``."""
    flag = f"--listen-client-urls={url}".encode()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and flag in (proc / "cmdline").read_bytes().split(b"\0"):
                return int(proc.name)
        except OSError:
            continue  # gone meanwhile
    raise AssertionError(f"no etcd serves {url}")


def test_prefix_end_is_the_first_key_past_the_prefix() -> None:
    assert prefix_end(b"/a/") == b"/a0" and prefix_end(b"a\xff") == b"b" and prefix_end(b"\xff") == b"\0"


async def test_the_source_lists_the_prefix_and_follows_puts_and_deletes(etcd: str) -> None:
    put(etcd, PREFIX + "a", {"address": "127.0.0.11:8000", "models": ["m"], "labels": {"zone": "x"}})
    put(etcd, "/inferlb/other/b", {"address": "127.0.0.12:8000"})  # outside the prefix
    seen = Published()
    etcd_source = source(etcd)
    task = asyncio.create_task(etcd_source.run(seen))
    try:
        await until(lambda: seen.lists, "the first membership")
        assert seen.addresses == ["127.0.0.11:8000"] and etcd_source.healthy
        first = seen.lists[-1][0]
        assert first.models == frozenset({"m"}) and dict(first.labels) == {"zone": "x"}
        put(etcd, PREFIX + "b", {"address": "127.0.0.12:8000"})
        await until(lambda: seen.addresses == ["127.0.0.11:8000", "127.0.0.12:8000"], "a put", timeout=2)
        put(etcd, PREFIX + "a", {"address": "127.0.0.11:8000", "ready": False})  # not ready: out of the pool
        await until(lambda: seen.addresses == ["127.0.0.12:8000"], "a server that is not ready", timeout=2)
        delete(etcd, PREFIX + "b")
        await until(lambda: seen.addresses == [] and seen.lists, "a delete", timeout=2)
    finally:
        task.cancel()


async def test_a_bad_entry_is_skipped_with_its_reason_and_the_rest_still_serve(etcd: str) -> None:
    put(etcd, PREFIX + "1-good", {"address": "127.0.0.11:8000"})
    put(etcd, PREFIX + "2-garbage", b"{not json")
    put(etcd, PREFIX + "3-outside", {"address": "10.1.2.3:8000"})  # outside pool.allowed_networks
    put(etcd, PREFIX + "4-gpu", {"address": "127.0.0.13:8000", "gpu": {"url": "http://8.8.8.8/gpu"}})
    put(etcd, PREFIX + "5-dup", {"address": "127.0.0.11:8000"})
    put(etcd, PREFIX + "6-host", {"address": "gpu-a.internal:9000"})  # resolved by the picker: both addresses
    put(etcd, PREFIX + "7-unknown-host", {"address": "nowhere.internal:9000"})
    put(etcd, PREFIX + "8-extra", {"address": "127.0.0.14:8000", "weight": 3})
    seen = Published()
    etcd_source = source(etcd)
    task = asyncio.create_task(etcd_source.run(seen))
    try:
        await until(lambda: seen.lists, "the first membership")
    finally:
        task.cancel()
    assert seen.addresses == ["127.0.0.11:8000", "127.0.0.21:9000", "127.0.0.22:9000"]
    reasons = {s.key.removeprefix(PREFIX): s.reason for s in etcd_source.skipped}
    assert set(reasons) == {"2-garbage", "3-outside", "4-gpu", "5-dup", "7-unknown-host", "8-extra"}
    assert "not JSON" in reasons["2-garbage"]
    assert "outside pool.allowed_networks" in reasons["3-outside"]
    assert "config file only" in reasons["4-gpu"]
    assert "1-good" in reasons["5-dup"]
    assert "does not resolve" in reasons["7-unknown-host"]
    assert "weight" in reasons["8-extra"]


async def test_while_etcd_is_away_the_last_membership_stays_and_it_catches_up_when_back(tmp_path: Path) -> None:
    seen = Published()
    ports = (free_port(), free_port())
    with etcd_server(tmp_path, ports) as url:
        put(url, PREFIX + "a", {"address": "127.0.0.11:8000"})
        etcd_source = source(url, timeout_s=0.5)
        task = asyncio.create_task(etcd_source.run(seen))
        await until(lambda: seen.lists and etcd_source.healthy, "the first membership")
    try:
        # etcd stopped: the source says so and publishes nothing (the pool in force stays).
        await until(lambda: not etcd_source.healthy, "etcd out of touch")
        published = len(seen.lists)
        assert etcd_source.problem and url in etcd_source.problem
        assert len(seen.lists) == published and seen.addresses == ["127.0.0.11:8000"]
        with etcd_server(tmp_path, ports):  # back, with its data, and a change made as it returns
            put(url, PREFIX + "b", {"address": "127.0.0.12:8000"})
            await until(lambda: len(seen.addresses) == 2 and etcd_source.healthy, "catching up", timeout=20)
    finally:
        task.cancel()


@needs_etcdctl
async def test_with_auth_on_the_source_needs_its_password(etcd: str, tmp_path: Path) -> None:
    put(etcd, PREFIX + "a", {"address": "127.0.0.11:8000"})
    auth_on(etcd)
    anonymous = source(etcd, timeout_s=0.5)
    seen = Published()
    task = asyncio.create_task(anonymous.run(seen))
    try:
        await until(lambda: anonymous.failures, "a refused read")
        assert not seen.lists and not anonymous.healthy
    finally:
        task.cancel()
    secret = tmp_path / "etcd-password"
    secret.write_text(PASSWORD + "\n")
    authed = source(etcd, username="root", password={"token_file": str(secret)})
    task = asyncio.create_task(authed.run(seen))
    try:
        await until(lambda: seen.addresses == ["127.0.0.11:8000"], "the membership, with the password")
    finally:
        task.cancel()


async def test_a_key_with_a_port_out_of_range_costs_that_key_only(etcd: str) -> None:
    # getaddrinfo raised OverflowError for it: the source's task ended, still "healthy", and nothing later applied.
    put(etcd, PREFIX + "a", {"address": "127.0.0.11:8000"})
    seen = Published()
    etcd_source = source(etcd, resolve=resolve_host)
    task = asyncio.create_task(etcd_source.run(seen))
    try:
        await until(lambda: seen.addresses == ["127.0.0.11:8000"], "the first membership")
        put(etcd, PREFIX + "garbage", {"address": "gpu-7.internal:99999999999999999999"})
        await until(lambda: etcd_source.skipped, "the garbage key skipped", timeout=5)
        assert etcd_source.skipped[0].key == PREFIX + "garbage" and "1..65535" in etcd_source.skipped[0].reason
        put(etcd, PREFIX + "b", {"address": "127.0.0.12:8000"})
        await until(lambda: seen.addresses == ["127.0.0.11:8000", "127.0.0.12:8000"], "a later put", timeout=5)
        assert etcd_source.healthy and etcd_source.failures == 0 and not task.done()
    finally:
        task.cancel()


async def test_whatever_goes_wrong_the_source_reports_it_and_tries_again(
    etcd: str, caplog: pytest.LogCaptureFixture
) -> None:
    put(etcd, PREFIX + "a", {"address": "127.0.0.11:8000"})
    seen = Published()

    def publish(endpoints: tuple[EndpointConfig, ...]) -> None:
        if not seen.lists:
            seen.lists.append(())
            raise RuntimeError("a defect in whoever takes the membership")
        seen(endpoints)

    etcd_source = source(etcd)
    with caplog.at_level(logging.WARNING, logger="inferlb.scorer.discovery"):
        task = asyncio.create_task(etcd_source.run(publish))
        try:
            await until(lambda: seen.addresses == ["127.0.0.11:8000"], "the membership, at the next try")
            assert etcd_source.healthy and etcd_source.failures == 1 and not task.done()
        finally:
            task.cancel()
    [report] = [r for r in caplog.records if "out of touch" in r.getMessage()]
    assert "unexpected RuntimeError: a defect" in report.getMessage() and report.exc_info is not None


async def test_a_member_that_hangs_is_noticed_and_the_next_url_taken(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Two servers stand for two members of a cluster (the source can't tell): the one it watches hangs (SIGSTOP: a
    # frozen process or host, whose connections stay open). Its watch was followed for ever, and a source starting
    # with it first waited for its first read for ever.
    (tmp_path / "hung").mkdir()
    (tmp_path / "next").mkdir()
    with etcd_server(tmp_path / "hung") as hung, etcd_server(tmp_path / "next") as following:
        put(hung, PREFIX + "a", {"address": "127.0.0.11:8000"})
        for key, address in (("a", "127.0.0.11:8000"), ("b", "127.0.0.12:8000")):
            put(following, PREFIX + key, {"address": address})
        both = ["127.0.0.11:8000", "127.0.0.12:8000"]
        pid = etcd_pid(hung)
        watching, starting = source(hung, following, timeout_s=1), source(hung, following, timeout_s=1)
        seen, seen_starting = Published(), Published()
        tasks = [asyncio.create_task(watching.run(seen))]
        try:
            await until(lambda: seen.addresses == ["127.0.0.11:8000"] and watching.healthy, "the first membership")
            with caplog.at_level(logging.WARNING, logger="inferlb.scorer.discovery"):
                os.kill(pid, signal.SIGSTOP)
                await until(lambda: seen.addresses == both, "the next member's membership")
                assert watching.healthy and watching.failures >= 1
                tasks.append(asyncio.create_task(starting.run(seen_starting)))
                await until(lambda: seen_starting.addresses == both, "a fresh source's first membership")
                assert starting.healthy and starting.failures >= 1
        finally:
            for task in tasks:
                task.cancel()
            os.kill(pid, signal.SIGCONT)  # to stop
    reports = [r.getMessage() for r in caplog.records if "out of touch" in r.getMessage()]
    assert sum(f"{hung}: /v3/kv/range: no answer within 1 s" in r for r in reports) == 2  # one for each source


async def test_a_watch_that_stops_delivering_while_the_member_answers_is_noticed(
    etcd: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A watch's connection that dies silently (a NAT or a proxy forgetting it) while the member answers every
    # check: the member's checks passed, and the membership froze until the 15-minute silence limit.
    put(etcd, PREFIX + "a", {"address": "127.0.0.11:8000"})
    watching = source(etcd, timeout_s=0.5)
    real_follow = watching._follow
    follows = []

    async def silent_once(*args: object) -> None:
        follows.append(1)
        if len(follows) == 1:
            await asyncio.Event().wait()  # the first watch: connected, and never a message again
        await real_follow(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(watching, "_follow", silent_once)
    seen = Published()
    task = asyncio.create_task(watching.run(seen))
    try:
        await until(lambda: seen.addresses == ["127.0.0.11:8000"], "the first membership")
        put(etcd, PREFIX + "b", {"address": "127.0.0.12:8000"})
        await until(lambda: seen.addresses == ["127.0.0.11:8000", "127.0.0.12:8000"], "the put, read again")
        assert watching.failures == 1 and len(follows) == 2
        delete(etcd, PREFIX + "a")  # and a delete, on the watch that works
        await until(lambda: seen.addresses == ["127.0.0.12:8000"], "the delete, watched")
        assert watching.failures == 1
    finally:
        task.cancel()


@needs_etcdctl
async def test_a_password_file_that_cannot_be_read_is_reported_and_read_again(etcd: str, tmp_path: Path) -> None:
    # It was a ConfigError that ended the source's task: a rotation that replaced the file ended discovery.
    put(etcd, PREFIX + "a", {"address": "127.0.0.11:8000"})
    auth_on(etcd)
    secret = tmp_path / "etcd-password"  # not there (yet)
    seen = Published()
    etcd_source = source(etcd, username="root", password={"token_file": str(secret)})
    task = asyncio.create_task(etcd_source.run(seen))
    try:
        await until(lambda: "cannot read" in (etcd_source.problem or ""), "the problem reported")
        assert "token_file" in (etcd_source.problem or "") and not seen.lists and not task.done()
        secret.write_text(PASSWORD + "\n")
        await until(lambda: seen.addresses == ["127.0.0.11:8000"] and etcd_source.healthy, "the membership")
    finally:
        task.cancel()


@needs_etcdctl
async def test_a_token_etcd_no_longer_takes_is_replaced_and_the_watch_goes_on(etcd: str, tmp_path: Path) -> None:
    # While watching, the member is checked with a read that needs the token; etcd forgets its tokens when its
    # auth is turned off and on again (and refuses JWT ones past their TTL): a new one is asked for.
    put(etcd, PREFIX + "a", {"address": "127.0.0.11:8000"})
    auth_on(etcd)
    secret = tmp_path / "etcd-password"
    secret.write_text(PASSWORD + "\n")
    seen = Published()
    etcd_source = source(etcd, username="root", password={"token_file": str(secret)})
    task = asyncio.create_task(etcd_source.run(seen))
    try:
        await until(lambda: seen.addresses == ["127.0.0.11:8000"] and etcd_source.healthy, "the membership")
        first = etcd_source._token
        etcdctl(etcd, "auth", "disable", user="root")
        etcdctl(etcd, "auth", "enable", user="root")
        await until(lambda: etcd_source._token not in (None, first), "a new token")
        etcdctl(etcd, "put", PREFIX + "b", '{"address": "127.0.0.12:8000"}', user="root")
        await until(lambda: len(seen.addresses) == 2, "a put, on the same watch")
        # Now and then etcd itself cancels a watch opened before the toggle ("invalid auth token", about one run in
        # four here): the source then lists again with the new token, one failure counted, nothing lost.
        assert etcd_source.failures <= 1 and etcd_source.updates >= 2
        assert etcd_source.healthy
    finally:
        task.cancel()


def test_credentials_go_together_and_tls_options_need_https() -> None:
    with pytest.raises(Exception, match="password go together"):
        parse_config(
            {"pool": {"discovery": {"etcd": {"urls": ["http://127.0.0.1:2379"], "prefix": "/x/", "username": "u"}}}}
        )
    with pytest.raises(Exception, match="no URL is https"):
        parse_config(
            {"pool": {"discovery": {"etcd": {"urls": ["http://127.0.0.1:2379"], "prefix": "/x/", "ca_file": "/ca"}}}}
        )
    with pytest.raises(Exception, match="key prefix"):
        parse_config({"pool": {"discovery": {"etcd": {"urls": ["http://127.0.0.1:2379"], "prefix": "x"}}}})
    assert LOOPBACK
