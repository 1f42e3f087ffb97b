"""What the worst request bodies cost the picker: ``apply_body`` alone, in process, CPU time per body.

    inferlb bench bodycost --out bench/results [--before REV] [--quick]

Each body fills ``max_body_bytes`` (4 MiB by default; also measured at a quarter of it, to show the cost is
linear) with one shape: a prompt of token ids (as orjson, as Python's json module, as one list, as many small
lists), a long string, many short strings, many chat messages or parts, a long model name, and unread fields
full of small containers. CPU time is ``time.process_time`` around one ``apply_body`` (the document's freeing
included), the best of several runs; µs/KiB is that over the body's size.

``--before REV`` measures the same bodies with ``filter/request.py``, ``filter/errors.py``,
``scorer/features.py`` and ``scorer/errors.py`` as they are at git revision REV (read with ``git archive``, in a
child process), for a before/after table. Writes ``bodycost.json`` and ``bodycost.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import io
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from inferlb.bench.report import header, table, write
from inferlb.bench.stats import percentile

__all__ = ["BODIES", "add_arguments", "measure", "run"]

MAX_BODY_BYTES = 4 << 20  # the default max_body_bytes
# The modules whose code decides a body's cost, in the order they import one another.
MODULES = ("scorer/errors.py", "scorer/features.py", "filter/errors.py", "filter/request.py")


@dataclass(frozen=True, slots=True)
class Body:
    name: str
    shape: str  # what the body holds, for the report
    make: Callable[[int], bytes]  # a body of at most that many bytes, as close to it as the shape allows


def _fill(head: bytes, item: bytes, tail: bytes, size: int, sep: bytes = b",") -> bytes:
    """``head`` + ``item`` repeated (joined by ``sep``) + ``tail``, at most ``size`` bytes."""
    count = max((size - len(head) - len(tail) + len(sep)) // (len(item) + len(sep)), 1)
    return head + sep.join([item] * count) + tail


def _ids(size: int, sep: bytes = b",", last: bytes = b"") -> bytes:
    """Token ids below 50,000 in a varied order, joined by ``sep``, about ``size`` bytes, then ``last``."""
    chunk = sep.join(b"%d" % (i * 7919 % 50_000) for i in range(1000))
    joined = sep.join([chunk] * max(size // (len(chunk) + len(sep)), 1))
    return joined + last


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


BODIES = (
    Body("token ids", "`[17,2043,…]`, as orjson or JavaScript write it", lambda n: _ids_body(n, b",")),
    Body("token ids, spaced", "`[17, 2043, …]`, as Python's json module writes it", lambda n: _ids_body(n, b", ")),
    Body("token ids, one list", "`[[17,2043,…]]`", lambda n: b'{"model":"m","prompt":[[' + _ids(n - 30) + b"]]}"),
    Body("token ids, many lists", "`[[17],[2043],…]`", lambda n: _fill(b'{"model":"m","prompt":[', b"[7]", b"]}", n)),
    Body(
        "token ids, near miss",
        "token ids, the last of 19 digits: valid, but left to the full parse",
        lambda n: b'{"model":"m","prompt":[' + _ids(n - 60, b",", b",1000000000000000000") + b"]}",
    ),
    Body(
        "token ids, many lists, near miss",
        "`[[17],[2043],…]`, the last id of 19 digits",
        lambda n: _fill(b'{"model":"m","prompt":[', b"[7]", b",[1000000000000000000]]}", n - 30),
    ),
    Body("string prompt", "one string", lambda n: _fill(b'{"model":"m","prompt":"', b"x", b'"}', n, b"")),
    Body("short strings", '`["…40 characters…", …]` (100k at 4 MiB)', lambda n: _strings(n, 38)),
    Body("tiny strings", '`["a","a",…]`', lambda n: _strings(n, 1)),
    Body(
        "chat messages",
        '`{"role":"user","content":"…"}` (100k at 4 MiB)',
        lambda n: _fill(b'{"model":"m","messages":[', b'{"role":"user","content":"hello there"}', b"]}", n),
    ),
    Body(
        "tiny chat messages",
        "`[{},{},…]`, empty messages",
        lambda n: _fill(b'{"model":"m","messages":[', b"{}", b"]}", n),
    ),
    Body(
        "content parts",
        'one message of `{"type":"text","text":"a"}` parts',
        lambda n: _fill(
            b'{"model":"m","messages":[{"role":"user","content":[', b'{"type":"text","text":"a"}', b"]}]}", n
        ),
    ),
    Body(
        "multi-part messages",
        'messages of one `{"type":"text","text":"…"}` part each',
        lambda n: _fill(
            b'{"model":"m","messages":[', b'{"role":"user","content":[{"type":"text","text":"hello"}]}', b"]}", n
        ),
    ),
    Body("model name", "a model name of the body's size", lambda n: _fill(b'{"model":"', b"m", b'"}', n, b"")),
    Body("deep nesting, unread", "`[[[…]]]` 1,000 deep, repeated", lambda n: _unread(n, _deep(1000))),
    Body("empty lists, unread", "`[[],[],…]` in a field the picker does not read", lambda n: _unread(n, b"[]")),
    Body("empty objects, unread", "`[{},{},…]` in a field the picker does not read", lambda n: _unread(n, b"{}")),
    Body("numbers, unread", "`[7,7,…]` in a field the picker does not read", lambda n: _unread(n, b"7")),
)


def _ids_body(size: int, sep: bytes) -> bytes:
    return b'{"model":"m","prompt":[' + _ids(size - 30, sep) + b"]}"


def _strings(size: int, chars: int) -> bytes:
    return _fill(b'{"model":"m","prompt":[', b'"' + b"a" * chars + b'"', b"]}", size)


def _unread(size: int, item: bytes) -> bytes:
    return _fill(b'{"model":"m","prompt":"hello","x":[', item, b"]}", size)


def measure(
    apply_body: Callable[..., None], features: Callable[[], Any], sizes: tuple[int, ...], budget_s: float
) -> list[dict[str, Any]]:
    """Per body and size: bytes, the best and median CPU ms of one ``apply_body`` (at least 3 runs, more while
    within ``budget_s``), µs per KiB, and what the body became."""
    rows = []
    for body in BODIES:
        for size in sizes:
            data = body.make(size)
            outcome = _outcome(apply_body, features, data)
            times: list[float] = []
            spent = 0.0
            while len(times) < 3 or (spent < budget_s and len(times) < 50):
                gc.collect()  # each run starts from the same collector state
                start = time.process_time()
                with contextlib.suppress(Exception):  # a refused body is measured too
                    apply_body(features(), data, complete=True, max_bytes=MAX_BODY_BYTES)
                times.append(time.process_time() - start)
                spent += times[-1]
            best = min(times)
            middle = percentile(times, 50, method="higher")  # of an even count, the upper of the middle two
            rows.append(
                {
                    "name": body.name,
                    "shape": body.shape,
                    "bytes": len(data),
                    "ms": round(best * 1e3, 2),
                    "median_ms": None if middle is None else round(middle * 1e3, 2),
                    "us_per_kib": round(best * 1e6 / (len(data) / 1024), 2),
                    "runs": len(times),
                    "outcome": outcome,
                }
            )
            print(f"  {body.name:<24} {len(data) / 2**20:5.2f} MiB  {best * 1e3:8.2f} ms  {outcome}", flush=True)
    return rows


def _outcome(apply_body: Callable[..., Any], features: Callable[[], Any], data: bytes) -> str:
    result = features()
    try:
        apply_body(result, data, complete=True, max_bytes=MAX_BODY_BYTES)
    except Exception as exc:  # the report says how a body is refused
        return f"{getattr(exc, 'status', type(exc).__name__)}: {str(exc)[:60]}"
    return f"ok, {result.prompt_tokens} prompt tokens"


def _load(code: Path) -> tuple[Callable[..., None], Callable[[], Any]]:
    """``apply_body`` and ``RequestFeatures`` from the copies of ``MODULES`` under ``code`` (registered under
    their package names first, so that they import one another and nothing else of the tree)."""
    modules: dict[str, ModuleType] = {}
    for path in MODULES:
        name = "inferlb." + path.removesuffix(".py").replace("/", ".")
        spec = importlib.util.spec_from_file_location(name, code / path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {code / path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = modules[path] = module
        spec.loader.exec_module(module)
    return modules["filter/request.py"].apply_body, modules["scorer/features.py"].RequestFeatures


def _before(revision: str, sizes: tuple[int, ...], budget_s: float) -> list[dict[str, Any]]:
    """``measure`` in a child process on the ``MODULES`` of git ``revision``."""
    archive = subprocess.run(["git", "archive", revision, *MODULES], capture_output=True, check=True).stdout
    with tempfile.TemporaryDirectory(prefix="inferlb-bodycost-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        result = Path(tmp) / "before.json"
        command = [sys.executable, "-m", "inferlb.bench.bodycost", "--code", tmp, "--rows", str(result)]
        command += ["--sizes", *map(str, sizes), "--budget-s", str(budget_s)]
        subprocess.run(command, check=True)
        rows: list[dict[str, Any]] = json.loads(result.read_text(encoding="utf-8"))
        return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--before", metavar="REV", help="also measure the code at this git revision")
    parser.add_argument("--quick", action="store_true", help="one size (1 MiB), the fewest runs")
    parser.add_argument("--budget-s", type=float, default=0.5, help="CPU seconds per body and size, at most")
    parser.add_argument("--sizes", type=int, nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--code", type=Path, help=argparse.SUPPRESS)  # the child of --before
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    sizes = tuple(args.sizes or ((1 << 20,) if args.quick else (MAX_BODY_BYTES // 4, MAX_BODY_BYTES)))
    budget_s = 0.0 if args.quick else args.budget_s
    if args.code is not None:
        old_apply_body, old_features = _load(args.code)
        rows = measure(old_apply_body, old_features, sizes, budget_s)
        args.rows.write_text(json.dumps(rows) + "\n", encoding="utf-8")
        return 0

    from inferlb.filter.request import apply_body
    from inferlb.scorer.features import RequestFeatures

    print("apply_body, this tree ...", flush=True)
    rows = measure(apply_body, RequestFeatures, sizes, budget_s)
    if args.before:
        print(f"apply_body at {args.before} ...", flush=True)
        for row, old in zip(rows, _before(args.before, sizes, budget_s), strict=True):
            row["before_ms"], row["before_us_per_kib"], row["before_outcome"] = (
                old["ms"],
                old["us_per_kib"],
                old["outcome"],
            )
    report = {**header(args.command), "rows": rows}
    write(args.out, "bodycost", report, _markdown(report))
    return 0


def _markdown(report: dict[str, Any]) -> str:
    rows = report["rows"]
    before = "before_ms" in rows[0]
    out = [
        "# What a request body costs the picker",
        "",
        f"{report['date']} · `{report['command']}` · {report['machine']}",
        "",
        "CPU time of one `apply_body` (parse, checks, token estimate, prefix hashes, and freeing the document),",
        "in process, the best of several runs; µs/KiB is that over the body's size. Each body fills the size",
        "shown with one shape; at 4 MiB it is the largest body the default `max_body_bytes` admits.",
        "",
        "A prompt of token ids is counted in the raw bytes; converting and hashing its head (the first",
        "`MAX_PREFIX_BLOCKS` blocks) costs the same at any size, so its µs/KiB falls as the body grows. A",
        '"near miss" is a token-id body the scan leaves to the full parse (any client can force that, e.g. with',
        "a 19-digit id): it bounds what a token-id body can cost. Bodies of many small containers cost what",
        "orjson takes to build and free their objects, with the garbage collector paused meanwhile; chat",
        "messages add C passes over the messages, and multi-part ones a Python loop per message.",
        "",
    ]

    def mib(r: dict[str, Any]) -> str:
        return f"{r['bytes'] / 2**20:.2f}"

    if before:
        head = ["body", "shape", "MiB", "before ms", "now ms", "before µs/KiB", "now µs/KiB", "outcome"]
        body = (
            [
                r["name"],
                r["shape"],
                mib(r),
                f"{r['before_ms']:.1f}",
                f"{r['ms']:.1f}",
                f"{r['before_us_per_kib']:.1f}",
                f"{r['us_per_kib']:.1f}",
                r["outcome"],
            ]
            for r in rows
        )
        out += table(head, body, "llrrrrrl")
    else:
        body = ([r["name"], r["shape"], mib(r), f"{r['ms']:.1f}", f"{r['us_per_kib']:.1f}", r["outcome"]] for r in rows)
        out += table(["body", "shape", "MiB", "ms", "µs/KiB", "outcome"], body, "llrrrl")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    from inferlb.bench.suites import script

    sys.exit(script(sys.modules[__name__]))
