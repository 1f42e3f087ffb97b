"""Tests for inferlb/admin.py's configuration view: every part of a config, classes included, as JSON.
(The routes themselves are exercised on a running picker in tests/test_picker.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

from inferlb.admin import config_document
from inferlb.scorer.config import parse_config


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
