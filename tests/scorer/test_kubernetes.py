"""The Kubernetes discovery source (scorer/kubernetes.py) against the in-repo API server (bench/kubeapi.py; no
Kubernetes API server can run here): the ready Pods of a selector, one endpoint per target port, watched; the
ready endpoints of a Service's EndpointSlices, watched; a compacted history makes it list again; the
service-account token is sent and checked."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from inferlb.bench.kubeapi import KubeApi, endpoint_slice, pod
from inferlb.procs import free_port
from inferlb.scorer.config import parse_config
from inferlb.scorer.kubernetes import KubernetesSource, Pacing
from inferlb.serving import serve

from ..conftest import Published, until

SELECTOR = {"app": "vllm"}


@pytest.fixture
async def api():
    store = KubeApi()
    address = f"127.0.0.1:{free_port()}"
    ready = asyncio.Event()
    task = asyncio.create_task(serve([(address, store.app)], ready=ready, handle_signals=False, what="kube api"))
    await asyncio.wait_for(ready.wait(), 10)
    store.url = f"http://{address}"
    yield store
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def source(
    url: str, *, allowed: tuple[str, ...] = ("10.0.0.0/8",), pacing: Pacing | None = None, **extra
) -> KubernetesSource:
    """A source of the Pods of `SELECTOR` (or of the Service ``service=``) at ``url``, no token, no CA."""
    kubernetes = {"namespace": "default", "selector": SELECTOR, "target_ports": [8000], "api_url": url}
    if "service" in extra:
        del kubernetes["selector"], kubernetes["target_ports"]
    kubernetes.update({"token_file": None, "ca_file": None, **extra})
    config = parse_config({"pool": {"allowed_networks": list(allowed), "discovery": {"kubernetes": kubernetes}}})
    assert config.discovery is not None and config.discovery.kubernetes is not None
    return KubernetesSource(config.discovery.kubernetes, config.allowed_networks, pacing=pacing)


async def test_ready_pods_of_the_selector_are_the_endpoints_and_changes_follow(api) -> None:
    api.apply(pod("a", "10.0.0.1", {"app": "vllm", "zone": "x"}, models="m1, m2"))
    api.apply(pod("other", "10.0.0.9", {"app": "web"}))  # another selector
    api.apply(pod("starting", "", {"app": "vllm"}, ready=False))  # no IP yet
    seen = Published()
    kube = source(api.url, target_ports=[8000, 8001])
    task = asyncio.create_task(kube.run(seen))
    try:
        await until(lambda: kube.healthy, "a watch")  # healthy once a watch is established
        assert seen.addresses == ["10.0.0.1:8000", "10.0.0.1:8001"]
        first = seen.lists[-1][0]
        assert first.models == frozenset({"m1", "m2"}) and dict(first.labels) == {"app": "vllm", "zone": "x"}
        api.apply(pod("starting", "10.0.0.2", {"app": "vllm"}))  # became ready
        await until(lambda: len(seen.addresses) == 4, "a pod that became ready", timeout=2)
        api.apply(pod("a", "10.0.0.1", {"app": "vllm"}, ready=False))  # failing its readiness probe
        await until(lambda: seen.addresses == ["10.0.0.2:8000", "10.0.0.2:8001"], "a pod not ready", timeout=2)
        api.delete("default", "starting")
        await until(lambda: seen.addresses == [] and seen.lists, "a deleted pod", timeout=2)
        api.apply(pod("outside", "192.168.1.5", {"app": "vllm"}))  # outside pool.allowed_networks
        await until(lambda: kube.skipped, "a pod outside the allowed networks", timeout=2)
        assert "outside pool.allowed_networks" in kube.skipped[0].reason and seen.addresses == []
    finally:
        task.cancel()


async def test_the_ready_endpoints_of_a_services_slices_are_the_endpoints_and_changes_follow(api) -> None:
    api.apply(endpoint_slice("vllm-a", "vllm", [("10.0.0.1", True), ("10.0.0.2", False)], (8000, 9090), zone="z1"))
    api.apply(endpoint_slice("web-a", "web", [("10.0.0.9", True)]))  # another Service's slice
    api.apply(pod("p", "10.0.0.8", {"kubernetes.io/service-name": "vllm"}))  # a Pod is not a slice
    seen = Published()
    kube = source(api.url, service="vllm", target_ports=[8000], models=["m1"])
    task = asyncio.create_task(kube.run(seen))
    try:
        await until(lambda: kube.healthy, "a watch")
        assert seen.addresses == ["10.0.0.1:8000"]  # 9090 is not a target port; .2 is not ready
        first = seen.lists[-1][0]
        assert first.models == frozenset({"m1"})
        assert dict(first.labels) == {"kubernetes.io/service-name": "vllm", "topology.kubernetes.io/zone": "z1"}
        # A second slice of the Service; the Pod at .3 moves in from it while the first still lists it, not ready.
        api.apply(endpoint_slice("vllm-b", "vllm", [("10.0.0.3", True)]))
        api.apply(endpoint_slice("vllm-a", "vllm", [("10.0.0.1", True), ("10.0.0.2", True), ("10.0.0.3", False)]))
        expected = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
        await until(lambda: seen.addresses == expected, "both slices, an address listed twice counted once", 2)
        assert not kube.skipped
        # Scaling down: the endpoint is terminating (still in the slice), then gone with its slice.
        api.apply(endpoint_slice("vllm-b", "vllm", [("10.0.0.3", True)], terminating=("10.0.0.3",)))
        await until(lambda: seen.addresses == expected[:2], "a terminating endpoint", timeout=2)
        api.delete("default", "vllm-a", "EndpointSlice")
        await until(lambda: seen.addresses == [], "a deleted slice", timeout=2)
    finally:
        task.cancel()


@pytest.mark.parametrize(
    ("conditions", "ready"),
    [
        # publishNotReadyAddresses: true: the controller writes ready for every Pod, serving is the probe's verdict
        pytest.param({"ready": True, "serving": False, "terminating": False}, False, id="published-not-serving"),
        pytest.param({"ready": True, "serving": True, "terminating": False}, True, id="serving"),
        pytest.param({"ready": False}, False, id="no-serving-not-ready"),  # an API server without serving
        pytest.param({}, True, id="no-conditions"),  # an absent condition means ready (the API's rule)
        pytest.param({"ready": True, "serving": True, "terminating": True}, False, id="terminating"),
    ],
)
async def test_a_slice_endpoint_is_ready_when_it_is_serving_and_not_terminating(
    api, conditions: dict[str, bool], ready: bool
) -> None:
    published = endpoint_slice("vllm-a", "vllm", [("10.0.0.1", True), ("10.0.0.2", True)])
    published["endpoints"][1]["conditions"] = conditions
    api.apply(published)
    seen = Published()
    task = asyncio.create_task(source(api.url, service="vllm").run(seen))
    try:
        await until(lambda: seen.lists, "the first membership")
        assert seen.addresses == (["10.0.0.1:8000", "10.0.0.2:8000"] if ready else ["10.0.0.1:8000"])
    finally:
        task.cancel()


async def test_a_services_slices_give_every_tcp_port_without_target_ports(api) -> None:
    api.apply(endpoint_slice("vllm-a", "vllm", [("10.0.0.1", True)], (8000, 8001)))
    seen = Published()
    task = asyncio.create_task(source(api.url, service="vllm").run(seen))
    try:
        await until(lambda: seen.addresses == ["10.0.0.1:8000", "10.0.0.1:8001"], "every port of the slice")
        assert seen.lists[-1][0].models is None  # no models configured: any model
    finally:
        task.cancel()


async def test_a_burst_of_changes_is_published_as_a_few_states_and_a_lone_one_at_once(api) -> None:
    for i in range(200):
        api.apply(pod(f"p{i:03d}", f"10.0.1.{i + 1}", SELECTOR))
    seen = Published()
    kube = source(api.url)
    task = asyncio.create_task(kube.run(seen))
    try:
        await until(lambda: kube.healthy and len(seen.addresses) == 200, "the listed pods")
        listed = len(seen.lists)
        for i in range(200):  # a rollout: every Pod not ready, one event each
            api.apply(pod(f"p{i:03d}", f"10.0.1.{i + 1}", SELECTOR, ready=False))
        await until(lambda: seen.addresses == [], "every pod out of the pool", timeout=5)
        assert len(seen.lists) - listed < 20  # one per event: 200
        burst = len(seen.lists)
        api.apply(pod("p000", "10.0.1.1", SELECTOR))  # after a quiet spell: published on its own
        await until(lambda: seen.addresses == ["10.0.1.1:8000"], "a lone change", timeout=2)
        assert len(seen.lists) == burst + 1
    finally:
        task.cancel()


async def test_a_pod_relabelled_out_of_the_selector_leaves_the_pool_and_one_relabelled_in_joins(api) -> None:
    api.apply(pod("a", "10.0.0.1", SELECTOR))
    api.apply(pod("b", "10.0.0.2", {"app": "staging"}))
    seen = Published()
    kube = source(api.url)
    task = asyncio.create_task(kube.run(seen))
    try:
        await until(lambda: kube.healthy and seen.addresses == ["10.0.0.1:8000"], "the pool of the selector")
        api.apply(pod("a", "10.0.0.1", {"app": "quarantined"}))  # out of the pool by its labels: a DELETED event
        await until(lambda: seen.addresses == [], "a pod relabelled out", timeout=2)
        api.apply(pod("b", "10.0.0.2", SELECTOR))  # into it: an ADDED event
        await until(lambda: seen.addresses == ["10.0.0.2:8000"], "a pod relabelled in", timeout=2)
        assert api.lists == 1  # from the watch, not from a list again
    finally:
        task.cancel()


async def test_a_compacted_history_makes_the_source_list_again(api) -> None:
    api.apply(pod("a", "10.0.0.1", SELECTOR))
    seen = Published()
    kube = source(api.url)
    task = asyncio.create_task(kube.run(seen))
    try:
        await until(lambda: seen.addresses == ["10.0.0.1:8000"] and api.watches, "watching")
        api.compact()  # the open watch ends with 410; the source lists again and watches from there
        await until(lambda: api.lists == 2, "a second list")
        api.apply(pod("b", "10.0.0.2", SELECTOR))
        await until(lambda: seen.addresses == ["10.0.0.1:8000", "10.0.0.2:8000"], "a change after the relist", 2)
        assert kube.healthy
    finally:
        task.cancel()


async def test_the_service_account_token_is_sent_and_a_wrong_one_is_refused(api, tmp_path: Path) -> None:
    api.token = "the-right-service-account-token"
    api.apply(pod("a", "10.0.0.1", SELECTOR))
    wrong, right = tmp_path / "wrong", tmp_path / "right"
    wrong.write_text("not-the-token\n")
    right.write_text(api.token + "\n")
    refused = source(api.url, token_file=str(wrong))
    seen = Published()
    task = asyncio.create_task(refused.run(seen))
    try:
        await until(lambda: refused.failures, "a refused list")
        assert not seen.lists and "401" in (refused.problem or "")
    finally:
        task.cancel()
    accepted = source(api.url, token_file=str(right))
    task = asyncio.create_task(accepted.run(seen))
    try:
        await until(lambda: seen.addresses == ["10.0.0.1:8000"], "the membership with the token")
    finally:
        task.cancel()


def test_the_config_names_one_source_and_a_valid_selector() -> None:
    with pytest.raises(Exception, match="exactly one source"):
        parse_config({"pool": {"discovery": {}}})
    bad = {"namespace": "default", "selector": {}, "target_ports": [8000]}
    with pytest.raises(Exception, match="non-empty mapping of labels"):
        parse_config({"pool": {"discovery": {"kubernetes": bad}}})
    with pytest.raises(Exception, match="label value"):
        parse_config({"pool": {"discovery": {"kubernetes": {**bad, "selector": {"app": "a b"}}}}})
    with pytest.raises(Exception, match=r"exactly one of selector \(Pods\) and service"):
        parse_config({"pool": {"discovery": {"kubernetes": {**bad, "selector": {"app": "a"}, "service": "vllm"}}}})
    with pytest.raises(Exception, match="exactly one of selector"):
        parse_config({"pool": {"discovery": {"kubernetes": {"namespace": "default"}}}})
    with pytest.raises(Exception, match="target_ports is needed with a selector"):
        parse_config({"pool": {"discovery": {"kubernetes": {"namespace": "default", "selector": {"app": "a"}}}}})
    with pytest.raises(Exception, match="Service name"):
        parse_config({"pool": {"discovery": {"kubernetes": {"namespace": "default", "service": "Not_A_Name"}}}})


@pytest.mark.parametrize(
    ("api_url", "token_file", "refused"),
    [
        pytest.param("http://10.0.0.5:8001", "/var/run/secrets/token", True, id="http-beyond-loopback"),
        pytest.param("http://api.example:8001", "/var/run/secrets/token", True, id="http-to-a-name"),
        pytest.param("http://10.0.0.5:8001", None, False, id="http-without-a-token"),
        pytest.param("http://127.0.0.1:8001", "/var/run/secrets/token", False, id="http-on-loopback"),
        pytest.param("https://10.0.0.5:6443", "/var/run/secrets/token", False, id="https"),
    ],
)
def test_the_token_never_goes_out_over_plain_http(api_url: str, token_file: str | None, refused: bool) -> None:
    kubernetes = {"namespace": "default", "selector": SELECTOR, "target_ports": [8000], "api_url": api_url}
    config = {"pool": {"discovery": {"kubernetes": {**kubernetes, "token_file": token_file}}}}
    if refused:
        with pytest.raises(Exception, match=r"api_url.*plain http://.*token_file.*https://.*null.*loopback"):
            parse_config(config)
    else:
        parse_config(config)
