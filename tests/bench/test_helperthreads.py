"""The helper-threads benchmark: the policy set on a running process's threads but its first, and the summary's
figures and ratios."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from inferlb.bench.helperthreads import _markdown, summarise
from inferlb.threads import set_policy

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="scheduling policies are Linux's")

THREADS = """
import sys, threading
stop = threading.Event()
for _ in range(3):
    threading.Thread(target=stop.wait, daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
"""


def test_the_policy_goes_on_every_thread_but_the_first() -> None:
    child = subprocess.Popen([sys.executable, "-c", THREADS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        assert set_policy(child.pid, os.SCHED_BATCH, skip=child.pid) == 3
        policies = {int(t): os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{child.pid}/task")}
        assert policies.pop(child.pid) == os.SCHED_OTHER
        assert set(policies.values()) == {os.SCHED_BATCH}

        assert set_policy(child.pid, os.SCHED_OTHER, skip=child.pid) == 3
        assert {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{child.pid}/task")} == {os.SCHED_OTHER}
    finally:
        child.kill()
        child.wait()


def _row(policy: str, cpu: float, requests: int, rps: float, p50: float, r: int) -> dict[str, Any]:
    return {
        "concurrency": 16,
        "kind": "body",
        "picker": "inferlb",
        "policy": policy,
        "round": r,
        "picker_cpu_us": cpu,
        "requests": requests,
        "rps": rps,
        "p50_ms": p50,
        "p99_ms": 2 * p50,
    }


def test_the_summary_weighs_cpu_by_requests_and_puts_batch_over_normal() -> None:
    rows = [
        _row("batch", 400.0, 3000, 2000.0, 8.0, 0),
        _row("batch", 500.0, 1000, 1800.0, 9.0, 1),
        _row("batch", 420.0, 2000, 1900.0, 7.0, 2),
        _row("normal", 600.0, 2000, 1500.0, 10.0, 0),
        _row("normal", 600.0, 2000, 1500.0, 11.0, 1),
        _row("normal", 600.0, 2000, 1500.0, 12.0, 2),
    ]
    batch, normal = summarise(rows)

    assert (batch["policy"], normal["policy"]) == ("batch", "normal")
    assert batch["picker_cpu_us"] == pytest.approx((400 * 3000 + 500 * 1000 + 420 * 2000) / 6000)
    assert batch["rps"] == pytest.approx(1900.0)
    assert batch["p50_ms"] == 8.0  # the median run's
    assert batch["picker_cpu_us_to_normal"] == pytest.approx(batch["picker_cpu_us"] / 600.0)
    assert batch["rps_to_normal"] == pytest.approx(1900.0 / 1500.0)
    assert "picker_cpu_us_to_normal" not in normal
    text = _markdown(
        {
            "meta": {"date": "d", "command": "c", "cpus": 2, "cpu_model": "m", "python": "3"},
            "rows": rows,
            "summary": [batch, normal],
        }
    )
    assert "| 16 | body | inferlb | batch | 423 | 1900 | 8.00 | 16.00 | 0.71x | 1.27x | 0.73x | 0.73x |" in text
