"""An Endpoint Picker against the Gateway API Inference Extension's protocol (its proposal 004): our own
conformance suite, modelled on the extension's gateway conformance scenarios, for any picker.

    inferlb conformance [--picker HOST:PORT [--picker-ca FILE] --model NAME] [--body-mode buffered|full-duplex ...]
                        [--out DIR]

With ``--picker`` it plays the data plane to that picker over ext_proc, message by message as Envoy sends
them, in each body mode: a pick names ``ip:port`` endpoints in the destination header and the same value in
``envoy.lb`` metadata; the subset hint is honoured (only those endpoints; none eligible, an empty list or a
malformed hint: 503); a malformed body is refused; in FULL_DUPLEX_STREAMED mode the body comes back whole.
Without ``--picker`` it starts inferlb itself (emulated servers, real Envoy) and runs those scenarios against
it and, through Envoy, the ones that need the data plane: picks are followed (Envoy's access log: the picked
endpoint is the one that served), the picker down with fail-open (the fallback cluster serves) and with
fail-closed (a JSON 5xx), a weighted split across two pools (each share picked by its own pool's picker), the
subset hint set by a filter before the picker's, and the served endpoint Envoy reports after a retry. Each
scenario is a MUST or a SHOULD of the protocol (or of a production gateway); the exit status is 1 if a MUST
fails. Results: ``conformance.json`` and ``conformance.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import yaml
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)

from inferlb.bench.metrics import picker_samples
from inferlb.bench.report import header, table, write
from inferlb.envoyconf import EnvoyOptions
from inferlb.procs import SERVER_HEADER, free_port
from inferlb.stack import LocalStack, StackOptions, start_envoy

__all__ = ["MODES", "Result", "add_arguments", "picker_scenarios", "run"]

MODES = {"buffered": ProcessingMode.BUFFERED, "full-duplex": ProcessingMode.FULL_DUPLEX_STREAMED}
DESTINATION = "x-gateway-destination-endpoint"
NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
OUTSIDE = "198.51.100.1:8000"  # TEST-NET-2: in no pool
TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Result:
    scenario: str
    mode: str  # the body mode, or "envoy" for the scenarios through the data plane
    level: str  # MUST or SHOULD
    passed: bool
    detail: str


class Failed(Exception):
    """A scenario's expectation that did not hold (the message says what was seen)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--picker", help="HOST:PORT of the picker to check (default: start inferlb and check it)")
    parser.add_argument(
        "--picker-ca", type=Path, help="the picker serves TLS: the CA (PEM) its certificate chains to, to trust"
    )
    parser.add_argument("--model", default="m1", help="a model the picker's pool serves")
    parser.add_argument("--body-mode", action="append", choices=MODES, help="the body modes to check (default: both)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))


def run(args: argparse.Namespace) -> int:
    modes = args.body_mode or list(MODES)
    meta = header(args.command)
    results: list[Result] = []
    if args.picker:
        for mode in modes:
            roots = None if args.picker_ca is None else args.picker_ca.read_bytes()
            results += asyncio.run(picker_scenarios(args.picker, args.model, mode, roots=roots))
        target = args.picker
    else:
        target = "inferlb (started here: emulated servers, real Envoy)"
        with tempfile.TemporaryDirectory(prefix="inferlb-conformance-") as folder:
            for mode in modes:
                with _stack(Path(folder) / mode, mode) as stack:
                    results += asyncio.run(picker_scenarios(stack.picker_address, "m1", mode))
                    results += envoy_scenarios(stack, mode)
            results += [_picker_down(Path(folder) / "fail-closed", fail_open=False)]
            for mode in modes:
                results += gateway_scenarios(Path(folder) / f"gateway-{mode}", mode)
    for r in results:
        print(f"  {'pass' if r.passed else 'FAIL'}  {r.level:<6} {r.mode:<11} {r.scenario}: {r.detail}", flush=True)
    failed = [r for r in results if not r.passed and r.level == "MUST"]
    document = {"meta": {**meta, "picker": target, "modes": modes}, "results": [asdict(r) for r in results]}
    write(args.out, "conformance", document, _markdown(document))
    return 1 if failed else 0


# ---- the picker over ext_proc, as the data plane drives it --------------------------------------------------


def _headers(path: str, mode: str, *, eos: bool = False, subset: Any = None) -> ProcessingRequest:
    pairs = [(":path", path), (":method", "POST"), ("content-type", "application/json"), ("x-request-id", "c")]
    message = ProcessingRequest(
        request_headers=HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]), end_of_stream=eos
        ),
        protocol_config=ProtocolConfiguration(request_body_mode=MODES[mode]),
    )
    if subset is not None:
        value = message.metadata_context.filter_metadata[SUBSET_NAMESPACE].fields[SUBSET_KEY]
        if isinstance(subset, list):
            value.list_value.SetInParent()
            for address in subset:
                value.list_value.values.add().string_value = address
        else:
            value.number_value = float(subset)
    return message


@dataclass(slots=True)
class Exchange:
    """What the picker answered to one request: the replies, in order."""

    replies: list[ProcessingResponse]

    @property
    def immediate(self) -> int | None:
        """The status of the picker's immediate response, if it answered with one."""
        for reply in self.replies:
            if reply.WhichOneof("response") == "immediate_response":
                return int(reply.immediate_response.status.code)
        return None

    def destination(self) -> tuple[str, str]:
        """The destination header's value and the ``envoy.lb`` metadata's; Failed if the reply routes nowhere."""
        for reply in self.replies:
            phase = reply.WhichOneof("response")
            if phase not in ("request_headers", "request_body"):
                continue
            common = getattr(reply, phase).response
            headers = [h.header for h in common.header_mutation.set_headers if h.header.key == DESTINATION]
            if headers:
                metadata = reply.dynamic_metadata.fields[NAMESPACE].struct_value.fields[DESTINATION].string_value
                return (headers[0].raw_value or headers[0].value.encode()).decode(), metadata
        raise Failed(f"no reply set {DESTINATION} (replies: {[r.WhichOneof('response') for r in self.replies]})")

    def body(self) -> bytes:
        """The body the picker streamed back (FULL_DUPLEX_STREAMED)."""
        parts = [
            r.request_body.response.body_mutation.streamed_response.body
            for r in self.replies
            if r.WhichOneof("response") == "request_body"
        ]
        return b"".join(parts)


async def _exchange(
    target: str, mode: str, body: bytes | None, *, subset: Any = None, path: str = "", roots: bytes | None = None
) -> Exchange:
    """One request on its own stream: headers, then the body (two chunks in full-duplex mode); the replies until
    the picker has answered all it owes (or ends the stream). Over TLS trusting ``roots``, where they are given."""
    opened = (
        grpc.aio.insecure_channel(target)
        if roots is None
        else grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(roots))
    )
    async with opened as channel:
        call = external_processor_pb2_grpc.ExternalProcessorStub(channel).Process(timeout=TIMEOUT_S)
        path = path or "/v1/completions"
        await call.write(_headers(path, mode, eos=body is None, subset=subset))
        replies: list[ProcessingResponse] = []
        if body is not None and mode == "buffered":
            first = await call.read()
            if first is grpc.aio.EOF:
                return Exchange(replies)
            replies.append(first)
            if first.WhichOneof("response") == "immediate_response":
                return Exchange(replies)
            await call.write(ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True)))
        elif body is not None:
            half = len(body) // 2
            await call.write(ProcessingRequest(request_body=HttpBody(body=body[:half])))
            await call.write(ProcessingRequest(request_body=HttpBody(body=body[half:], end_of_stream=True)))
        await call.done_writing()
        while True:
            reply = await call.read()
            if reply is grpc.aio.EOF:
                break
            replies.append(reply)
            if reply.WhichOneof("response") == "immediate_response":
                break
            if mode == "full-duplex" and body is not None:
                streamed = reply.request_body.response.body_mutation.streamed_response
                if reply.WhichOneof("response") == "request_body" and streamed.end_of_stream:
                    break
            elif reply.WhichOneof("response") in ("request_headers", "request_body") and (
                body is None or reply.WhichOneof("response") == "request_body"
            ):
                break
        call.cancel()
        return Exchange(replies)


def _ip_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


async def picker_scenarios(target: str, model: str, mode: str, *, roots: bytes | None = None) -> list[Result]:
    """The scenarios any picker must pass over ext_proc, in body mode ``mode`` (over TLS trusting ``roots``, for a
    picker that serves TLS)."""
    body = json.dumps({"model": model, "prompt": "conformance " * 200, "max_tokens": 4}).encode()
    results: list[Result] = []
    seen: set[str] = set()

    async def exchange(sent: bytes | None, *, subset: Any = None) -> Exchange:
        return await _exchange(target, mode, sent, subset=subset, roots=roots)

    async def check(name: str, level: str, scenario: Callable[[], Any]) -> None:
        try:
            detail = await scenario()
            results.append(Result(name, mode, level, True, detail))
        except (Failed, grpc.aio.AioRpcError, TimeoutError) as exc:
            results.append(Result(name, mode, level, False, str(exc).splitlines()[0][:300]))

    async def routes() -> str:
        for _ in range(12):
            got = await exchange(body)
            header_value, metadata = got.destination()
            listed = header_value.split(",")
            if header_value != metadata:
                raise Failed(f"header {header_value!r} and envoy.lb metadata {metadata!r} differ")
            if not all(_ip_port(a) for a in listed):
                raise Failed(f"{header_value!r} is not ip:port[,ip:port...]")
            seen.add(listed[0])
        return f"12 picks, header = metadata, ip:port; {len(seen)} endpoint(s) seen"

    async def subset_honoured() -> str:
        if not seen:
            raise Failed("no endpoint was picked before")
        chosen = sorted(seen)[-1]
        for _ in range(6):
            header_value, _ = (await exchange(body, subset=[chosen, OUTSIDE])).destination()
            if header_value.split(",")[0] != chosen:
                raise Failed(f"hint [{chosen}, {OUTSIDE}]: picked {header_value}")
        return f"6 picks with the hint [{chosen}, an address in no pool]: all {chosen}"

    def refused(subset: Any, what: str) -> Callable[[], Any]:
        async def scenario() -> str:
            got = await exchange(body, subset=subset)
            if got.immediate != 503:
                raise Failed(f"{what}: expected an immediate 503, got {got.immediate or 'a pick'}")
            return f"{what}: 503"

        return scenario

    async def malformed() -> str:
        got = await exchange(b'{"model": "m", "prompt": ')
        if got.immediate is None or not 400 <= got.immediate < 500:
            raise Failed(f"a body that is not JSON: expected a 4xx, got {got.immediate or 'a pick'}")
        return f"a body that is not JSON: {got.immediate}"

    async def returned() -> str:
        got = await exchange(body)
        got.destination()
        kinds = [r.WhichOneof("response") for r in got.replies]
        if kinds[0] != "request_headers":
            raise Failed(f"the headers' reply must come first; got {kinds}")
        if got.body() != body:
            raise Failed(f"the body came back as {len(got.body())} of {len(body)} bytes")
        return f"headers reply, then the body back whole ({len(body)} bytes, {len(kinds) - 1} piece(s))"

    await check("routes-with-header-and-metadata", "MUST", routes)
    await check("subset-hint-honoured", "MUST", subset_honoured)
    await check("subset-hint-none-eligible", "MUST", refused([OUTSIDE], "a hint of no pool member"))
    await check("subset-hint-empty", "MUST", refused([], "an empty hint"))
    await check("subset-hint-malformed", "SHOULD", refused(7, "a hint that is not a list"))
    await check("malformed-body-refused", "SHOULD", malformed)
    if mode == "full-duplex":
        await check("full-duplex-body-returned", "MUST", returned)
    return results


# ---- through real Envoy (inferlb started here) --------------------------------------------------------------


@contextmanager
def _stack(workdir: Path, mode: str, *, fail_open: bool = True, backends: int = 3, **more: Any) -> Iterator[LocalStack]:
    envoy = EnvoyOptions(body_mode=mode, fail_open=fail_open, **more.pop("envoy", {}))
    options = StackOptions(backends=backends, models=("m1",), envoy=envoy, **more)
    with LocalStack(options, workdir) as stack:
        yield stack


def envoy_scenarios(stack: LocalStack, mode: str) -> list[Result]:
    """Picks are followed, and the picker down with fail-open; ``stack``'s picker is stopped at the end."""
    results = []
    body = {"model": "m1", "prompt": "through envoy " * 50, "max_tokens": 4}
    with httpx.Client(base_url=stack.gateway_url, timeout=TIMEOUT_S) as client:
        mismatches, served = [], set()
        ids = []
        for _ in range(12):
            response = client.post("/v1/completions", json=body)
            if response.status_code != 200:
                mismatches.append(f"status {response.status_code}")
                continue
            ids.append((response.headers["x-request-id"], response.headers[SERVER_HEADER]))
        entries = _log_entries(stack, [i for i, _ in ids])
        for request_id, server in ids:
            entry = entries.get(request_id)
            if entry is None or entry.get("picked") != entry.get("upstream") or entry.get("upstream") != server:
                mismatches.append(f"{request_id}: picked {entry and entry.get('picked')}, served by {server}")
            served.add(server)
        detail = f"12 requests: each served by the endpoint picked ({len(served)} endpoints)"
        results.append(
            Result("picks-followed", "envoy/" + mode, "MUST", not mismatches, "; ".join(mismatches) or detail)
        )
        assert stack.picker is not None
        stack.picker.stop()
        seen_down = ""
        if mode == "full-duplex":
            # Envoy streams a full-duplex body before the picker's stream has opened, so only a picker its health
            # check has marked down fails open for certain (the bootstrap checks it every second).
            waited = stack.wait_picker_marked_down()
            seen_down = f" (after Envoy's health check marked it down: {waited:.1f} s)"
        down = client.post("/v1/completions", json=body)
        fallback = _log_entries(stack, [down.headers.get("x-request-id", "")]).get(down.headers.get("x-request-id", ""))
        passed = down.status_code == 200 and fallback is not None and fallback.get("cluster") == "inferlb_fallback"
        detail = f"picker stopped{seen_down}: {down.status_code} from cluster {fallback and fallback.get('cluster')}"
        results.append(Result("picker-down-fail-open", "envoy/" + mode, "MUST", passed, detail))
    return results


def _picker_down(workdir: Path, *, fail_open: bool) -> Result:
    with _stack(workdir, "buffered", fail_open=fail_open) as stack, httpx.Client(timeout=TIMEOUT_S) as client:
        assert stack.picker is not None
        stack.picker.stop()
        response = client.post(f"{stack.gateway_url}/v1/completions", json={"model": "m1", "prompt": "x"})
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            error = None
        passed = response.status_code >= 500 and error is not None
        detail = f"picker stopped: {response.status_code}, {error['type'] if error else 'no JSON error'}"
    return Result("picker-down-fail-closed", "envoy/buffered", "MUST", passed, detail)


# ---- gateways built here around inferlb's pickers: two pools, a subset hint, the served endpoint ---------------


EXT_PROC = "envoy.filters.http.ext_proc"
EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
SPLIT = (80, 20)  # pool A's and pool B's weights in the split
SPLIT_REQUESTS = 100
SPLIT_TOLERANCE = 0.15  # of the share; the binomial's spread at 100 requests is 0.04


@dataclass(slots=True)
class Gateway:
    """A further Envoy, on a bootstrap changed from a stack's: its listener, admin API and access log."""

    url: str
    admin_url: str
    log_path: Path

    def access_log(self) -> list[dict[str, Any]]:
        if not self.log_path.exists():
            return []
        return [json.loads(line) for line in self.log_path.read_text(encoding="utf-8").splitlines() if line.strip()]


@contextmanager
def _gateway(document: dict[str, Any], workdir: Path) -> Iterator[Gateway]:
    """Run Envoy on ``document`` (a stack's bootstrap, changed) with a listener, admin API and access log of its own."""
    workdir.mkdir(parents=True, exist_ok=True)
    listener = document["static_resources"]["listeners"][0]
    listen, admin = free_port(), free_port()
    listener["address"]["socket_address"]["port_value"] = listen
    document["admin"]["address"]["socket_address"]["port_value"] = admin
    log_path = workdir / "access.log"
    for logger in _hcm(document)["access_log"]:
        if logger["name"] == "envoy.access_loggers.file":
            logger["typed_config"]["path"] = str(log_path)
    bootstrap = workdir / "envoy.yaml"
    bootstrap.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    envoy = start_envoy(bootstrap, workdir / "envoy.log", f"http://127.0.0.1:{admin}", concurrency=1)
    try:
        yield Gateway(f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}", log_path)
    finally:
        envoy.stop()


def _hcm(document: dict[str, Any]) -> dict[str, Any]:
    typed: dict[str, Any] = document["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    return typed


def _bootstrap(stack: LocalStack) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(stack.envoy_path.read_text(encoding="utf-8"))
    return document


def _split_bootstrap(a: LocalStack, b: LocalStack, weights: tuple[int, int]) -> dict[str, Any]:
    """One Envoy in front of two pools, as a gateway serves an HTTPRoute with weighted backendRefs to two
    InferencePools: each picker route splits by weight between pool A's fallback cluster and pool B's, and each
    share asks its own pool's picker (a per-cluster ext_proc override); the pick then goes where it names."""
    document = _bootstrap(a)
    clusters = document["static_resources"]["clusters"]
    by_name = {c["name"]: c for c in clusters}
    for name, stack in (("inferlb_picker", b), ("inferlb_fallback", b)):
        twin = copy.deepcopy(by_name[name])
        twin["name"] = twin["load_assignment"]["cluster_name"] = f"{name}_b"
        addresses = [stack.picker_address] if name == "inferlb_picker" else stack.endpoints
        twin["load_assignment"]["endpoints"] = [
            {"lb_endpoints": [{"endpoint": {"address": _socket(address)}} for address in addresses]}
        ]
        clusters.append(twin)
    hcm = _hcm(document)
    for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
        target = route.get("route", {})
        if target.get("cluster") != "inferlb_fallback" or route["name"] == "models":
            continue
        own = route.get("typed_per_filter_config", {}).get(EXT_PROC) or {"@type": EXT_PROC_PER_ROUTE, "overrides": {}}
        shares = []
        for (cluster, picker), weight in zip(
            (("inferlb_fallback", "inferlb_picker"), ("inferlb_fallback_b", "inferlb_picker_b")), weights, strict=True
        ):
            override = copy.deepcopy(own)
            override.setdefault("overrides", {})["grpc_service"] = {"envoy_grpc": {"cluster_name": picker}}
            shares.append({"name": cluster, "weight": weight, "typed_per_filter_config": {EXT_PROC: override}})
        del target["cluster"]
        target["weighted_clusters"] = {"clusters": shares}
    # Each picker learns of its requests' ends from the access log: both get every entry, and end their own.
    loggers = hcm["access_log"]
    [request_end] = [logger for logger in loggers if logger["name"] == "inferlb.request_end"]
    twin = copy.deepcopy(request_end)
    twin["name"] = twin["typed_config"]["common_config"]["log_name"] = "inferlb.request_end_b"
    twin["typed_config"]["common_config"]["grpc_service"] = {"envoy_grpc": {"cluster_name": "inferlb_picker_b"}}
    loggers.append(twin)
    return document


def _subset_bootstrap(stack: LocalStack, subset: list[str]) -> dict[str, Any]:
    """The stack's Envoy with a gateway's subset hint: a filter before the picker's sets ``envoy.lb.subset_hint``
    to ``subset`` on every request (as a gateway that narrows a route to some endpoints does)."""
    document = _bootstrap(stack)
    hint = {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [{"metadata_namespace": SUBSET_NAMESPACE, "value": {SUBSET_KEY: subset}}],
        },
    }
    _hcm(document)["http_filters"].insert(0, hint)
    return document


def _socket(address: str) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    return {"socket_address": {"address": host, "port_value": int(port)}}


def gateway_scenarios(workdir: Path, mode: str) -> list[Result]:
    """Through Envoys built here around inferlb's pickers: a weighted split across two pools, the subset hint
    honoured (and a hint of no member refused), and the served endpoint reported after a retry."""
    results: list[Result] = []
    with _stack(workdir / "pool-a", mode, backends=2) as a, _stack(workdir / "pool-b", mode, backends=2) as b:
        results.append(_weighted_split(a, b, workdir / "split", mode))
        results += _subset_through_envoy(a, workdir / "subset", mode)
    results.append(_served_reported(workdir / "served", mode))
    return results


def _weighted_split(a: LocalStack, b: LocalStack, workdir: Path, mode: str) -> Result:
    body = {"model": "m1", "prompt": "split " * 40, "max_tokens": 2}
    pools = {"A": set(a.endpoints), "B": set(b.endpoints)}
    with _gateway(_split_bootstrap(a, b, SPLIT), workdir) as gateway, httpx.Client(timeout=TIMEOUT_S) as client:
        ids, problems = [], []
        for _ in range(SPLIT_REQUESTS):
            response = client.post(f"{gateway.url}/v1/completions", json=body)
            if response.status_code != 200:
                problems.append(f"status {response.status_code}")
            ids.append(response.headers.get("x-request-id", ""))
        entries = _log_entries(gateway, ids)
    shares = {"A": 0, "B": 0}
    for request_id in ids:
        entry = entries.get(request_id) or {}
        picked, upstream = str(entry.get("picked") or ""), entry.get("upstream")
        pool = next((name for name, members in pools.items() if picked in members), None)
        if pool is None or upstream != picked:
            problems.append(f"{request_id}: picked {picked or 'nothing'}, served by {upstream}")
            continue
        shares[pool] += 1
    expected = SPLIT[0] / sum(SPLIT)
    share = shares["A"] / SPLIT_REQUESTS
    if abs(share - expected) > SPLIT_TOLERANCE:
        problems.append(f"pool A got {share:.2f} of the requests, not {expected:.2f} +- {SPLIT_TOLERANCE}")
    detail = (
        f"{SPLIT_REQUESTS} requests split {SPLIT[0]}/{SPLIT[1]}: {shares['A']} to pool A, {shares['B']} to pool B, "
        "each picked by its pool's picker among its members and served there"
    )
    return Result("weighted-split-two-pools", "envoy/" + mode, "MUST", not problems, "; ".join(problems[:3]) or detail)


def _subset_through_envoy(stack: LocalStack, workdir: Path, mode: str) -> list[Result]:
    body = {"model": "m1", "prompt": "subset " * 40, "max_tokens": 2}
    chosen = sorted(stack.endpoints)[-1]
    results = []
    with (
        _gateway(_subset_bootstrap(stack, [chosen, OUTSIDE]), workdir / "one") as gateway,
        httpx.Client(timeout=TIMEOUT_S) as client,
    ):
        responses = [client.post(f"{gateway.url}/v1/completions", json=body) for _ in range(8)]
        entries = _log_entries(gateway, [r.headers.get("x-request-id", "") for r in responses])
        wrong = [
            f"status {r.status_code}, served by {entries.get(r.headers.get('x-request-id', ''), {}).get('upstream')}"
            for r in responses
            if r.status_code != 200 or entries.get(r.headers.get("x-request-id", ""), {}).get("upstream") != chosen
        ]
        detail = f"8 requests, the gateway's hint [{chosen}, an address in no pool]: all served by {chosen}"
        results.append(
            Result("subset-hint-through-envoy", "envoy/" + mode, "MUST", not wrong, "; ".join(wrong[:3]) or detail)
        )
    with (
        _gateway(_subset_bootstrap(stack, [OUTSIDE]), workdir / "none") as gateway,
        httpx.Client(timeout=TIMEOUT_S) as client,
    ):
        response = client.post(f"{gateway.url}/v1/completions", json=body)
        try:
            error = response.json()["error"]["type"]
        except (ValueError, KeyError, TypeError):
            error = None
        passed = response.status_code == 503 and error is not None
        detail = f"a hint of no pool member: {response.status_code}, {error or 'no JSON error'}"
        results.append(Result("subset-hint-none-eligible-through-envoy", "envoy/" + mode, "MUST", passed, detail))
    return results


def _served_reported(workdir: Path, mode: str) -> Result:
    """Override Host with two endpoints listed, and one server answering 503 (its cold start) that the picker does
    not know of (no scrapes): Envoy retries on the next endpoint and reports the endpoint that served; the picker
    counts each report as the pick or elsewhere (its /metrics), and every request is reported."""
    more: dict[str, Any] = {
        "latency_source": "stream",
        "envoy": {"cluster_mode": "override-host"},
        "picker_config": {"destinations": 2, "signals": {"scrape_metrics": False}},
    }
    body = {"model": "m1", "prompt": "served " * 40, "max_tokens": 2}
    with _stack(workdir, mode, **more) as stack, httpx.Client(timeout=TIMEOUT_S) as client:
        cold = stack.endpoints[0]
        client.post(f"http://{cold}/admin/faults", json={"crash": True, "cold_start_s": 600}).raise_for_status()
        responses = [client.post(f"{stack.gateway_url}/v1/completions", json=body) for _ in range(24)]
        entries = _log_entries(stack, [r.headers.get("x-request-id", "") for r in responses])
        retried = sum(
            str(entries.get(r.headers.get("x-request-id", ""), {}).get("picked", "")).split(",")[0]
            != entries.get(r.headers.get("x-request-id", ""), {}).get("upstream")
            for r in responses
        )
        failed = sum(r.status_code != 200 for r in responses)
        deadline = time.monotonic() + 5
        while True:
            reports = _served_reports(stack)
            if sum(reports.values()) >= len(responses) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    passed = (
        failed == 0
        and retried > 0
        and reports.get("elsewhere") == retried
        and reports.get("as-picked") == len(responses) - retried
    )
    detail = (
        f"{len(responses)} requests, {retried} retried on the next endpoint listed, {failed} failed; reports: "
        f"{reports.get('as-picked', 0):.0f} as picked, {reports.get('elsewhere', 0):.0f} elsewhere (counted there), "
        f"{reports.get('unknown', 0):.0f} unknown"
    )
    return Result("served-endpoint-reported", "envoy/" + mode, "MUST", passed, detail)


def _served_reports(stack: LocalStack) -> dict[str, float]:
    return picker_samples(stack.picker_admin_url, "inferlb_served_reports_total")


def _log_entries(
    stack: LocalStack | Gateway, request_ids: Sequence[str], timeout_s: float = 5.0
) -> dict[str, dict[str, Any]]:
    """Envoy's access-log entries of ``request_ids`` (it flushes the log every 100 ms: polled until all are in)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {str(e["request_id"]): e for e in stack.access_log() if e.get("request_id") in request_ids}
        if len(found) == len(set(request_ids)) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _markdown(document: dict[str, Any]) -> str:
    meta, results = document["meta"], [Result(**r) for r in document["results"]]
    must = [r for r in results if r.level == "MUST"]
    out = [
        "# Endpoint Picker conformance",
        "",
        f"{meta['date']} · `{meta['command']}` · {meta['machine']}",
        "",
        f"Picker: {meta['picker']}. The protocol is the Gateway API Inference Extension's Endpoint Picker protocol",
        "(proposal 004); each scenario is a MUST or a SHOULD of it (or of a production gateway). Scenarios in a body",
        "mode play the data plane to the picker over ext_proc; those marked envoy/ go through a real Envoy.",
        "",
        f"**{sum(r.passed for r in must)} of {len(must)} MUST scenarios pass; "
        f"{sum(r.passed for r in results if r.level == 'SHOULD')} of {sum(r.level == 'SHOULD' for r in results)} "
        "SHOULD.**",
        "",
    ]
    rows = [[r.mode, r.scenario, r.level, "pass" if r.passed else "FAIL", r.detail] for r in results]
    out += table(["mode", "scenario", "level", "result", "what was seen"], rows, "lllll")
    out += [
        "",
        "The gateway scenarios run Envoys built here around inferlb's pickers: one in front of two pools (each",
        "picker route split by weight between the pools' clusters, each share asking its own pool's picker, as a",
        "gateway serves an HTTPRoute with weighted backendRefs to two InferencePools); one whose filter before the",
        "picker's sets the subset hint; and Override Host with one server answering 503 that the picker does not",
        "know of, so Envoy retries on the next endpoint listed and reports the endpoint that served. With",
        "`--picker`, only the scenarios over ext_proc run: the others need the pickers started here.",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    import sys

    from inferlb.bench.suites import script

    raise SystemExit(script(sys.modules[__name__]))
