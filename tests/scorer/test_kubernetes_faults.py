"""The Kubernetes discovery source (scorer/kubernetes.py) when the API server or the network misbehaves, against
the in-repo API server's faults (bench/kubeapi.py): a connection gone silent and a list never answered are
failures with a deadline; a refused, empty or expired watch backs off (and Retry-After is waited) instead of
asking again at once; each change of health is logged once. Also: the list comes in pages, a dual-stack
Service gives one endpoint per Pod, and the CA file makes an SSL context."""

from __future__ import annotations

import asyncio
import itertools
import logging
import subprocess
import warnings
from pathlib import Path

import pytest

from inferlb.bench.kubeapi import KubeApi, endpoint_slice, pod
from inferlb.procs import free_port
from inferlb.scorer.kubernetes import KubernetesSource, Pacing

from ..conftest import Published, until
from .test_kubernetes import SELECTOR, api, source

__all__ = ["api"]  # the API server fixture, shared with test_kubernetes.py

FAST = Pacing(retry_s=0.05, max_retry_s=1.0, watch_s=1)


def times(store: KubeApi, kind: str) -> list[float]:
    """When the API server received each list (or watch)."""
    return [t for t, query in store.requests if (query.get("watch") == "true") == (kind == "watch")]


def health_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "touch" in r.getMessage()]


async def test_a_watch_gone_silent_is_a_failure_and_the_source_lists_again(api, caplog) -> None:
    caplog.set_level(logging.INFO, logger="inferlb")
    api.apply(pod("a", "10.0.0.1", SELECTOR))
    api.hang_watches = True  # 200, then nothing: no event, no bookmark, no end
    seen = Published()
    kube = source(api.url, timeout_s=0.2, pacing=FAST)
    task = asyncio.create_task(kube.run(seen))
    try:
        await until(lambda: kube.healthy, "a watch")
        api.apply(pod("a", "10.0.0.1", SELECTOR, ready=False))  # what the silent watch does not say
        await until(lambda: not kube.healthy, "the silent watch found out", timeout=5)
        assert kube.problem == "watching pods: nothing from the API server for 1.2 s"
        api.hang_watches = False
        await until(lambda: seen.addresses == [] and kube.healthy, "the change, from a new list", timeout=5)
        assert api.lists >= 2
        _, query = next(r for r in api.requests if r[1].get("watch") == "true")
        assert query["allowWatchBookmarks"] == "true" and query["timeoutSeconds"] == "1"
        down = [line for line in health_lines(caplog) if "out of touch" in line]
        assert len(down) == 1, health_lines(caplog)
    finally:
        task.cancel()


async def test_a_list_never_answered_is_a_failure_and_is_asked_again(api) -> None:
    api.apply(pod("a", "10.0.0.1", SELECTOR))
    api.hang_lists = True
    seen = Published()
    kube = source(api.url, timeout_s=0.2, pacing=FAST)
    task = asyncio.create_task(kube.run(seen))
    try:
        await until(lambda: api.lists >= 2, "a second list after the first timed out", timeout=5)
        assert kube.problem == "listing pods: no answer within 0.2 s" and not seen.lists
        api.hang_lists = False
        await until(lambda: seen.addresses == ["10.0.0.1:8000"], "the membership once lists are answered", 5)
    finally:
        task.cancel()


@pytest.mark.parametrize("status", [pytest.param(403, id="forbidden"), pytest.param(500, id="server-error")])
async def test_a_watch_refused_after_a_good_list_backs_off_from_list_to_list(api, caplog, status: int) -> None:
    caplog.set_level(logging.INFO, logger="inferlb")
    api.apply(pod("a", "10.0.0.1", SELECTOR))
    api.refuse_watches = (status, None)  # RBAC with list but not watch; an API server failing
    seen = Published()
    kube = source(api.url, pacing=FAST)
    task = asyncio.create_task(kube.run(seen))
    try:
        await until(lambda: api.lists >= 5, "five lists", timeout=5)
        at = times(api, "list")
        gaps = [b - a for a, b in itertools.pairwise(at)]
        # Waits of 25-50, 50-100, 100-200, 200-400 ms: each gap at least the one before, the fourth over twice the
        # first whatever a request costs here (up to 100 ms). Without a backoff they stay equal.
        assert gaps[3] > 2 * gaps[0], gaps
        assert seen.addresses == ["10.0.0.1:8000"] and not kube.healthy
        assert kube.problem == f"watching pods: HTTP {status}: refused"
        assert health_lines(caplog) == [
            f"kubernetes discovery out of touch, the last membership stays in force: watching pods: HTTP {status}: "
            "refused"
        ]
    finally:
        task.cancel()


async def test_retry_after_is_waited_up_to_a_bound(api) -> None:
    api.apply(pod("a", "10.0.0.1", SELECTOR))
    api.refuse_watches = (429, "3600")  # API Priority and Fairness: too many requests, come back in an hour
    kube = source(api.url, pacing=Pacing(retry_s=0.01, max_retry_after_s=0.5, watch_s=1))
    task = asyncio.create_task(kube.run(Published()))
    try:
        await until(lambda: api.lists >= 2, "a second list", timeout=5)
        first, second = times(api, "list")[:2]
        assert 0.5 <= second - first < 2.0
    finally:
        task.cancel()


async def test_watches_that_end_at_once_back_off(api, caplog) -> None:
    caplog.set_level(logging.INFO, logger="inferlb")
    api.apply(pod("a", "10.0.0.1", SELECTOR))
    api.end_watches = True  # 200 and an empty body, at once (a server shutting down, a proxy cutting streams)
    kube = source(api.url, pacing=FAST)
    task = asyncio.create_task(kube.run(Published()))
    try:
        await until(lambda: api.watches >= 5, "five watches", timeout=5)
        at = times(api, "watch")
        assert at[4] - at[0] >= 0.025 + 0.05 + 0.1 + 0.2  # at least the shortest waits; at once: a few ms
        assert api.lists == 1 and kube.healthy  # the membership is followed, each watch from where it was
        ending = [r for r in caplog.records if "end at once" in r.getMessage()]
        assert len(ending) == 1
    finally:
        task.cancel()


async def test_a_watch_expired_right_after_every_list_backs_off(api, caplog) -> None:
    caplog.set_level(logging.INFO, logger="inferlb")
    api.apply(pod("a", "10.0.0.1", SELECTOR))
    api.refuse_watches = (410, None)
    kube = source(api.url, pacing=FAST)
    task = asyncio.create_task(kube.run(Published()))
    try:
        await until(lambda: api.lists >= 5, "five lists", timeout=5)
        at = times(api, "list")
        assert at[4] - at[0] >= 0.025 + 0.05 + 0.1  # the first relist at once, the next ones after a backoff
        assert not kube.healthy and "expired" in (kube.problem or "")
        assert len([line for line in health_lines(caplog) if "out of touch" in line]) == 1
    finally:
        task.cancel()


async def test_the_list_comes_in_pages_and_an_expired_continue_token_lists_again(api) -> None:
    for i in range(5):
        api.apply(pod(f"p{i}", f"10.0.0.{i + 1}", SELECTOR))
    seen = Published()
    task = asyncio.create_task(source(api.url, pacing=Pacing(page=2)).run(seen))
    try:
        await until(lambda: api.watches, "a watch")
        lists = [query for _, query in api.requests if "watch" not in query]
        assert [q["limit"] for q in lists] == ["2", "2", "2"] and "continue" not in lists[0]
        assert lists[1]["continue"] and lists[2]["continue"]
        assert len(seen.lists) == 1 and len(seen.addresses) == 5  # the whole list, published once
    finally:
        task.cancel()
    compactions = [api.compact]  # the history is gone between the first page and the second, once
    api.after_page = lambda: compactions and compactions.pop()()
    api.lists = 0
    seen = Published()
    task = asyncio.create_task(source(api.url, pacing=Pacing(page=3)).run(seen))
    try:
        await until(lambda: len(seen.addresses) == 5, "the membership from a second list")
        assert api.lists == 4  # one page, a 410 for the next, then both pages
    finally:
        task.cancel()


async def test_a_page_over_the_bound_is_refused_with_a_clear_error(api) -> None:
    api.apply(pod("a", "10.0.0.1", SELECTOR))
    kube = source(api.url, pacing=Pacing(max_page_bytes=100, retry_s=0.01))
    task = asyncio.create_task(kube.run(Published()))
    try:
        await until(lambda: kube.failures, "a failure", timeout=5)
        assert kube.problem is not None and "a page of 100 is over 100 bytes" in kube.problem
    finally:
        task.cancel()


def dual_stack(api: KubeApi, *, refs: bool = True) -> None:
    """Two Pods of a dual-stack Service: a slice of each family lists both (with or without their targetRefs)."""
    pods = ["a", "b"] if refs else [None, None]
    api.apply(endpoint_slice("vllm-v4", "vllm", [("10.0.0.1", True), ("10.0.0.2", True)], pods=pods))
    v6 = [("fd00::1", True), ("fd00::2", True)]
    api.apply(endpoint_slice("vllm-v6", "vllm", v6, address_type="IPv6", pods=pods))


V4 = ["10.0.0.1:8000", "10.0.0.2:8000"]
V6 = ["[fd00::1]:8000", "[fd00::2]:8000"]


@pytest.mark.parametrize(
    ("allowed", "refs", "expected"),
    [
        pytest.param(("10.0.0.0/8", "fd00::/8"), True, V4, id="both-families-allowed"),
        pytest.param(("10.0.0.0/8",), True, V4, id="ipv4-allowed"),
        pytest.param(("fd00::/8",), True, V6, id="ipv6-allowed"),
        pytest.param(("10.0.0.0/8", "fd00::/8"), False, V4, id="no-target-refs"),
        pytest.param(("fd00::/8",), False, V6, id="no-target-refs-ipv6-allowed"),
    ],
)
async def test_a_dual_stack_service_gives_one_endpoint_per_pod(
    api, allowed: tuple[str, ...], refs: bool, expected: list[str]
) -> None:
    dual_stack(api, refs=refs)
    seen = Published()
    kube = source(api.url, service="vllm", allowed=allowed)
    task = asyncio.create_task(kube.run(seen))
    try:
        await until(lambda: seen.lists, "the first membership")
        assert seen.addresses == expected and not kube.skipped
        if "fd00::/8" in allowed:
            api.delete("default", "vllm-v4", "EndpointSlice")  # single-stack IPv6 from now on
            await until(lambda: seen.addresses == V6, "the IPv6 endpoints of a single-stack Service")
    finally:
        task.cancel()


def make_ca(folder: Path) -> Path:
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=a cluster CA"],
        cwd=folder, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return folder / "ca.crt"


async def test_the_ca_file_makes_an_ssl_context_and_a_missing_one_is_a_failure(tmp_path: Path) -> None:
    url = f"https://127.0.0.1:{free_port()}"  # nothing listens: the source gets as far as connecting
    for ca_file, missing in ((make_ca(tmp_path), False), (tmp_path / "missing.crt", True)):
        kube = source(url, ca_file=str(ca_file), pacing=FAST)
        assert isinstance(kube, KubernetesSource)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # httpx deprecates verify=<path>
            task = asyncio.create_task(kube.run(Published()))
            try:
                await until(lambda: kube.failures or task.done(), "a failure")  # noqa: B023 - awaited here
                assert not task.done(), task.exception()
                assert ("cannot read the CA file" in (kube.problem or "")) == missing, kube.problem
            finally:
                task.cancel()
