"""Trust boundaries and faults through a real Envoy: the admin API cannot be used to reroute traffic, a body at
the size limit is decided by the picker (never bypasses it), a stalled request gets a 408, and a picker that is
killed or stopped cuts no request it has routed, with fail-open or fail-closed."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from inferlb.envoyconf import EnvoyOptions
from inferlb.procs import SERVER_HEADER, grpc_serving
from inferlb.stack import LocalStack, StackOptions

from ..conftest import poll
from .conftest import Canary, log_entry

pytestmark = pytest.mark.envoy

MODEL = "m"
COMPLETION = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4}
# Emulated H100s in real time: 400 streamed tokens take ~2.5 s.
LONG = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 400, "stream": True}
OPTIONS = StackOptions(
    backends=2,
    models=(MODEL,),
    envoy=EnvoyOptions(request_timeout_ms=1500, request_headers_timeout_ms=1200),
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with LocalStack(OPTIONS, tmp_path_factory.mktemp("faults")) as running:
        yield running


def test_the_admin_api_refuses_to_reroute_traffic(stack: LocalStack, canary: Canary) -> None:
    document = yaml.safe_load(stack.config_path.read_text())
    hijack = yaml.safe_dump({**document, "pool": {"endpoints": [{"address": canary.address, "models": [MODEL]}]}})
    url = f"{stack.picker_admin_url}/config"
    attempts = [
        # What a web page can make a browser send to 127.0.0.1 (DNS rebinding, or a simple cross-site post).
        ({"host": "attacker.example", "content-type": "text/plain"}, 421),
        ({"content-type": "text/plain", "origin": "http://attacker.example"}, 403),
        ({"content-type": "text/plain"}, 401),
        ({"content-type": "application/yaml", "authorization": "Bearer not-the-token-at-all"}, 401),
        ({**stack.admin_headers, "content-type": "text/plain"}, 415),
        ({**stack.admin_headers, "content-type": "application/x-www-form-urlencoded"}, 415),
    ]
    for headers, status in attempts:
        response = httpx.post(url, content=hijack, headers=headers, timeout=5)
        assert response.status_code == status, (headers, response.text)
        assert not [h for h in response.headers if h.startswith("access-control-")]
    assert httpx.get(url, timeout=5).status_code == 401  # the config is not shown without the token
    before = canary.connections
    with httpx.Client(base_url=stack.gateway_url, timeout=10) as client:
        for _ in range(20):
            response = client.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200 and response.headers[SERVER_HEADER] in stack.endpoints
    assert canary.connections == before
    shown = httpx.get(url, headers=stack.admin_headers, timeout=5).json()
    assert shown["reloads"] == 0 and shown["admin_auth"]["token"].startswith("file ")
    assert stack.admin_token not in str(shown)


def _body(size: int) -> bytes:
    head = b'{"model": "m", "max_tokens": 1, "prompt": "'
    return head + b"x" * (size - len(head) - 2) + b'"}'


def _decided_by_picker(stack: LocalStack, response: httpx.Response) -> None:
    entry = log_entry(stack, response.headers["x-request-id"])
    assert entry["cluster"] == "inferlb_picked" and entry["picked"] in stack.endpoints, entry


def test_a_body_at_the_limit_is_decided_by_the_picker_and_one_byte_more_is_413(stack: LocalStack) -> None:
    limit = stack.config.max_body_bytes
    with httpx.Client(base_url=stack.gateway_url, timeout=30) as client:
        at_limit = client.post("/v1/completions", content=_body(limit), headers={"content-type": "application/json"})
        _decided_by_picker(stack, at_limit)  # the server may refuse so long a prompt; the picker routed it
        over = client.post("/v1/completions", content=_body(limit + 1), headers={"content-type": "application/json"})
        assert over.status_code == 413 and over.json()["error"]["type"] == "payload_too_large"


def test_a_raised_limit_is_honoured_by_the_picker(tmp_path: Path) -> None:
    limit = 6 << 20
    options = replace(OPTIONS, picker_config={"max_body_bytes": limit})
    with LocalStack(options, tmp_path) as stack, httpx.Client(base_url=stack.gateway_url, timeout=30) as client:
        for size in (5_000_000, limit):
            response = client.post("/v1/completions", content=_body(size), headers={"content-type": "application/json"})
            _decided_by_picker(stack, response)
        over = client.post("/v1/completions", content=_body(limit + 1), headers={"content-type": "application/json"})
        assert over.status_code == 413


def _raw_request(address: str, data: bytes, timeout: float = 10.0) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks) and b'"code"' in b"".join(chunks):
                return b"".join(chunks)


def test_a_stalled_body_is_answered_408_and_a_long_stream_still_works(stack: LocalStack) -> None:
    body = b'{"model": "m", "prompt": "hi", "max_tokens": 3}'
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body) + 20}\r\n\r\n"
    ).encode()
    answer = _raw_request(stack.gateway_address, head + body[:20])  # then nothing more: the client stalled
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 408 " in status_line, answer[:300]
    assert b'"type":"request_timeout"' in rest.replace(b" ", b"")
    stalled_headers = _raw_request(stack.gateway_address, b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\n")
    assert stalled_headers == b"" or b" 408 " in stalled_headers.partition(b"\r\n")[0]
    # The bound is on the request's arrival, not on the answer: a stream longer than it runs to the end.
    with (
        httpx.Client(base_url=stack.gateway_url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=LONG) as streaming,
    ):
        events = [line for line in streaming.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == LONG["max_tokens"] + 1


class Streams:
    """Long streamed requests, each read to its end on a thread of its own; `wait` says how each ended."""

    def __init__(self, stack: LocalStack, count: int) -> None:
        self.results: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._started = threading.Semaphore(0)
        self._threads = [threading.Thread(target=self._one, args=(stack.gateway_url,)) for _ in range(count)]
        for thread in self._threads:
            thread.start()
        for _ in self._threads:
            assert self._started.acquire(timeout=15), "a stream did not start"

    def _one(self, url: str) -> None:
        result: dict[str, Any] = {"events": 0, "done": False, "status": None, "error": None}
        started = False
        try:
            with (
                httpx.Client(base_url=url, timeout=30) as client,
                client.stream("POST", "/v1/completions", json=LONG) as response,
            ):
                result["status"] = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        result["events"] += 1
                        result["done"] = line == "data: [DONE]"
                        if not started:
                            started = True
                            self._started.release()  # routed and streaming
        except httpx.HTTPError as exc:
            result["error"] = repr(exc)
        finally:
            if not started:
                self._started.release()
            with self._lock:
                self.results.append(result)

    def wait(self) -> list[dict[str, Any]]:
        for thread in self._threads:
            thread.join(60)
        return self.results


@pytest.mark.parametrize("fail_open", [pytest.param(True, id="fail-open"), pytest.param(False, id="fail-closed")])
def test_a_killed_picker_cuts_no_routed_request(tmp_path: Path, fail_open: bool) -> None:
    options = replace(OPTIONS, envoy=replace(OPTIONS.envoy, fail_open=fail_open))
    with LocalStack(options, tmp_path) as stack:
        streams = Streams(stack, 6)
        assert stack.picker is not None
        stack.picker.kill()
        with httpx.Client(base_url=stack.gateway_url, timeout=10) as client:
            during = client.post("/v1/completions", json=COMPLETION)
            assert during.status_code == (200 if fail_open else 500)
        results = streams.wait()
        assert all(r["done"] and r["events"] == LONG["max_tokens"] + 1 for r in results), results
        stack.start_picker()
        with httpx.Client(base_url=stack.gateway_url, timeout=10) as client:
            response = client.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200
            _decided_by_picker(stack, response)


def test_when_two_of_three_pickers_hang_the_third_takes_every_stream(tmp_path: Path) -> None:
    # A picker that hangs (stopped here; a stuck loop alike) still accepts connections, so without a health check
    # Envoy would go on giving it its share of the streams, each one a timeout. Fail-closed, so that such a stream
    # shows (504). The health check marks them down within about a second; from then on the third decides them
    # all (with one of three healthy, Envoy's default panic routing would still send two thirds to the others).
    envoy = replace(OPTIONS.envoy, fail_open=False, message_timeout_ms=700)
    with LocalStack(replace(OPTIONS, pickers=3, envoy=envoy), tmp_path) as stack:
        assert stack.picker is not None
        hung = [stack.picker, stack.replicas[0]]
        for picker in hung:
            picker.pause()
        try:
            with httpx.Client(base_url=stack.gateway_url, timeout=10) as client:
                results: list[int] = []

                def twenty_in_a_row() -> bool:
                    results.append(client.post("/v1/completions", json=COMPLETION).status_code)
                    return results[-20:] == [200] * 20

                poll(twenty_in_a_row, "20 requests in a row answered while two pickers hang", 20.0)
        finally:
            for picker in hung:
                picker.resume()


def test_a_picker_that_does_not_answer_in_time_gets_a_504_that_says_so_with_fail_closed(tmp_path: Path) -> None:
    # 700 ms: the default class waits up to 0.5 s, and the bootstrap leaves the picker 100 ms after that.
    options = replace(OPTIONS, envoy=replace(OPTIONS.envoy, fail_open=False, message_timeout_ms=700))
    with LocalStack(options, tmp_path) as stack, httpx.Client(base_url=stack.gateway_url, timeout=10) as client:
        assert stack.picker is not None
        stack.picker.pause()
        try:
            response = client.post("/v1/completions", json=COMPLETION)
        finally:
            stack.picker.resume()
        assert response.status_code == 504 and response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert error["type"] == "picker_timeout" and int(error["code"]) == 504
        assert (
            error["message"]
            == "the endpoint picker did not answer within 0.700s, and this gateway is set to fail closed"
        )
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200


def test_sigterm_drains_answering_new_requests_while_not_serving(tmp_path: Path) -> None:
    options = replace(OPTIONS, envoy=replace(OPTIONS.envoy, fail_open=False), picker_drain_s=3.0)
    with LocalStack(options, tmp_path) as stack:
        streams = Streams(stack, 4)
        assert stack.picker is not None
        os.kill(stack.picker.pid, signal.SIGTERM)
        poll(lambda: not grpc_serving(stack.picker_address)(), what="readiness NOT_SERVING")
        with httpx.Client(base_url=stack.gateway_url, timeout=10) as client:
            for _ in range(5):  # still answered, by the draining picker
                response = client.post("/v1/completions", json=COMPLETION)
                assert response.status_code == 200
                _decided_by_picker(stack, response)
        poll(lambda: not stack.picker.running(), timeout=15, what="the picker's exit after its drain")
        results = streams.wait()
        assert all(r["done"] and r["events"] == LONG["max_tokens"] + 1 for r in results), results


def test_the_access_log_ends_each_routed_requests_count(stack: LocalStack) -> None:
    with httpx.Client(base_url=stack.gateway_url, timeout=10) as client:
        for _ in range(10):
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    url = f"{stack.picker_admin_url}/endpoints"

    def counts() -> list[int]:
        rows = httpx.get(url, headers=stack.admin_headers, timeout=5).json()["endpoints"]
        return [row["inflight_requests"] for row in rows]

    poll(lambda: counts() == [0, 0], what="in-flight counts back to zero")
    text = httpx.get(f"{stack.picker_admin_url}/metrics", timeout=5).text
    metrics = {family.name: family for family in text_string_to_metric_families(text)}
    ends = {s.labels["how"]: s.value for s in metrics["inferlb_request_ends"].samples}
    assert ends["access_log"] >= 10
    assert ends["expired"] == 0
    assert [s.value for s in metrics["inferlb_requests_awaiting_end"].samples] == [0]


def test_a_server_that_goes_silent_gets_a_stream_idle_504_that_does_not_blame_the_picker(tmp_path: Path) -> None:
    # A 504 flagged SI (nothing moved on the stream for the idle timeout) came with the picker-timeout message,
    # telling the client of a fail-open gateway that the picker had not answered and the gateway was fail-closed.
    options = replace(OPTIONS, backends=1, envoy=replace(OPTIONS.envoy, stream_idle_timeout_ms=1200))
    with LocalStack(options, tmp_path) as stack:
        address = stack.endpoints[0]
        httpx.post(f"http://{address}/admin/faults", json={"hang": True}, timeout=5).raise_for_status()
        with httpx.Client(base_url=stack.gateway_url, timeout=10) as client:
            response = client.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 504
        error = response.json()["error"]
        assert error["type"] == "stream_idle_timeout" and "picker" not in error["message"]
        assert "nothing moved on this request's stream for 1.200s" in error["message"]
