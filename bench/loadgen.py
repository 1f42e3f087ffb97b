"""The live benchmark's load generator, run as its own process so that its CPU is not the gateway's:

    python -m inferlb.bench.loadgen --trace FILE [--start K] --requests N --rate R --time-scale S --url URL --out FILE

Replays requests ``K`` .. ``K + N`` of the trace (default: the first ``N``) open loop, rescaled to a mean of ``R``
requests per second of model time (``S`` times faster on the wall clock, matching the emulated servers'
``--time-scale``), with the trace's synthetic prompts (equal Mooncake block ids give equal prompt prefixes). Every
request streams; one JSON line per request goes to ``--out``, times converted back to model seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from inferlb.bench.desrun import scaled
from inferlb.sim.des import Arrival
from inferlb.sim.replay import Shot, replay
from inferlb.sim.traces import load_trace, prompt_text

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--start", type=int, default=0, help="requests of the trace to skip first")
    parser.add_argument("--rate", type=float, required=True, help="mean requests per second, model time")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--url", required=True, help="the gateway's base URL")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per request, wall clock")
    args = parser.parse_args(argv)
    trace = load_trace(args.trace, limit=args.start + args.requests, spread_ticks=True)
    window = trace.requests[args.start :]
    arrivals = [Arrival(str(r.index), r.arrival_s, r.prompt_tokens, r.output_tokens) for r in window]
    shots = [
        Shot(f"r{r.index}", a.at, args.url, args.model, prompt_text(r, trace.name), r.output_tokens)
        for r, a in zip(window, scaled(arrivals, args.rate), strict=True)
    ]
    records = asyncio.run(replay(shots, time_scale=args.time_scale, timeout_s=args.timeout_s))
    scale = args.time_scale
    with args.out.open("w", encoding="utf-8") as out:
        for shot, record in zip(shots, records, strict=True):
            row = asdict(record)
            row["at"] = shot.at
            row["output_tokens_wanted"] = shot.max_tokens
            for key in ("ttft_s", "e2e_s"):
                if row[key] is not None:
                    row[key] *= scale
            out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
