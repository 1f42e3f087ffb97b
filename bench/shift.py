"""How fast traffic moves off a server that turns slow.

    inferlb bench shift --out bench/results [--policy default]

Four emulated H100 servers behind Envoy and the picker (with the span loop on), an open-loop stream of
requests with unshared prompts at a steady rate; after ``--before`` seconds server 0 is slowed 5x through its
admin endpoint. Per 1-second window of send time it reports the share of requests routed to server 0, and the
time from the slow-down until the end of the first window whose share is below half the share before, and the
mean share over the rest of the run. Each policy's result goes to ``shift-POLICY.json``; ``shift.json`` and
``shift.md`` sum up the policies found there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from inferlb.bench.report import header, table, write
from inferlb.bench.stats import mean
from inferlb.sim.replay import ClientRecord, Shot, replay
from inferlb.stack import LocalStack, StackOptions

__all__ = ["add_arguments", "run"]

MODEL = "m"


async def _run(stack: LocalStack, rate: float, before: float, after: float) -> tuple[list[ClientRecord], float]:
    rng = random.Random(5)
    shots: list[Shot] = []
    t = 0.0
    while t < before + after:
        t += rng.expovariate(rate)
        # Each prompt starts differently, so that no server holds a prefix the others lack: this measures a shift of
        # load, not prefix affinity (with one shared prefix, the default keeps it on the servers that cache it).
        prompt = f"request {len(shots)}: " + "p" * rng.randrange(1_000, 6_000)
        shots.append(Shot(f"r{len(shots)}", t, stack.gateway_url, MODEL, prompt, 40))
    slow = stack.endpoints[0]

    async def slow_down() -> float:
        await asyncio.sleep(before)
        async with httpx.AsyncClient(timeout=5) as client:
            await client.post(f"http://{slow}/admin/faults", json={"slowdown": 5})
        return time.monotonic()

    started = time.monotonic()
    fault = asyncio.create_task(slow_down())
    records = await replay(shots, timeout_s=120)
    return records, (await fault) - started


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--policy", default="default")
    parser.add_argument("--rate", type=float, default=16.0, help="requests per second")
    parser.add_argument("--before", type=float, default=10.0, help="seconds of load before the slow-down")
    parser.add_argument("--after", type=float, default=20.0, help="seconds of load after it")


def run(args: argparse.Namespace) -> int:
    options = StackOptions(backends=4, models=(MODEL,), policy=args.policy, spans=True)
    with tempfile.TemporaryDirectory() as folder, LocalStack(options, Path(folder)) as stack:
        records, slowed_at = asyncio.run(_run(stack, args.rate, args.before, args.after))
        slow = stack.endpoints[0]
    first = min(r.sent_at for r in records)
    windows: dict[int, list[bool]] = {}
    for r in records:
        if r.error is None:
            windows.setdefault(int(r.sent_at - first), []).append(r.server == slow)
    shares = {second: sum(v) / len(v) for second, v in sorted(windows.items())}
    share_before = mean(s for second, s in shares.items() if second < int(slowed_at))
    if share_before is None:
        print("inferlb bench shift: error: no request succeeded before the slow-down", file=sys.stderr)
        return 1
    settle = None
    for second in sorted(shares):
        if second >= int(slowed_at) and shares[second] < share_before / 2:
            settle = second + 1 - slowed_at  # the end of the first window below half
            break
    share_after = mean(s for k, s in shares.items() if k >= int(slowed_at) + 1)
    report: dict[str, Any] = {
        **header(args.command),
        "policy": args.policy,
        "rate_rps": args.rate,
        "slowed_at_s": round(slowed_at, 2),
        "share_before": round(share_before, 3),
        "share_after": round(share_after or 0.0, 3),
        "settle_s": None if settle is None else round(settle, 1),
        "errors": sum(r.error is not None for r in records),
        "shares": {str(k): round(v, 3) for k, v in shares.items()},
    }
    write(args.out, f"shift-{args.policy}", report)
    print(json.dumps({k: v for k, v in report.items() if k != "shares"}))
    print(" ".join(f"{k}:{v:.2f}" for k, v in shares.items()))
    _summary(args.out)
    return 0


def _summary(out: Path) -> None:
    """``shift.json`` and ``shift.md``: every policy's run found in ``out`` (their shares left out)."""
    rows = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(out.glob("shift-*.json"))]
    lines = [
        "# Traffic shift after a server turns 5x slower",
        "",
        "4 emulated H100 servers, open-loop requests at a steady rate, server 0 slowed 5x through its admin",
        "endpoint after 10 s. Share = requests sent to server 0, by 1-second window of send time.",
        "",
    ]
    head = ["policy", "date", "rate req/s", "share before", "share after", "first window below half, s after"]
    cells = ["policy", "date", "rate_rps", "share_before", "share_after"]
    body = ([*(r[k] for k in cells), "never" if r["settle_s"] is None else r["settle_s"]] for r in rows)
    lines += table(head, body, "llrrrr")
    lines += ["", f"Command: `{_any_policy(rows[0]['command'])}`; {rows[0]['machine']}.", ""]
    write(out, "shift", [{k: v for k, v in r.items() if k != "shares"} for r in rows], "\n".join(lines))


def _any_policy(command: str) -> str:
    """``command`` with its ``--policy X`` (wherever it stands) as ``--policy NAME`` at the end."""
    words = shlex.split(command)
    kept = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word == "--policy":
            skip = True
        elif not word.startswith("--policy="):
            kept.append(word)
    return shlex.join([*kept, "--policy", "NAME"])


if __name__ == "__main__":
    from inferlb.bench.suites import script

    raise SystemExit(script(sys.modules[__name__]))
