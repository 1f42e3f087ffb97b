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

__all__ = ["batch_other_threads"]


def batch_other_threads() -> str | None:
    """Put every thread of this process but the calling one under SCHED_BATCH (nice unchanged); None, or why
    nothing changed (not Linux, or the system refused: lowering one's own threads needs no privilege, but a
    sandbox may forbid the call)."""
    setter = getattr(os, "sched_setscheduler", None)
    batch = getattr(os, "SCHED_BATCH", None)
    if setter is None or batch is None or not os.path.isdir("/proc/self/task"):
        return "thread scheduling policies are Linux's"
    me = threading.get_native_id()
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid == me:
            continue
        try:
            setter(tid, batch, os.sched_param(0))
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as exc:
            return f"SCHED_BATCH refused for thread {tid}: {exc.strerror or exc}"
    return None
