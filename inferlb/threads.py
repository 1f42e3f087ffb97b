"""The picker's helper threads yield to its event loop: they run under Linux's SCHED_BATCH policy.

gRPC's asyncio server polls its completion queue in a thread of its own, and its event engine keeps a pool of
threads; the poller wakes about ten times a request (each completed read, write and call), to hand the event to the
event loop. Under the normal policy a woken thread preempts the thread running on its core: on a core it shares
with the event loop, every wake-up interrupts the loop in the middle of a request, only to find the GIL held and
wait for it, two context switches and a cold cache for nothing. A thread under SCHED_BATCH never preempts on
wake-up: it runs when the loop blocks (in epoll, letting go of the GIL) or its time slice ends, and it keeps its
fair share of the CPU. On two cores shared with Envoy and the load (bench/results/helperthreads.md, `inferlb bench
helperthreads`) the default picker's CPU a request fell by 15-28% at concurrency 16 and 64 (8-13% at 1), its
throughput rose 11-35%, and its p50 and p99 fell or stayed.

Threads inherit their creator's policy (glibc's default), so the threads those threads start later are batched
too, and those the event loop's thread starts (`asyncio.to_thread`) are not.
"""

from __future__ import annotations

import os
import threading

__all__ = ["batch_other_threads", "set_policy"]


def batch_other_threads() -> str | None:
    """Put every thread of this process but the calling one under SCHED_BATCH (nice unchanged); None, or why not
    (not Linux, or the system refused, and the threads not reached yet keep the normal policy: lowering one's own
    threads needs no privilege, but a sandbox may forbid the call)."""
    if not hasattr(os, "sched_setscheduler") or not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"):
        return "thread scheduling policies are Linux's"
    try:
        set_policy(os.getpid(), os.SCHED_BATCH, skip=threading.get_native_id())
    except OSError as exc:
        return f"SCHED_BATCH refused: {exc.strerror or exc}"
    return None


def set_policy(pid: int, policy: int, *, skip: int) -> int:
    """Every thread of process ``pid`` but thread ``skip`` under scheduling ``policy`` (Linux); how many were set.
    Raises ``OSError`` if the system refuses (a thread that ends meanwhile is passed over)."""
    count = 0
    for name in os.listdir(f"/proc/{pid}/task"):
        tid = int(name)
        if tid == skip:
            continue
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        count += 1
    return count
