"""The etcd discovery source (scorer/etcd.py) against a real etcd server: the endpoints under a prefix, watched;
bad entries skipped with a reason; the last membership kept while etcd is away; password auth."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

from inferlb.bench.etcdserver import ETCD, delete, etcd_server, put
from inferlb.procs import free_port
from inferlb.scorer.config import parse_config
from inferlb.scorer.etcd import EtcdSource, prefix_end
from inferlb.scorer.networks import Networks

from ..conftest import Published, needs_etcd, until

pytestmark = needs_etcd

PREFIX = "/inferlb/test/"
LOOPBACK = Networks.of(("127.0.0.0/8",))


def source(url: str, **etcd) -> EtcdSource:
    config = parse_config(
        {
            "pool": {
                "allowed_networks": ["127.0.0.0/8"],
                "discovery": {"etcd": {"urls": [url], "prefix": PREFIX, **etcd}},
            }
        }
    )
    assert config.discovery is not None
    return EtcdSource(config.discovery.etcd, config.allowed_networks, resolve=fake_resolve)


async def fake_resolve(host: str, port: int) -> list[str]:
    return {"gpu-a.internal": ["127.0.0.21", "127.0.0.22"]}.get(host, [])


@pytest.fixture
def etcd(tmp_path: Path):
    with etcd_server(tmp_path) as url:
        yield url


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


@pytest.mark.skipif(
    ETCD is None or shutil.which("etcdctl") is None, reason="needs etcd and etcdctl (Debian: etcd-server, etcd-client)"
)
async def test_with_auth_on_the_source_needs_its_password(etcd: str, tmp_path: Path) -> None:
    put(etcd, PREFIX + "a", {"address": "127.0.0.11:8000"})
    password = "etcd-test-password-0123456789"
    ctl = ["etcdctl", f"--endpoints={etcd}"]
    for args in (
        ["role", "add", "root"],
        ["user", "add", f"root:{password}"],
        ["user", "grant-role", "root", "root"],
        ["auth", "enable"],
    ):
        subprocess.run([*ctl, *args], check=True, capture_output=True, env={"ETCDCTL_API": "3", "PATH": "/usr/bin"})
    anonymous = source(etcd, timeout_s=0.5)
    seen = Published()
    task = asyncio.create_task(anonymous.run(seen))
    try:
        await until(lambda: anonymous.failures, "a refused read")
        assert not seen.lists and not anonymous.healthy
    finally:
        task.cancel()
    secret = tmp_path / "etcd-password"
    secret.write_text(password + "\n")
    authed = source(etcd, username="root", password={"token_file": str(secret)})
    task = asyncio.create_task(authed.run(seen))
    try:
        await until(lambda: seen.addresses == ["127.0.0.11:8000"], "the membership, with the password")
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
