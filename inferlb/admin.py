"""The picker's admin API (FastAPI, in the picker's own process and event loop).

| route | what it answers |
|---|---|
| ``GET /healthz`` | 200 while the process runs |
| ``GET /readyz`` | 200 once the gRPC server serves, the first metrics round is in and (with ``replicas``) |
|  | the shared state is replayed or Redis is known down (``notes`` then says it routes alone, and names a |
|  | collector that stopped); else 503 |
| ``GET /endpoints`` | each endpoint's state (serving, ramping in with its slow start, draining), latest signals, |
|  | their age, staleness, last scrape error, GPU source error, in-flight counts; where the pool comes |
|  | from (``membership``: the discovery source, whether it is in touch, entries it skipped and why, |
|  | changes counted) |
| ``GET /decisions?limit=N`` | recent decisions, newest first: reason, each scorer's score, the best candidates' |
| ``GET /experiments`` | each experiment: arms, weights, per-arm counts and latency quantiles, each treatment's |
|  | comparison with the control (difference, always-valid interval, verdict), weight history; a browser |
|  | (``Accept: text/html``) gets the page of it, with TTFT CDFs and the weights over time |
| ``POST /experiments/NAME`` | ``{"action": A}``, A one of pause, resume, stop, start; or ``"weights"`` with |
|  | ``"weights": {arm: share}``; answers the experiment as ``GET /experiments`` shows it |
| ``GET /config`` | the configuration in force |
| ``POST /config`` | a new configuration (YAML or JSON body), validated then applied without dropping a request; |
|  | an invalid one is refused (400) and the old one stays |
| ``POST /config/reload`` | re-read the config file (the same as when the file changes) |
| ``GET /heatmap`` | the latency heatmap (HTML that refreshes itself); ``/heatmap.json``, ``/heatmap.png``: made in |
|  | a worker process and each kept 2 s (otel/heatmapviews.py) |
| ``GET /metrics`` | Prometheus text: decisions by endpoint and reason, pick latency, scrape errors, staleness, |
|  | shed requests |

Handlers only read in-process state; none waits on the network.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import jinja2
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from inferlb.adminguard import AdminGuard
from inferlb.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from inferlb.metrics import picker_registry, scrape
from inferlb.otel.heatmapviews import HeatmapViews, RenderError
from inferlb.otel.render import script_json
from inferlb.scorer.errors import ConfigError

if TYPE_CHECKING:
    from inferlb.picker import PickerProcess

__all__ = ["config_document", "create_admin_app"]


def _num(value: float) -> float | None:
    return None if math.isnan(value) else float(value)


def _jsonable(value: Any) -> Any:
    """A config value as JSON data: dataclasses as objects, sets as sorted lists, mappings as objects."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, frozenset | set):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


def config_document(picker: PickerProcess) -> dict[str, Any]:
    """The configuration in force, as JSON."""
    config = picker.config
    spec = config.profile_spec()
    profile: Any = (
        spec
        if isinstance(spec, str)
        else {
            "name": spec.name,
            "filters": [{"type": f.type, **f.params} for f in spec.filters],
            "scorers": [{"type": s.type, "weight": s.weight, **s.params} for s in spec.scorers],
            "picker": {"type": spec.picker.type, **spec.picker.params},
        }
    )
    return {
        "listen": config.listen,
        "policy": config.policy,
        "profile": profile,
        "max_body_bytes": config.max_body_bytes,
        "session_header": config.session_header,
        "admin": config.admin,
        "signals": _jsonable(config.signals),
        "class_header": config.class_header,
        "classes": [
            {
                **_jsonable(rule.request_class),
                "match": {k: v for k, v in _jsonable(rule).items() if k != "request_class" and v is not None},
            }
            for rule in config.classes
        ],
        "default_class": _jsonable(config.default_class),
        "admission": _jsonable(config.admission),
        "otel": {
            **_jsonable(config.otel),
            "receiver_auth": None if config.otel.receiver_auth is None else config.otel.receiver_auth.describe(),
        },
        "inflight": _jsonable(config.inflight),
        "drain_s": config.drain_s,
        # Where the token is, never the token.
        "admin_auth": {
            "token": None if config.admin_auth.token is None else config.admin_auth.token.describe(),
            "allowed_hosts": sorted(config.admin_auth.allowed_hosts),
        },
        "endpoints": [
            {
                "address": e.address,
                "models": sorted(e.models) if e.models is not None else None,
                "labels": dict(e.labels),
                "gpu": None if e.gpu is None else {"url": e.gpu.url, "kind": e.gpu.kind, "indices": e.gpu.indices},
            }
            for e in config.endpoints
        ],
        "allowed_networks": list(config.allowed_networks.cidrs()),
        "config_file": str(picker.config_path) if picker.config_path else None,
        "reloads": picker.reloads,
    }


def _membership(picker: PickerProcess) -> dict[str, Any]:
    """Where the pool comes from and how it changed: the discovery source's state and the changes counted."""
    source = picker.discovery
    view: dict[str, Any] = {
        "source": "config" if source is None else source.name,
        "changes": dict(picker.membership.changes),
        "refused": picker.membership_refusals,
    }
    if source is not None:
        view["healthy"] = source.healthy
        view["problem"] = source.problem
        view["discovered"] = None if picker.discovered is None else len(picker.discovered)
        for name in ("revision", "updates", "failures"):
            if hasattr(source, name):
                view[name] = getattr(source, name)
        skipped = getattr(source, "skipped", ())
        view["skipped"] = [{"key": s.key, "reason": s.reason} for s in skipped]
    return view


def create_admin_app(picker: PickerProcess, *, heatmap: HeatmapViews | None = None) -> FastAPI:
    """The admin app for one picker; everything it reads is reached through ``picker`` (swapped on reload).
    ``heatmap`` makes the heatmap's views (default: a `HeatmapViews` of its own); its worker process stops at the
    end of the app's lifespan (where the server runs one), after a minute without a request, or with the process."""
    views = HeatmapViews() if heatmap is None else heatmap

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            views.close()

    app = FastAPI(title="inferlb picker", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if picker.config.admin is not None:
        app.add_middleware(
            AdminGuard,
            admin=picker.config.admin,
            auth=lambda: (picker.admin_credential, picker.config.admin_auth.allowed_hosts),
        )

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        reasons = picker.not_ready()
        if reasons:
            return JSONResponse({"status": "not ready", "reasons": reasons}, status_code=503)
        notes = picker.notes()
        return JSONResponse({"status": "ready", "notes": notes} if notes else {"status": "ready"})

    @app.get("/endpoints")
    async def endpoints() -> dict[str, Any]:
        engine = picker.engine
        signals = engine.signals
        snap = signals.snapshot
        now = time.monotonic()
        stale = signals.stale(now)
        ages = snap.age(now)
        errors = picker.collector.last_error if picker.collector is not None else [None] * len(engine.pool)
        gpu_errors = picker.gpu_collector.last_error if picker.gpu_collector is not None else []
        latency = picker.spans.view() if picker.spans is not None else None
        # The operator's relative speeds (pool.speeds), where they tell the servers apart.
        declared = picker.spans.speeds.relative if picker.spans is not None else None
        if declared is not None and len(declared) != len(engine.pool):
            declared = None  # a reload is switching pools
        rows = []
        ramping = dict(engine.pool.ramping)
        for i, endpoint in enumerate(engine.pool):
            ramp = ramping.get(i)
            state = "draining" if endpoint.draining else "ramping" if ramp is not None and not ramp.done else "serving"
            rows.append(
                {
                    "address": endpoint.address,
                    "state": state,
                    **({"slow_start": ramp.describe(now)} if state == "ramping" and ramp is not None else {}),
                    "models": sorted(endpoint.models) if endpoint.models is not None else None,
                    "labels": dict(endpoint.labels),
                    "up": bool(snap.up[i]),
                    "stale": bool(stale[i]),
                    "age_s": None if math.isinf(ages[i]) else round(float(ages[i]), 3),
                    "last_error": errors[i],
                    "running": _num(snap.running[i]),
                    "waiting": _num(snap.waiting[i]),
                    "kv_cache_usage": _num(snap.kv_usage[i]),
                    "kv_cache_tokens": _num(snap.kv_tokens[i]),
                    "gpu_utilization": _num(snap.gpu_util[i]),
                    "gpu_free_bytes": _num(snap.gpu_free_bytes[i]),
                    # why the GPU values are unknown (its GPU source fails), else null
                    "gpu_error": gpu_errors[i] if i < len(gpu_errors) else None,
                    "ttft_s": _num(snap.ttft_s[i]),
                    # What the picker learned of this server's speed (null until it has timings: see README).
                    "prefill_tokens_per_s": _num(snap.prefill_tokens_per_s[i]),
                    "decode_step_s": _num(snap.decode_step_s[i]),
                    "peak_tokens_per_s": _num(snap.peak_tokens_per_s[i]),
                    **({"declared_speed": float(declared[i])} if declared is not None else {}),
                    "inflight_requests": int(engine.inflight.requests[i]),
                    "inflight_tokens": int(engine.inflight.tokens[i]),
                }
            )
            if signals.kv is not None and i < signals.kv.size:
                # The server's own account of its prefix cache (config kv_events): whether the scorers use it now.
                kv_state = signals.kv.states[i]
                rows[-1]["kv_events"] = {
                    "live": bool(signals.kv.live[i]),
                    "state": kv_state.reason,
                    "blocks": signals.kv.held(i),
                    "pending_blocks": signals.kv.pending(i),
                    "last_event_age_s": None
                    if kv_state.last_event_at is None
                    else round(signals.clock() - kv_state.last_event_at, 3),
                }
            if latency is not None and i < len(latency["count"]):
                # From the servers' spans or from the response stream, as otel.latency_source says.
                rows[-1]["latency"] = {key: _num(values[i]) for key, values in latency.items()}
        return {
            "snapshot_age_s": round(now - snap.built_at, 3),
            "membership": _membership(picker),
            "endpoints": rows,
        }

    @app.get("/decisions")
    async def decisions(limit: int = 100) -> Response:
        if not 1 <= limit <= 10_000:
            return _error(400, "limit must be in 1..10000")
        entries = picker.service.decisions.recent(limit)
        endpoints = picker.engine.pool.endpoints
        for entry in entries:
            for row in entry.get("ranking", ()):
                index = row.pop("endpoint_index")
                # A reload may have changed the pool since: then the index is all that is known.
                row["endpoint"] = endpoints[index].address if index < len(endpoints) else f"#{index}"
        return JSONResponse({"decisions": entries})

    @app.get("/experiments")
    async def experiments(request: Request) -> Response:
        running = picker.service.router.experiments
        shown = {
            "experiments": [] if running is None else running.describe(),
            "unattributed_outcomes": 0 if running is None else running.unattributed,
        }
        if "text/html" in request.headers.get("accept", ""):  # a browser: the page, which then fetches the JSON
            return HTMLResponse(experiments_page(shown, json_url="experiments", refresh_s=5.0))
        return JSONResponse(shown)

    @app.post("/experiments/{name}")
    async def control_experiment(name: str, request: Request) -> Response:
        running = picker.service.router.experiments
        experiment = None if running is None else running.running.get(name)
        if experiment is None:
            return _error(404, f"no experiment {name!r} is configured")
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as exc:
            return _error(400, f"not valid JSON: {exc}")
        if not isinstance(body, dict) or not isinstance(body.get("action"), str):
            return _error(400, 'a JSON object with "action": pause, resume, stop, start or weights')
        weights = body.get("weights")
        if weights is not None and not (
            isinstance(weights, dict)
            and all(isinstance(w, int | float) and not isinstance(w, bool) for w in weights.values())
        ):
            return _error(400, '"weights" must map arm names to numbers')
        try:
            experiment.control(body["action"], weights)
        except ValueError as exc:
            return _error(400, str(exc))
        return JSONResponse(experiment.describe())

    @app.get("/config")
    async def get_config() -> dict[str, Any]:
        return config_document(picker)

    @app.post("/config")
    async def post_config(request: Request) -> Response:
        body = await request.body()
        try:
            document = yaml.safe_load(body)
        except yaml.YAMLError as exc:
            return _error(400, f"not valid YAML or JSON: {exc}")
        except RecursionError:
            return _error(400, "not valid YAML or JSON: nested too deeply")
        except (ValueError, OverflowError) as exc:  # a value PyYAML cannot build, such as the date 2024-13-01
            return _error(400, f"not valid YAML or JSON: a value that cannot be read ({exc})")
        return _apply(lambda: picker.reload_document(document))

    @app.post("/config/reload")
    async def reload_file() -> Response:
        if picker.config_path is None:
            return _error(409, "this picker was not started from a config file")
        return _apply(picker.reload_file)

    NO_LATENCY = "no latency source: set otel.receiver (servers' spans) or otel.latency_source: stream in the config"

    # Encoding and drawing take the GIL for tens to hundreds of ms: a worker process does them, not this loop.
    @app.get("/heatmap")
    async def heatmap_page() -> Response:
        if picker.spans is None:
            return _error(404, NO_LATENCY)
        try:
            page = await views.page(picker.spans.heatmap, json_url="heatmap.json", refresh_s=5.0)
        except RenderError as exc:
            return _error(503, str(exc))
        return HTMLResponse(page)

    @app.get("/heatmap.json")
    async def heatmap_json() -> Response:
        if picker.spans is None:
            return _error(404, NO_LATENCY)
        try:
            return Response(await views.json(picker.spans.heatmap), media_type="application/json")
        except RenderError as exc:
            return _error(503, str(exc))

    @app.get("/heatmap.png")
    async def heatmap_png() -> Response:
        if picker.spans is None:
            return _error(404, NO_LATENCY)
        try:
            return Response(await views.png(picker.spans.heatmap), media_type="image/png")
        except RenderError as exc:
            return _error(503, str(exc))

    registry = picker_registry(picker)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await scrape(registry, picker), media_type=METRICS_CONTENT_TYPE)

    return app


def experiments_page(shown: Mapping[str, Any], *, json_url: str | None, refresh_s: float | None) -> str:
    """The ``/experiments`` page: self-contained HTML (inline CSS and JS, ``shown`` embedded as JSON) with each
    experiment's arms, comparisons, per-arm TTFT CDFs and weight history; every ``refresh_s`` it fetches
    ``json_url`` (relative to the page) and redraws."""
    return _experiments_template().render(
        data=script_json(dict(shown)), json_url=script_json(json_url), refresh_s=script_json(refresh_s)
    )


@functools.cache
def _experiments_template() -> jinja2.Template:
    text = importlib.resources.files("inferlb").joinpath("experiments.html.j2").read_text(encoding="utf-8")
    return jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False).from_string(text)


def _apply(action: Callable[[], None]) -> Response:
    try:
        action()
    except ConfigError as exc:
        return _error(400, f"config refused, the old one stays in force: {exc}")
    return JSONResponse({"status": "applied"})


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)
