"""The resilience benchmark's load: an open-loop stream of streamed completions, run as its own process so that
its CPU is not the gateway's, recording how every request ended.

    python -m inferlb.bench.faultload --url URL --model M --rate 150 --duration-s 30 --out records.jsonl

Requests leave at Poisson times at ``--rate`` per second for ``--duration-s`` seconds (bounded: the count is
``rate * duration`` at most, and each request is bounded by ``--timeout-s``). Most answers are short; a share
(``--long-share``) are long streams, the ones a fault could cut. One JSON line per request: ``request_id``
(Envoy's ``x-request-id``, to join its access log), ``sent`` (Unix seconds), ``status`` (0: no response),
``events`` (``data:`` lines), ``done`` (the stream ended with ``[DONE]``), ``cut`` (a 200 whose stream broke off),
``ttft_s``, ``e2e_s``, ``server`` and ``error``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

__all__ = ["main", "run_load"]


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], at: float) -> dict[str, Any]:
    delay = at - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    record: dict[str, Any] = {
        "request_id": "",
        "sent": time.time(),
        "status": 0,
        "events": 0,
        "done": False,
        "cut": False,
        "ttft_s": None,
        "e2e_s": None,
        "server": "",
        "error": None,
        "max_tokens": body["max_tokens"],
    }
    sent = time.monotonic()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            record["status"] = response.status_code
            record["request_id"] = response.headers.get("x-request-id", "")
            record["server"] = response.headers.get("x-inferlb-sim-server", "")
            if response.status_code != 200:
                record["error"] = (await response.aread())[:300].decode("utf-8", "replace")
                return record
            try:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if record["events"] == 0:
                        record["ttft_s"] = time.monotonic() - sent
                    record["events"] += 1
                    record["done"] = line == "data: [DONE]"
            except httpx.HTTPError as exc:
                record["error"] = f"{type(exc).__name__}: {exc}"
            record["cut"] = not record["done"]
    except httpx.HTTPError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["e2e_s"] = time.monotonic() - sent
    return record


async def run_load(
    url: str,
    model: str,
    *,
    rate: float,
    duration_s: float,
    seed: int = 1,
    long_share: float = 0.1,
    short_tokens: int = 16,
    long_tokens: int = 300,
    timeout_s: float = 120.0,
) -> list[dict[str, Any]]:
    """Send the load and return one record per request, in send order."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), transport=transport) as client:
        start = time.monotonic() + 0.2
        tasks: list[asyncio.Task[dict[str, Any]]] = []
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= duration_s:
                break
            tokens = long_tokens if rng.random() < long_share else short_tokens
            # Unshared prompts of a few hundred tokens: a load shift, not prefix affinity.
            prompt = f"request {len(tasks)} " + "w " * rng.randrange(100, 600)
            body = {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True}
            tasks.append(asyncio.create_task(_one(client, url, body, start + t)))
        return list(await asyncio.gather(*tasks))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rate", type=float, required=True, help="requests per second")
    parser.add_argument("--duration-s", type=float, required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--long-share", type=float, default=0.1)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=300)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not 0 < args.rate <= 2000 or not 0 < args.duration_s <= 7200:
        parser.error("--rate must be in (0, 2000] and --duration-s in (0, 7200]")
    records = asyncio.run(
        run_load(
            args.url,
            args.model,
            rate=args.rate,
            duration_s=args.duration_s,
            seed=args.seed,
            long_share=args.long_share,
            short_tokens=args.short_tokens,
            long_tokens=args.long_tokens,
            timeout_s=args.timeout_s,
        )
    )
    with args.out.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
