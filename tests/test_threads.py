"""The picker's helper threads run under SCHED_BATCH, so that their wake-ups do not preempt the event loop: the
policy on every thread but the caller's, inherited by the threads they start, and a running picker's gRPC threads
batched while its event-loop thread is not."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from inferlb import threads
from inferlb.procs import free_port

from .conftest import probe_running_picker

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="scheduling policies are Linux's")


@pytest.fixture
def restored() -> Iterator[None]:
    """This test process's threads get back the policies they had: the rest of the session runs as before."""
    before = {}
    for name in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            before[int(name)] = os.sched_getscheduler(int(name))
    yield
    for tid, policy in before.items():
        with contextlib.suppress(OSError):
            os.sched_setscheduler(tid, policy, os.sched_param(0))


def _waiting_thread(stop: threading.Event) -> threading.Thread:
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    return thread


def test_every_thread_but_the_callers_is_batched(restored: None) -> None:
    stop = threading.Event()
    helpers = [_waiting_thread(stop) for _ in range(3)]
    try:
        assert threads.batch_other_threads() is None

        for helper in helpers:
            assert helper.native_id is not None
            assert os.sched_getscheduler(helper.native_id) == os.SCHED_BATCH
        assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        stop.set()


def test_a_thread_started_by_a_batched_thread_is_batched_and_one_the_caller_starts_is_not(restored: None) -> None:
    started = threading.Event()
    policies: dict[str, int] = {}

    def spawner() -> None:
        started.wait()
        child = threading.Thread(target=lambda: policies.update(child=os.sched_getscheduler(0)))
        child.start()
        child.join()

    spawning = threading.Thread(target=spawner, daemon=True)
    spawning.start()
    try:
        assert threads.batch_other_threads() is None
    finally:
        started.set()
    spawning.join(30)
    later = threading.Thread(target=lambda: policies.update(later=os.sched_getscheduler(0)))
    later.start()
    later.join(30)
    assert policies == {"child": os.SCHED_BATCH, "later": os.SCHED_OTHER}


def test_a_refusal_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    stop = threading.Event()
    _waiting_thread(stop)

    def refuse(tid: int, policy: int, param: os.sched_param) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(threads.os, "sched_setscheduler", refuse)
    try:
        why = threads.batch_other_threads()
    finally:
        stop.set()
    assert why is not None and "SCHED_BATCH refused" in why and "Operation not permitted" in why


def test_without_scheduling_policies_nothing_is_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(threads.os, "sched_setscheduler")
    assert threads.batch_other_threads() == "thread scheduling policies are Linux's"


# Inside a running picker: each thread's policy and name, and which thread is the event loop's (the caller's).
POLICIES = """
    policies = {}
    for name in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{name}/comm") as comm:
            policies[name] = [os.sched_getscheduler(int(name)), comm.read().strip()]
    with open(out, "w") as f:
        json.dump({"loop": str(threading.get_native_id()), "threads": policies}, f)
"""


def test_a_running_pickers_grpc_threads_are_batched_and_its_event_loop_is_not(tmp_path: Path) -> None:
    config = {
        "listen": f"127.0.0.1:{free_port()}",
        "drain_s": 0,
        "pool": {"endpoints": [{"address": f"127.0.0.1:{free_port()}"}]},
    }
    path = tmp_path / "picker.yaml"
    path.write_text(yaml.safe_dump(config))
    found = probe_running_picker(path, tmp_path / "threads.json", POLICIES)
    loop = found["loop"]
    others = {tid: policy for tid, (policy, _) in found["threads"].items() if tid != loop}

    assert found["threads"][loop][0] == os.SCHED_OTHER
    assert others, "gRPC's asyncio server runs threads of its own"
    assert set(others.values()) == {os.SCHED_BATCH}, found["threads"]
