"""The Kubernetes discovery source (scorer/kubernetes.py) when the API server or the network misbehaves, against the
in-repo API server's faults (bench/kubeapi.py): a watch gone silent or kept open past its end and a list never
answered or trickled are failures with a deadline, and so are pages that never end; a refused, empty or expired
watch backs off (and Retry-After is waited, in seconds or as a date), a bookmark before it notwithstanding, instead
of asking again at once; each change of health is logged once; a malformed object is skipped, and a defect is
reported and retried. Also: the list comes in pages, a dual-stack Service gives one endpoint per Pod, the CA file
makes an SSL context, and an https API server (however the scheme is spelt) whose certificate it does not sign
never sees the token."""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import logging
import ssl
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from inferlb.bench.kubeapi import KubeApi, endpoint_slice, pod
from inferlb.procs import free_port
from inferlb.scorer.kubernetes import KubernetesSource, Pacing, _retry_after

from ..conftest import Published, self_signed, until
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
        assert kube.problem == "watching pods: not ended within 1.2 s (the API server was asked to end it after 1 s)"
        api.hang_watches = False
        await until(lambda: seen.addresses == [] and kube.healthy, "the change, from a new list", timeout=5)
        assert api.lists >= 2
        _, query = next(r for r in api.requests if r[1].get("watch") == "true")
        assert query["allowWatchBookmarks"] == "true" and query["timeoutSeconds"] == "1"
        down = [line for line in health_lines(caplog) if "out of touch" in line]
        assert len(down) == 1, health_lines(caplog)
    finally:
        task.cancel()


async def test_a_watch_kept_open_by_blank_lines_ends_at_its_deadline_and_the_source_lists_again(api) -> None:
    api.apply(pod("a", "10.0.0.1", SELECTOR))
    api.trickle_watches = 0.05  # a blank line every 50 ms, and never an end: each read is well within its timeout
    seen = Published()
    kube = source(api.url, timeout_s=0.2, pacing=FAST)
    task = asyncio.create_task(kube.run(seen))
    try:
        await until(lambda: kube.healthy, "a watch")
        api.apply(pod("a", "10.0.0.1", SELECTOR, ready=False))  # what the watch does not say
        await until(lambda: not kube.healthy, "the watch past its deadline", timeout=5)
        assert kube.problem == "watching pods: not ended within 1.2 s (the API server was asked to end it after 1 s)"
        api.trickle_watches = 0
        await until(lambda: seen.addresses == [] and kube.healthy, "the change, from a new list", timeout=5)
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


def http_date(from_now_s: float) -> str:
    return email.utils.format_datetime(datetime.now(UTC) + timedelta(seconds=from_now_s), usegmt=True)


@pytest.mark.parametrize("form", [pytest.param("seconds", id="seconds"), pytest.param("date", id="http-date")])
async def test_retry_after_is_waited_up_to_a_bound(api, form: str) -> None:
    api.apply(pod("a", "10.0.0.1", SELECTOR))
    # API Priority and Fairness: too many requests, come back in an hour (a proxy in front may say it as a date).
    api.refuse_watches = (429, "3600" if form == "seconds" else http_date(3600))
    kube = source(api.url, pacing=Pacing(retry_s=0.01, max_retry_after_s=0.5, watch_s=1))
    task = asyncio.create_task(kube.run(Published()))
    try:
        await until(lambda: api.lists >= 2, "a second list", timeout=5)
        first, second = times(api, "list")[:2]
        assert 0.5 <= second - first < 2.0
    finally:
        task.cancel()


NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("120", 120.0, id="seconds"),
        pytest.param("0.5", 0.5, id="a-fraction"),
        pytest.param("Sun, 01 Mar 2026 12:02:00 GMT", 120.0, id="a-date-to-come"),
        pytest.param("Sun, 01 Mar 2026 14:02:00 +0200", 120.0, id="a-date-in-another-zone"),
        pytest.param("Sun, 01 Mar 2026 11:00:00 GMT", 0.0, id="a-date-past"),
        pytest.param(None, None, id="absent"),
        pytest.param("-5", None, id="negative"),
        pytest.param("nan", None, id="not-a-number"),
        pytest.param("soon", None, id="neither"),
    ],
)
def test_retry_after_is_read_in_seconds_or_as_an_http_date(value: str | None, expected: float | None) -> None:
    headers = httpx.Headers({} if value is None else {"retry-after": value})
    assert _retry_after(headers, NOW) == expected


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


@pytest.mark.parametrize("then", [pytest.param("expire", id="then-410"), pytest.param("end", id="then-the-end")])
async def test_a_bookmark_does_not_reset_the_backoff_of_watches_that_fail(api, then: str) -> None:
    api.apply(pod("a", "10.0.0.1", SELECTOR))
    api.bookmark_watches = then  # a bookmark at once, then a 410 ERROR event or the end of the stream, every time
    kube = source(api.url, pacing=FAST)
    task = asyncio.create_task(kube.run(Published()))
    try:
        # Expired: the first relist at once, then waits of 25-50, 50-100, 100-200, 200-400 ms between lists.
        # Ended: the same waits between watches, from the one list. Reset by each bookmark: hundreds a second.
        kind, count = ("list", 6) if then == "expire" else ("watch", 5)
        await until(lambda: len(times(api, kind)) >= count, f"{count} requests", timeout=5)
        at = times(api, kind)
        assert at[count - 1] - at[0] >= 0.025 + 0.05 + 0.1 + 0.2, [b - a for a, b in itertools.pairwise(at)]
        if then == "end":
            assert api.lists == 1
    finally:
        task.cancel()


async def test_a_list_trickled_past_its_deadline_is_a_failure(api) -> None:
    api.apply(pod("a", "10.0.0.1", SELECTOR))
    api.trickle_lists = 0.05  # a byte every 50 ms: each read is well within timeout_s, the page some 15 s long
    seen = Published()
    kube = source(api.url, timeout_s=0.2, pacing=FAST)
    task = asyncio.create_task(kube.run(seen))
    try:
        await until(lambda: kube.failures, "the list given up", timeout=3)
        assert kube.problem == "listing pods: no answer within 0.2 s" and not seen.lists
        api.trickle_lists = 0
        await until(lambda: seen.addresses == ["10.0.0.1:8000"], "the membership once lists come whole", 5)
    finally:
        task.cancel()


async def test_a_list_whose_pages_never_end_is_a_failure_that_backs_off(api) -> None:
    for i in range(5):
        api.apply(pod(f"p{i}", f"10.0.0.{i + 1}", SELECTOR))
    api.repeat_continue = True  # the second page names itself as the next one, forever
    seen = Published()
    kube = source(api.url, pacing=Pacing(retry_s=0.05, max_retry_s=1.0, watch_s=1, page=2))
    task = asyncio.create_task(kube.run(seen))
    try:
        await until(lambda: api.lists >= 8, "four lists of two pages", timeout=5)
        assert kube.problem == "listing pods: the API server gave a continue token twice" and not seen.lists
        starts = times(api, "list")[0:8:2]
        assert starts[3] - starts[0] >= 0.025 + 0.05 + 0.1, starts  # backing off, not at once
        api.repeat_continue = False
        await until(lambda: len(seen.addresses) == 5, "the membership once the pages end", timeout=5)
    finally:
        task.cancel()


async def test_a_list_of_more_pages_than_the_bound_is_a_failure(api) -> None:
    for i in range(4):
        api.apply(pod(f"p{i}", f"10.0.0.{i + 1}", SELECTOR))
    seen = Published()
    kube = source(api.url, pacing=Pacing(retry_s=0.01, max_retry_s=0.05, watch_s=1, page=1, max_pages=3))
    task = asyncio.create_task(kube.run(seen))
    try:
        await until(lambda: kube.failures, "a failure", timeout=5)
        assert kube.problem == "listing pods: more than 3 pages" and not seen.lists
        api.delete("default", "p3")  # three pages: as many as allowed
        await until(lambda: len(seen.addresses) == 3, "the membership in three pages", timeout=5)
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


@pytest.mark.parametrize(
    ("primary", "allowed", "expected"),
    [
        pytest.param("10.0.0.1", ("10.0.0.0/8", "fd00::/8"), "10.0.0.1:8000", id="both-families-allowed"),
        pytest.param("fd00::1", ("10.0.0.0/8", "fd00::/8"), "10.0.0.1:8000", id="ipv6-primary-both-allowed"),
        pytest.param("10.0.0.1", ("fd00::/8",), "[fd00::1]:8000", id="ipv4-primary-ipv6-allowed"),
        pytest.param("fd00::1", ("10.0.0.0/8",), "10.0.0.1:8000", id="ipv6-primary-ipv4-allowed"),
    ],
)
async def test_a_dual_stack_pod_gives_its_address_in_the_allowed_family(
    api, primary: str, allowed: tuple[str, ...], expected: str
) -> None:
    other = "fd00::1" if primary == "10.0.0.1" else "10.0.0.1"
    api.apply(pod("a", primary, SELECTOR, also=(other,)))
    api.apply(pod("b", "10.0.0.2", SELECTOR))  # single-stack: its podIP, whatever the family
    seen = Published()
    kube = source(api.url, allowed=allowed)
    task = asyncio.create_task(kube.run(seen))
    try:
        await until(lambda: seen.lists, "the first membership")
        assert seen.addresses[0] == expected
    finally:
        task.cancel()


def broken_pod(name: str, status: object) -> dict[str, object]:
    """A Pod of the selector whose status is ``status`` (what no kubelet writes)."""
    return {"kind": "Pod", "metadata": {"name": name, "labels": dict(SELECTOR)}, "status": status}


def broken_slice(name: str, endpoints: object) -> dict[str, object]:
    """A slice of the Service vllm whose endpoints are ``endpoints``."""
    return {**endpoint_slice(name, "vllm", []), "endpoints": endpoints}


@pytest.mark.parametrize(
    ("good", "bad", "reason"),
    [
        pytest.param("pod", lambda n: broken_pod(n, "Running"), "status is not an object", id="pod-status"),
        pytest.param(
            "pod", lambda n: broken_pod(n, {"conditions": ["Ready"]}), "status.conditions[0]", id="pod-condition"
        ),
        pytest.param(
            "pod", lambda n: broken_pod(n, {"podIP": 5}), "status.podIP is not a string", id="pod-ip-a-number"
        ),
        pytest.param("slice", lambda n: broken_slice(n, ["x"]), "endpoints[0] is not an object", id="slice-endpoint"),
        pytest.param("slice", lambda n: broken_slice(n, {}), "endpoints is not a list", id="slice-endpoints"),
        pytest.param(
            "slice",
            lambda n: broken_slice(n, [{"addresses": ["10.0.0.5"], "conditions": ["ready"]}]),
            "endpoints[0].conditions is not an object",
            id="slice-conditions",
        ),
    ],
)
async def test_a_malformed_object_is_skipped_and_the_others_stand(api, good: str, bad, reason: str) -> None:
    """A malformed object, listed or watched, is skipped with its reason; the rest of the pool and the watch go on."""
    slices = good == "slice"
    api.apply(endpoint_slice("vllm-a", "vllm", [("10.0.0.1", True)]) if slices else pod("a", "10.0.0.1", SELECTOR))
    api.apply(bad("listed"))
    seen = Published()
    kube = source(api.url, pacing=FAST, **({"service": "vllm"} if slices else {}))
    task = asyncio.create_task(kube.run(seen))
    try:
        await until(lambda: kube.healthy and seen.lists, "a watch after the list")
        assert seen.addresses == ["10.0.0.1:8000"]
        assert [s.key for s in kube.skipped] == ["default/listed"] and reason in kube.skipped[0].reason
        api.apply(bad("watched"))
        api.apply(endpoint_slice("vllm-b", "vllm", [("10.0.0.2", True)]) if slices else pod("b", "10.0.0.2", SELECTOR))
        await until(lambda: len(seen.addresses) == 2, "a change after the malformed object", timeout=5)
        assert sorted(s.key for s in kube.skipped) == ["default/listed", "default/watched"]
        assert kube.healthy and not kube.failures and not task.done()
    finally:
        task.cancel()


async def test_a_defect_is_reported_and_the_source_lists_again(api, caplog) -> None:
    caplog.set_level(logging.INFO, logger="inferlb")
    api.apply(pod("a", "10.0.0.1", SELECTOR))
    seen = Published()
    calls: list[object] = []

    def publish(endpoints) -> None:  # the picker's, with a defect that strikes once
        calls.append(endpoints)
        if len(calls) == 1:
            raise RuntimeError("a defect")
        seen(endpoints)

    kube = source(api.url, pacing=FAST)
    task = asyncio.create_task(kube.run(publish))
    try:
        await until(lambda: kube.failures or task.done(), "a failure", timeout=5)
        assert not task.done(), task.exception()
        assert kube.problem == "unexpected RuntimeError: a defect" and not kube.healthy
        await until(lambda: seen.addresses == ["10.0.0.1:8000"] and kube.healthy, "a second list", timeout=5)
        down = [r for r in caplog.records if "out of touch" in r.getMessage()]
        assert len(down) == 1 and down[0].exc_info is not None  # logged once, with the traceback
    finally:
        task.cancel()


async def test_the_ca_file_makes_an_ssl_context_and_a_missing_one_is_a_failure(tmp_path: Path) -> None:
    url = f"https://127.0.0.1:{free_port()}"  # nothing listens: the source gets as far as connecting
    for ca_file, missing in ((self_signed(tmp_path), False), (tmp_path / "missing.crt", True)):
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


@pytest.mark.parametrize("trusted", [pytest.param(False, id="untrusted"), pytest.param(True, id="trusted")])
async def test_an_https_api_url_in_capitals_verifies_the_certificate_before_sending_the_token(
    tmp_path: Path, trusted: bool
) -> None:
    (tmp_path / "server").mkdir()
    (tmp_path / "cluster").mkdir()
    certificate = self_signed(tmp_path / "server")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certificate, tmp_path / "server" / "ca.key")
    heads: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=context)
    token = tmp_path / "token"
    token.write_text("the-service-account-token\n")
    port = server.sockets[0].getsockname()[1]
    ca_file = certificate if trusted else self_signed(tmp_path / "cluster")  # the cluster's CA did not sign it
    kube = source(f"HTTPS://127.0.0.1:{port}", token_file=str(token), ca_file=str(ca_file), pacing=FAST)
    task = asyncio.create_task(kube.run(Published()))
    try:
        await until(lambda: kube.failures, "a failure", timeout=5)
        if trusted:  # the same server, its certificate trusted: it is reached, and sees the token
            assert kube.problem == "listing pods: HTTP 401: " and b"the-service-account-token" in heads[0]
        else:
            assert "CERTIFICATE_VERIFY_FAILED" in (kube.problem or ""), kube.problem
            assert heads == []
    finally:
        task.cancel()
        server.close()
