"""Tests for inferlb/admin.py: the configuration view (every part of a config, classes included, as JSON) and the
heatmap routes, drawn in a worker process. (The other routes are exercised on a running picker in
tests/test_picker.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from inferlb.admin import config_document, create_admin_app
from inferlb.otel.heatmapviews import HeatmapViews, spawn_worker
from inferlb.picker import PickerProcess, create_picker
from inferlb.procs import free_port
from inferlb.scorer.config import parse_config

from .scorer.test_gpuclient import LoopbackHttp, http_response

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_config_view_shows_classes_admission_and_otel_as_json() -> None:
    config = parse_config(
        {
            "class_header": "x-class",
            "classes": [
                {"name": "batch", "match": {"header": ["batch", "bulk"]}, "on_saturation": "shed", "priority": -1},
                {
                    "name": "chat",
                    "match": {"max_prompt_tokens": 4000, "stream": True, "models": ["m"]},
                    "ttft_slo_s": 0.5,
                    "priority": 5,
                    "labels": {"pool": "fast"},
                },
            ],
            "default_class": "chat",
            "admission": {"max_waiting": 8},
            "otel": {"latency_source": "stream"},
            "pool": {"endpoints": [{"address": "10.0.0.1:8000", "labels": {"pool": "fast"}}]},
        }
    )
    picker = SimpleNamespace(config=config, config_path=None, reloads=0)
    document = json.loads(json.dumps(config_document(picker)))  # JSON all the way down
    batch, chat = document["classes"]
    assert batch["name"] == "batch" and batch["on_saturation"] == "shed" and batch["priority"] == -1
    assert batch["match"] == {"header_values": ["batch", "bulk"]}
    assert chat["match"] == {"max_prompt_tokens": 4000, "stream": True, "models": ["m"]}
    assert (chat["ttft_slo_s"], chat["priority"], chat["labels"]) == (0.5, 5, {"pool": "fast"})
    assert document["default_class"]["name"] == "chat" and document["class_header"] == "x-class"
    assert document["admission"] == {"max_waiting": 8, "max_kv_usage": 0.95}
    assert document["otel"]["latency_source"] == "stream" and document["policy"] == "default"


def _picker_with_a_heatmap() -> PickerProcess:
    """A picker that is never started, its heatmap holding 30 requests on two endpoints."""
    endpoints = ("10.0.0.1:8000", "10.0.0.2:8000")
    picker = create_picker(
        parse_config(
            {
                "listen": f"127.0.0.1:{free_port()}",
                "admin": f"127.0.0.1:{free_port()}",
                "otel": {"latency_source": "stream"},
                "pool": {"endpoints": [{"address": a} for a in endpoints]},
            }
        )
    )
    assert picker.spans is not None
    now = time.time()
    for i in range(30):
        picker.spans.heatmap.add(now - i, endpoints[i % 2], 0.05 * (1 + i % 2), 1.0)
    return picker


@pytest.fixture
def not_drawn_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawing the PNG in this process (the picker's) fails; a spawned worker imports its own, real renderer."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the heatmap PNG was drawn in the picker's process")

    monkeypatch.setattr("inferlb.otel.render.render_png", refuse)
    monkeypatch.setattr("inferlb.admin.render_png", refuse, raising=False)  # where the app once called it


@pytest.mark.usefixtures("not_drawn_here")
async def test_concurrent_heatmap_pngs_cost_one_render_in_a_worker_that_stops_with_the_app() -> None:
    picker = _picker_with_a_heatmap()
    pool = spawn_worker()
    views = HeatmapViews(worker=lambda: pool)
    app = create_admin_app(picker, heatmap=views)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url=f"http://{picker.config.admin}") as client:
                pngs = await asyncio.gather(*(client.get("/heatmap.png") for _ in range(8)))
                grid = await client.get("/heatmap.json")
                page = await client.get("/heatmap")
            assert [r.status_code for r in pngs] == [200] * 8
            assert {r.headers["content-type"] for r in pngs} == {"image/png"}
            assert pngs[0].content.startswith(PNG) and {r.content for r in pngs} == {pngs[0].content}
            assert views.renders == {"png": 1, "json": 1, "page": 1}
            assert pool.submit(os.getpid).result(timeout=60) != os.getpid()
            assert picker.spans is not None and grid.json() == picker.spans.heatmap.grid()
            assert grid.headers["content-type"] == "application/json"
            assert page.headers["content-type"].startswith("text/html") and 'JSON_URL = "heatmap.json"' in page.text
        with pytest.raises(RuntimeError, match="after shutdown"):  # the app's lifespan ended: the worker stopped
            pool.submit(os.getpid)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.usefixtures("not_drawn_here")
async def test_the_admin_app_draws_the_heatmap_png_outside_the_pickers_process() -> None:
    picker = _picker_with_a_heatmap()
    app = create_admin_app(picker)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{picker.config.admin}") as client:
            pngs = await asyncio.gather(*(client.get("/heatmap.png") for _ in range(3)))
    assert [r.status_code for r in pngs] == [200] * 3 and pngs[0].content.startswith(PNG)


async def test_endpoints_show_why_an_endpoints_gpu_state_is_unknown() -> None:
    async with LoopbackHttp({"/gpu": http_response("503 Service Unavailable", b"GPU is lost")}) as node:
        picker = create_picker(
            parse_config(
                {
                    "listen": f"127.0.0.1:{free_port()}",
                    "admin": f"127.0.0.1:{free_port()}",
                    "pool": {
                        "endpoints": [
                            {"address": "10.0.0.1:8000", "gpu": {"url": node.url("/gpu")}},
                            {"address": "10.0.0.2:8000"},
                        ]
                    },
                }
            )
        )
        assert picker.gpu_collector is not None
        try:
            await picker.gpu_collector.read_once()
        finally:
            await picker.gpu_collector.aclose()
    app = create_admin_app(picker)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=f"http://{picker.config.admin}") as client:
        rows = (await client.get("/endpoints")).json()["endpoints"]
    assert [(r["gpu_utilization"], r["gpu_error"]) for r in rows] == [(None, "HTTP 503: GPU is lost"), (None, None)]
