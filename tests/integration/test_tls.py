"""The picker's gRPC listener over TLS (config ``tls``), through a real Envoy: every request is decided by the picker
over TLS, a client that does not speak TLS gets nothing from that port, a plaintext health port answers probes,
and a renewed certificate is served to new connections without a restart."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferlb.procs import free_port, grpc_serving
from inferlb.stack import LocalStack, StackOptions

from ..conftest import poll, self_signed
from .conftest import log_entry

pytestmark = [
    pytest.mark.envoy,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl (.ci/run installs it)"),
]

MODEL = "m1"
COMPLETION = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4}


def test_envoy_reaches_the_picker_over_tls_and_a_renewed_certificate_is_served(tmp_path: Path) -> None:
    cert = self_signed(tmp_path / "tls", "picker")
    key = cert.with_suffix(".key")
    health_listen = f"127.0.0.1:{free_port()}"
    tls = {"cert_file": str(cert), "key_file": str(key), "health_listen": health_listen}
    options = StackOptions(backends=2, models=(MODEL,), picker_config={"tls": tls})
    with LocalStack(options, tmp_path / "stack") as stack, httpx.Client(base_url=stack.gateway_url, timeout=10) as c:
        for _ in range(6):
            response = c.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200
            assert log_entry(stack, response.headers["x-request-id"])["cluster"] == "inferlb_picked"
        # The TLS port says nothing to a plaintext client; the health port says what a kubelet asks.
        with pytest.raises(grpc.RpcError), grpc.insecure_channel(stack.picker_address) as channel:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=2)
        assert grpc_serving(health_listen, "liveness")() and grpc_serving(health_listen)()
        # The plaintext port serves health alone: no routing stream, no request end, no ADS there.
        with grpc.insecure_channel(health_listen) as channel, pytest.raises(grpc.RpcError) as refused:
            next(iter(ExternalProcessorStub(channel).Process(iter([ProcessingRequest()]), timeout=2)))
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # A renewed certificate (as cert-manager writes it): new connections get it, no restart.
        renewed = self_signed(tmp_path / "renewed", "picker")
        shutil.copy(renewed.with_suffix(".key"), key)
        shutil.copy(renewed, cert)
        trusts_renewed = grpc_serving(stack.picker_address, root_certificates=renewed.read_bytes())
        poll(lambda: _answers(trusts_renewed), "a handshake with the renewed certificate")
        assert c.post("/v1/completions", json=COMPLETION).status_code == 200


def _answers(check: Callable[[], bool]) -> bool:
    """``check()``, False where the handshake or the call fails."""
    try:
        return check()
    except grpc.RpcError:
        return False
