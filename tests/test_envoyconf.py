"""The rendered Envoy bootstrap: valid for the real Envoy binary, and wired the way DESIGN.md says."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferlb.envoyconf import EnvoyConfigError, EnvoyOptions, render_bootstrap
from inferlb.scorer.config import parse_config

from .conftest import envoy_accepts, self_signed

CONFIG = parse_config(
    {
        "listen": "127.0.0.1:9002",
        "max_body_bytes": 65536,
        "pool": {"endpoints": [{"address": "10.0.0.1:8000"}, {"address": "[fd00::2]:8000"}]},
    }
)
# Latency timed from the response stream instead of the servers' spans.
# Envoy in a pod of its own, reaching the pickers through a headless Service's name.
BY_NAME = "inferlb-picker-headless.llm.svc.cluster.local:9002"
STREAM_TIMED = parse_config({"pool": {"endpoints": [{"address": "10.0.0.1:80"}]}, "otel": {"latency_source": "stream"}})


def hcm(doc: dict[str, Any]) -> dict[str, Any]:
    listener = doc["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def clusters(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["static_resources"]["clusters"]}


@pytest.mark.envoy
@pytest.mark.parametrize(
    ("config", "options"),
    [
        pytest.param("plain", EnvoyOptions(), id="default"),
        pytest.param("plain", EnvoyOptions(fail_open=False, access_log_path=None), id="fail-closed"),
        pytest.param("plain", EnvoyOptions(picker=False, fallback_lb_policy="ROUND_ROBIN"), id="no-picker"),
        pytest.param("stream-timed", EnvoyOptions(), id="stream-timed"),
        pytest.param("plain", EnvoyOptions(xds=True), id="xds"),
        pytest.param("plain", EnvoyOptions(xds=True, cluster_mode="override-host"), id="xds-override-host"),
        pytest.param("plain", EnvoyOptions(cluster_mode="override-host"), id="static-override-host"),
        pytest.param("plain", EnvoyOptions(xds=True, tier="weights"), id="weights-tier"),
        pytest.param("plain", EnvoyOptions(xds=True, picker_address=BY_NAME), id="picker-by-name"),
        pytest.param("plain", EnvoyOptions(body_mode="full-duplex"), id="full-duplex"),
    ],
)
def test_envoy_accepts_the_rendered_bootstrap(tmp_path: Path, config: str, options: EnvoyOptions) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(render_bootstrap(STREAM_TIMED if config == "stream-timed" else CONFIG, options))
    envoy_accepts(path)


@pytest.mark.envoy
def test_quotas_named_by_a_jwt_claim_put_envoys_jwt_filter_first(tmp_path: Path) -> None:
    jwks = tmp_path / "jwks.json"
    jwks.write_text('{"keys": [{"kty": "oct", "alg": "HS256", "k": "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0"}]}')
    jwt = {"issuer": "https://auth.test", "audiences": ["inferlb"], "jwks_file": str(jwks), "claim": "org.tenant"}
    quotas = {"header": "x-tenant", "source": "jwt", "jwt": jwt, "default": {"requests_per_minute": 60}}
    config = parse_config({"pool": {"endpoints": [{"address": "10.0.0.1:8000"}]}, "quotas": quotas})
    text = render_bootstrap(config, EnvoyOptions())
    doc = yaml.safe_load(text)
    filters = hcm(doc)["http_filters"]
    assert [f["name"] for f in filters][:2] == ["envoy.filters.http.jwt_authn", "envoy.filters.http.ext_proc"]
    provider = filters[0]["typed_config"]["providers"]["tenant"]
    assert provider["claim_to_headers"] == [{"header_name": "x-tenant", "claim_name": "org.tenant"}]
    assert (provider["issuer"], provider["audiences"], provider["forward"]) == ("https://auth.test", ["inferlb"], False)
    assert filters[0]["typed_config"]["rules"] == [{"match": {"prefix": "/"}, "requires": {"provider_name": "tenant"}}]
    early = hcm(doc)["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert {"remove": "x-tenant"} in early
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    envoy_accepts(path)
    # The weights tier sends no request to the picker: no quota would ever be charged.
    with pytest.raises(EnvoyConfigError, match="quotas would never be charged"):
        render_bootstrap(config, EnvoyOptions(xds=True, tier="weights"))
    # With a gateway in front that sets the header, Envoy forwards it as it comes and checks no token.
    gateway = parse_config(
        {"pool": {"endpoints": [{"address": "10.0.0.1:8000"}]}, "quotas": {**quotas, "source": "gateway", "jwt": None}}
    )
    doc = yaml.safe_load(render_bootstrap(gateway, EnvoyOptions()))
    assert "envoy.filters.http.jwt_authn" not in [f["name"] for f in hcm(doc)["http_filters"]]


@pytest.mark.envoy
def test_a_picker_that_serves_tls_is_reached_over_tls_trusting_its_ca(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl (.ci/run installs it)")
    ca = self_signed(tmp_path)  # Envoy checks that the CA file is a certificate
    tls = {"cert_file": "/etc/inferlb/tls.crt", "key_file": "/etc/inferlb/tls.key", "ca_file": str(ca)}
    pool = {"endpoints": [{"address": "10.0.0.1:8000"}]}
    text = render_bootstrap(parse_config({"pool": pool, "tls": tls}), EnvoyOptions())
    socket = clusters(yaml.safe_load(text))["inferlb_picker"]["transport_socket"]["typed_config"]
    assert socket["common_tls_context"]["validation_context"] == {"trusted_ca": {"filename": str(ca)}}
    assert socket["common_tls_context"]["alpn_protocols"] == ["h2"] and "sni" not in socket
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    envoy_accepts(path)
    assert (
        "transport_socket" not in clusters(yaml.safe_load(render_bootstrap(CONFIG, EnvoyOptions())))["inferlb_picker"]
    )
    # A name the picker's certificate must hold: checked, and sent as SNI.
    text = render_bootstrap(
        parse_config({"pool": pool, "tls": {**tls, "server_name": "picker.llm.svc"}}), EnvoyOptions()
    )
    socket = clusters(yaml.safe_load(text))["inferlb_picker"]["transport_socket"]["typed_config"]
    assert socket["sni"] == "picker.llm.svc"
    assert socket["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "picker.llm.svc"}}
    ]
    path.write_text(text)
    envoy_accepts(path)


def test_client_destination_header_and_request_id_are_removed_before_routing() -> None:
    doc = yaml.safe_load(render_bootstrap(CONFIG, EnvoyOptions()))
    (early,) = hcm(doc)["early_header_mutation_extensions"]
    assert early["typed_config"]["mutations"] == [
        {"remove": "x-gateway-destination-endpoint"},
        {"remove": "x-request-id"},
    ]
    assert hcm(doc)["always_set_request_id_in_response"] is True  # Envoy makes the id; the client learns it


def test_picker_wiring() -> None:
    doc = yaml.safe_load(render_bootstrap(CONFIG, EnvoyOptions(message_timeout_ms=750)))
    filters = hcm(doc)["http_filters"]
    assert [f["name"] for f in filters] == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    ext_proc = filters[0]["typed_config"]
    assert ext_proc["failure_mode_allow"] is True
    assert ext_proc["message_timeout"] == "0.750s"
    assert ext_proc["metadata_options"]["receiving_namespaces"]["untyped"] == ["envoy.lb"]
    forwarded = [p["exact"] for p in ext_proc["forward_rules"]["allowed_headers"]["patterns"]]
    assert sorted(forwarded) == [":method", ":path", "traceparent", "x-request-id"]
    by_name = clusters(doc)
    picker = by_name["inferlb_picker"]
    assert "http2_protocol_options" in str(picker["typed_extension_protocol_options"])
    assert picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] == {
        "socket_address": {"address": "127.0.0.1", "port_value": 9002}
    }
    picked = by_name["inferlb_picked"]
    assert picked["type"] == "ORIGINAL_DST"
    assert picked["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": "x-gateway-destination-endpoint",
    }
    fallback = by_name["inferlb_fallback"]
    assert fallback["lb_policy"] == "LEAST_REQUEST"
    hosts = [
        e["endpoint"]["address"]["socket_address"] for e in fallback["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert hosts == [{"address": "10.0.0.1", "port_value": 8000}, {"address": "fd00::2", "port_value": 8000}]
    listener = doc["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == 65536


def test_routes_opt_in_and_out_of_the_picker() -> None:
    doc = yaml.safe_load(render_bootstrap(CONFIG, EnvoyOptions()))
    routes = {r["name"]: r for r in hcm(doc)["route_config"]["virtual_hosts"][0]["routes"]}
    per_route = "envoy.filters.http.ext_proc"
    assert routes["models"]["typed_per_filter_config"][per_route]["disabled"] is True
    assert routes["models"]["route"]["cluster"] == "inferlb_fallback"
    assert routes["picked"]["match"]["headers"] == [{"name": "x-gateway-destination-endpoint", "present_match": True}]
    assert routes["picked"]["route"]["cluster"] == "inferlb_picked"
    # Every JSON API whose body names a model: on a pool of several models the model decides who may serve.
    body_routes = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses")
    for path in body_routes:
        mode = routes[path]["typed_per_filter_config"][per_route]["overrides"]["processing_mode"]
        # BUFFERED, not BUFFERED_PARTIAL: with a partial buffer Envoy may route before the picker's answer.
        assert mode["request_body_mode"] == "BUFFERED"
    # Full duplex streams the body (its trailers end it, when there are any: Envoy requires them sent).
    doc = yaml.safe_load(render_bootstrap(CONFIG, EnvoyOptions(body_mode="full-duplex")))
    duplex = {r["name"]: r for r in hcm(doc)["route_config"]["virtual_hosts"][0]["routes"]}
    for path in body_routes:
        mode = duplex[path]["typed_per_filter_config"][per_route]["overrides"]["processing_mode"]
        assert (mode["request_body_mode"], mode["request_trailer_mode"]) == ("FULL_DUPLEX_STREAMED", "SEND")
    # Order matters: "picked" must be matched before the fallback routes once the picker set the header.
    names = list(routes)
    assert names.index("models") < names.index("picked") < names.index("/v1/completions") < names.index("v1")


def test_fail_closed_and_no_picker_variants() -> None:
    closed = yaml.safe_load(render_bootstrap(CONFIG, EnvoyOptions(fail_open=False)))
    assert hcm(closed)["http_filters"][0]["typed_config"]["failure_mode_allow"] is False
    bare = yaml.safe_load(render_bootstrap(CONFIG, EnvoyOptions(picker=False, fallback_lb_policy="ROUND_ROBIN")))
    assert [f["name"] for f in hcm(bare)["http_filters"]] == ["envoy.filters.http.router"]
    assert set(clusters(bare)) == {"inferlb_fallback"}
    assert clusters(bare)["inferlb_fallback"]["lb_policy"] == "ROUND_ROBIN"


def test_picker_on_all_interfaces_is_reached_over_loopback() -> None:
    config = parse_config({"listen": "0.0.0.0:9002", "pool": {"endpoints": [{"address": "10.0.0.1:8000"}]}})
    doc = yaml.safe_load(render_bootstrap(config, EnvoyOptions()))
    address = clusters(doc)["inferlb_picker"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert address["address"]["socket_address"]["address"] == "127.0.0.1"


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        pytest.param(BY_NAME, ("STRICT_DNS", "inferlb-picker-headless.llm.svc.cluster.local", 9002), id="dns-name"),
        pytest.param("10.96.0.12:9002", ("STATIC", "10.96.0.12", 9002), id="ip"),
        pytest.param("[fd00::12]:9002", ("STATIC", "fd00::12", 9002), id="ipv6"),
    ],
)
def test_the_picker_may_be_reached_at_an_address_of_its_own(address: str, expected: tuple[str, str, int]) -> None:
    config = parse_config({"listen": "0.0.0.0:9002", "pool": {"endpoints": [{"address": "10.0.0.1:8000"}]}})
    picker = clusters(yaml.safe_load(render_bootstrap(config, EnvoyOptions(picker_address=address))))["inferlb_picker"]
    socket = picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert (picker["type"], socket["address"], socket["port_value"]) == expected
    by_name = expected[0] == "STRICT_DNS"
    assert ("dns_refresh_rate" in picker) == by_name
    checks = [c["grpc_health_check"] for c in picker.get("health_checks", [])]
    assert checks == ([{"service_name": "readiness"}] if by_name else [])


@pytest.mark.parametrize(
    "address",
    [
        pytest.param("inferlb-picker", id="no-port"),
        pytest.param("inferlb_picker.llm:9002", id="underscore"),
        pytest.param("10.0.0.300:9002", id="bad-ip"),
        pytest.param("inferlb-picker:0", id="port-0"),
        pytest.param("http://inferlb-picker:9002", id="url"),
    ],
)
def test_a_bad_picker_address_is_named(address: str) -> None:
    with pytest.raises(EnvoyConfigError, match="picker_address"):
        render_bootstrap(CONFIG, EnvoyOptions(picker_address=address))


def test_tracing_does_not_go_with_a_picker_elsewhere() -> None:
    config = parse_config({"pool": {"endpoints": [{"address": "10.0.0.1:80"}]}, "otel": {"receiver": "0.0.0.0:4317"}})
    with pytest.raises(EnvoyConfigError, match="picker_address"):
        render_bootstrap(config, EnvoyOptions(tracing=True, picker_address=BY_NAME))


@pytest.mark.parametrize(
    ("options", "words"),
    [
        pytest.param(EnvoyOptions(listen="localhost:8080"), "listen", id="hostname-listen"),
        pytest.param(EnvoyOptions(admin="127.0.0.1"), "admin", id="admin-without-port"),
        pytest.param(EnvoyOptions(fallback_lb_policy="MAGLEV"), "fallback LB policy", id="lb-policy"),
        pytest.param(EnvoyOptions(message_timeout_ms=0), "message_timeout_ms", id="timeout"),
        pytest.param(EnvoyOptions(body_mode="streamed"), "body_mode", id="body-mode"),
        pytest.param(
            EnvoyOptions(message_timeout_ms=2000, stream_idle_timeout_ms=500),
            r"the stream idle timeout \(500 ms\) must exceed the picker's message timeout \(2000 ms\)",
            id="idle-below-message-timeout",
        ),
        pytest.param(
            EnvoyOptions(message_timeout_ms=2000, request_timeout_ms=2000),
            r"the request timeout \(2000 ms\) must exceed",
            id="request-below-message-timeout",
        ),
    ],
)
def test_invalid_options_are_named(options: EnvoyOptions, words: str) -> None:
    with pytest.raises(EnvoyConfigError, match=words):
        render_bootstrap(CONFIG, options)


def test_extra_forwarded_headers_are_added_lowercased() -> None:
    doc = yaml.safe_load(render_bootstrap(CONFIG, EnvoyOptions(forward_headers=("X-Session-Id",))))
    ext_proc = hcm(doc)["http_filters"][0]["typed_config"]
    forwarded = [p["exact"] for p in ext_proc["forward_rules"]["allowed_headers"]["patterns"]]
    assert "x-session-id" in forwarded and ":path" in forwarded


def test_tracing_needs_the_receiver_and_points_envoy_at_it() -> None:
    pool = {"endpoints": [{"address": "10.0.0.1:80"}]}
    with pytest.raises(EnvoyConfigError, match=r"otel\.receiver"):
        render_bootstrap(parse_config({"pool": pool}), EnvoyOptions(tracing=True))
    config = parse_config({"pool": pool, "otel": {"receiver": "0.0.0.0:4317"}})
    doc = yaml.safe_load(render_bootstrap(config, EnvoyOptions(tracing=True)))
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    address = clusters["inferlb_otlp"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "127.0.0.1", "port_value": 4317}
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["tracing"]["provider"]["name"] == "envoy.tracers.opentelemetry"
    plain = yaml.safe_load(render_bootstrap(config, EnvoyOptions()))["static_resources"]["listeners"][0]
    assert "tracing" not in plain["filter_chains"][0]["filters"][0]["typed_config"]


def test_stream_timing_adds_an_observing_filter_that_envoy_never_waits_for() -> None:
    filters = hcm(yaml.safe_load(render_bootstrap(STREAM_TIMED, EnvoyOptions())))["http_filters"]
    assert [f["name"] for f in filters] == [
        "envoy.filters.http.ext_proc",
        "inferlb.observe",
        "inferlb.served",
        "envoy.filters.http.router",
    ]
    observe = filters[1]["typed_config"]
    assert observe["observability_mode"] is True and observe["failure_mode_allow"] is True
    mode = observe["processing_mode"]
    assert (mode["request_body_mode"], mode["response_header_mode"], mode["response_body_mode"]) == (
        "NONE",
        "SEND",
        "STREAMED",
    )
    patterns = {p["exact"] for p in observe["forward_rules"]["allowed_headers"]["patterns"]}
    assert patterns == {"x-gateway-destination-endpoint", ":status", "content-type", "x-request-id"}
    # The served endpoint: Envoy's upstream address, over whatever the server sent, into envoy.lb metadata and off
    # the response, forwarded on the observing stream.
    assert observe["metadata_options"]["forwarding_namespaces"] == {"untyped": ["envoy.lb"]}
    [rule] = filters[2]["typed_config"]["response_rules"]
    assert rule["header"] == "x-gateway-destination-endpoint-served" and rule["remove"] is True
    assert rule["on_header_present"]["metadata_namespace"] == "envoy.lb"
    routes = hcm(yaml.safe_load(render_bootstrap(STREAM_TIMED, EnvoyOptions())))["route_config"]["virtual_hosts"][0]
    picked = next(r for r in routes["routes"] if r["name"] == "picked")
    [added] = picked["response_headers_to_add"]
    assert added["header"] == {"key": "x-gateway-destination-endpoint-served", "value": "%UPSTREAM_REMOTE_ADDRESS%"}
    assert added["append_action"] == "OVERWRITE_IF_EXISTS_OR_ADD"
    # Spans (the default) or no picker: no observing filter.
    for config, options in ((CONFIG, EnvoyOptions()), (STREAM_TIMED, EnvoyOptions(picker=False))):
        names = [f["name"] for f in hcm(yaml.safe_load(render_bootstrap(config, options)))["http_filters"]]
        assert "inferlb.observe" not in names


def test_the_model_list_is_neither_routed_nor_timed() -> None:
    routes = hcm(yaml.safe_load(render_bootstrap(STREAM_TIMED, EnvoyOptions())))["route_config"]["virtual_hosts"][0]
    models = next(r for r in routes["routes"] if r["name"] == "models")
    per_filter = models["typed_per_filter_config"]
    assert per_filter["inferlb.observe"]["disabled"] and per_filter["envoy.filters.http.ext_proc"]["disabled"]


def test_envoy_closes_idle_upstream_connections_before_the_servers_do() -> None:
    # vLLM's keep-alive is 5 s; a request on a connection the server is closing would fail with a 503.
    by_name = clusters(yaml.safe_load(render_bootstrap(CONFIG, EnvoyOptions())))
    for name in ("inferlb_picked", "inferlb_fallback"):
        options = by_name[name]["typed_extension_protocol_options"][
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
        ]
        assert float(options["common_http_protocol_options"]["idle_timeout"].rstrip("s")) < 5
        assert "http_protocol_options" in options["explicit_http_config"]


def test_with_xds_the_server_clusters_come_from_the_picker_and_updates_apply_at_once() -> None:
    listing = parse_config({"pool": {"endpoints": [{"address": "10.0.0.1:80"}]}, "destinations": 4})
    doc = yaml.safe_load(render_bootstrap(listing, EnvoyOptions(xds=True, cluster_mode="override-host", retries=3)))
    ads = doc["dynamic_resources"]["ads_config"]
    assert ads["grpc_services"] == [{"envoy_grpc": {"cluster_name": "inferlb_picker"}}]
    by = clusters(doc)
    for name in ("inferlb_fallback", "inferlb_picked"):
        assert by[name]["type"] == "EDS" and "load_assignment" not in by[name]
        assert by[name]["eds_cluster_config"]["eds_config"] == {"ads": {}, "resource_api_version": "V3"}
        assert by[name]["common_lb_config"] == {"update_merge_window": "0.000s"}
    policy = by["inferlb_picked"]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    routes = {r["name"]: r for r in hcm(doc)["route_config"]["virtual_hosts"][0]["routes"]}
    retry = routes["picked"]["route"]["retry_policy"]
    assert retry["num_retries"] == 3 and "connect-failure" in retry["retry_on"]


def test_a_discovered_pool_is_not_written_into_the_file() -> None:
    # Written into the file, the clusters would hold the endpoints listed today (none, with discovery alone):
    # Envoy could reach none of the endpoints the picker names.
    discovered = parse_config(
        {"pool": {"endpoints": [], "discovery": {"etcd": {"urls": ["http://127.0.0.1:2379"], "prefix": "/x/"}}}}
    )
    assert "dynamic_resources" in yaml.safe_load(render_bootstrap(discovered, EnvoyOptions()))  # xDS by default
    with pytest.raises(EnvoyConfigError, match="reaches Envoy only over xDS: render without --no-xds"):
        render_bootstrap(discovered, EnvoyOptions(xds=False))


def test_original_dst_has_no_retries_and_refuses_a_list_of_destinations() -> None:
    doc = yaml.safe_load(render_bootstrap(CONFIG, EnvoyOptions()))
    routes = {r["name"]: r for r in hcm(doc)["route_config"]["virtual_hosts"][0]["routes"]}
    assert "retry_policy" not in routes["picked"]["route"]  # a retry would go back to the same address
    assert clusters(doc)["inferlb_picked"]["type"] == "ORIGINAL_DST" and "dynamic_resources" not in doc
    listing = parse_config({"pool": {"endpoints": [{"address": "10.0.0.1:80"}]}, "destinations": 2})
    with pytest.raises(EnvoyConfigError, match="override-host"):
        render_bootstrap(listing, EnvoyOptions())
    with pytest.raises(EnvoyConfigError, match="needs the picker as Envoy's control plane"):
        render_bootstrap(CONFIG, EnvoyOptions(tier="weights"))


def test_the_weights_tier_sends_no_request_to_the_picker() -> None:
    doc = yaml.safe_load(render_bootstrap(CONFIG, EnvoyOptions(xds=True, tier="weights")))
    routes = {r["name"]: r for r in hcm(doc)["route_config"]["virtual_hosts"][0]["routes"]}
    assert "/v1/completions" not in routes  # no body routes: nothing reads the body
    v1 = routes["v1"]
    assert v1["route"]["cluster"] == "inferlb_fallback"
    assert v1["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] is True
    assert "inferlb.request_end" not in str(hcm(doc).get("access_log", []))  # nothing for the picker to count


def test_more_pickers_are_listed_in_the_picker_cluster_and_only_as_ip_port() -> None:
    doc = yaml.safe_load(render_bootstrap(CONFIG, EnvoyOptions(more_pickers=("127.0.0.1:9102", "127.0.0.1:9104"))))
    picker = next(c for c in doc["static_resources"]["clusters"] if c["name"] == "inferlb_picker")
    ports = [
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for e in picker["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert ports[1:] == [9102, 9104] and len(ports) == 3
    with pytest.raises(EnvoyConfigError, match="more_pickers"):
        render_bootstrap(CONFIG, EnvoyOptions(more_pickers=("picker-2.example:9002",)))
    with pytest.raises(EnvoyConfigError, match="DNS name"):
        render_bootstrap(
            CONFIG, EnvoyOptions(picker_address="inferlb-picker.llm.svc:9002", more_pickers=("127.0.0.1:9102",))
        )


def test_a_class_that_waits_longer_than_envoy_gives_the_picker_is_refused() -> None:
    # Envoy would cut the wait at its message timeout: a 504 with fail-closed, or with fail-open the fallback
    # cluster, past admission control, for every request that waits.
    doc = {
        "pool": {"endpoints": [{"address": "127.0.0.1:8000"}]},
        "classes": [
            {"name": "batch", "on_saturation": "shed", "max_wait_s": 30},  # never waits
            {"name": "interactive", "max_wait_s": 3},
        ],
    }
    with pytest.raises(EnvoyConfigError) as info:
        render_bootstrap(parse_config(doc), EnvoyOptions())
    assert str(info.value) == (
        "class 'interactive' waits up to 3 s for capacity, but Envoy gives the picker 1000 ms to answer: lower its "
        "max_wait_s to 0.9 s or less, or raise --message-timeout-ms to 3100 or more"
    )
    render_bootstrap(parse_config(doc), EnvoyOptions(message_timeout_ms=3100))
    doc["classes"][1]["max_wait_s"] = 0.9
    render_bootstrap(parse_config(doc), EnvoyOptions())


@pytest.mark.parametrize(("destinations", "retries"), [(1, None), (2, 1), (3, 2), (8, 2)])
def test_override_host_retries_only_on_the_endpoints_the_picker_listed(destinations: int, retries: int | None) -> None:
    # Past the list, Override Host's own balancer would pick any member: one that may not serve the model, or that
    # a class, a subset hint or a release arm keeps apart (seen: a reserved canary served 5 of 16 requests).
    config = parse_config({"pool": {"endpoints": [{"address": "10.0.0.1:80"}]}, "destinations": destinations})
    doc = yaml.safe_load(render_bootstrap(config, EnvoyOptions(xds=True, cluster_mode="override-host", retries=2)))
    routes = {r["name"]: r for r in hcm(doc)["route_config"]["virtual_hosts"][0]["routes"]}
    policy = routes["picked"]["route"].get("retry_policy")
    assert (policy and policy["num_retries"]) == retries
