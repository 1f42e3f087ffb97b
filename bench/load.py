"""Closed-loop HTTP load with wrk (C, epoll: cheap enough not to hide the gateway's own cost) and the CPU
time a process spent meanwhile."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from importlib.resources import as_file, files


class LoadError(RuntimeError):
    """The load generator is missing or failed."""


@dataclass(frozen=True, slots=True)
class LoadResult:
    requests: int
    duration_s: float
    errors: int
    p50_us: float
    p90_us: float
    p99_us: float
    mean_us: float

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0


def run_wrk(url: str, *, connections: int, duration_s: float, method: str = "GET", body: str = "") -> LoadResult:
    """Run wrk with one thread and ``connections`` connections for ``duration_s`` seconds."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise LoadError("wrk not found: `apt-get install wrk` (make bench does it)")
    with as_file(files("inferlb.bench").joinpath("wrk.lua")) as script:
        argv = [wrk, "-t1", f"-c{connections}", f"-d{duration_s:g}s", "--timeout", "10s", "-s", str(script), url]
        env = {**os.environ, "BENCH_METHOD": method, "BENCH_BODY": body}
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=duration_s + 60, check=False)
    if done.returncode != 0:
        raise LoadError(f"wrk failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return LoadResult(
        requests=summary["requests"],
        duration_s=summary["duration_us"] / 1e6,
        errors=summary["socket_errors"] + summary["status_errors"],
        p50_us=summary["p50_us"],
        p90_us=summary["p90_us"],
        p99_us=summary["p99_us"],
        mean_us=summary["mean_us"],
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        # The command name (field 2) may hold spaces; the fields after it are space-separated.
        fields = f.read().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")
