"""deploy/: the Grafana dashboard asks only for metrics the picker really exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from inferlb.metrics import prometheus_text
from inferlb.picker import create_picker
from inferlb.procs import free_port
from inferlb.scorer.config import parse_config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


async def test_every_dashboard_query_names_a_metric_the_picker_exposes() -> None:
    # create_picker builds gRPC servers, which belong to a running event loop.
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    names = {m for e in exprs for m in re.findall(r"\b(inferlb_[a-z0-9_]+)", e)}
    config = parse_config(
        {
            "listen": f"127.0.0.1:{free_port()}",
            "admin": f"127.0.0.1:{free_port()}",
            "otel": {"receiver": f"127.0.0.1:{free_port()}"},
            "pool": {"endpoints": [{"address": "10.0.0.1:8000"}, {"address": "10.0.0.2:8000"}]},
            "experiments": [
                {
                    "name": "ab",
                    "arms": [
                        {"name": "a", "profile": "default", "weight": 0.5},
                        {"name": "b", "profile": "round-robin", "weight": 0.5},
                    ],
                }
            ],
        }
    )
    picker = create_picker(config)
    picker.spans.histograms.observe(0, 0.05, 1.2)
    log = picker.service.decisions  # one of each, so that every counter family has a sample
    log.by_endpoint["10.0.0.1:8000", "max-score"] += 1
    log.refused[404] += 1
    log.shed["batch"] += 1
    exposed = {s.name for family in text_string_to_metric_families(prometheus_text(picker)) for s in family.samples}
    missing = sorted(n for n in names if n not in exposed)
    assert not missing, f"the dashboard queries metrics the picker does not expose: {missing}"
    heatmaps = [p for p in dashboard["panels"] if p["type"] == "heatmap"]
    assert len(heatmaps) >= 2
