"""The picker's side of the OTLP receiver: runs the receiver process (otel/receiverproc.py), keeps it running,
and feeds the records it sends to a `SpanJoiner` on the event loop without ever holding the loop long.

- The process is started with one end of a socket pair; `SpanFeed.start` waits for it to listen (READY) and
  raises ``OSError`` if it cannot. If it dies later, that is logged and it is started again after a backoff
  (``restart_delay_s``, doubling to ``max_restart_delay_s``, back to the start after a process that lived a
  minute); routing goes on meanwhile, without new spans. The same port is bound again, so senders need no change.
- Reading is asyncio's (non-blocking). The picker decodes no protobuf: it gets compact records
  (otel/spanwire.py), at most `BATCH_RECORDS` per frame, and joins them in slices of at most ``slice_records``
  records and about ``slice_s`` seconds, yielding to the event loop after each slice and each frame, so routing
  waits for one slice at most, however large the export was (`max_slice` records the largest slice). While it
  joins, it does not read: a backlog stays in the socket and the receiver process, which refuses exports when
  the picker is too far behind.
- `update` hands new settings (allowlist, token, bounds) to the running process, or restarts it when a gRPC
  server option changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sys
import time
from dataclasses import replace
from typing import Any

from inferlb.otel.receiver import ReceiverStats, SpanJoiner
from inferlb.otel.spanwire import Kind, ReceiverSettings, WireError, decode_records, encode_json, read_frame
from inferlb.scorer.networks import IPAddress, unmapped

__all__ = ["SpanFeed"]

logger = logging.getLogger(__name__)

_STEADY_S = 60.0  # a process that lived this long resets the restart backoff
_STOP_S = 2.0


class _Child:
    __slots__ = ("proc", "reader", "started", "writer")

    def __init__(
        self, proc: asyncio.subprocess.Process, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.proc, self.reader, self.writer = proc, reader, writer
        self.started = time.monotonic()


class SpanFeed:
    """One receiver process and the pipe from it; event-loop owned. ``stats`` are the joiner's `ReceiverStats`
    (the process's counters are added to it as they come). `start`/`stop` run it; `update` changes its settings."""

    def __init__(
        self,
        settings: ReceiverSettings,
        joiner: SpanJoiner,
        *,
        slice_records: int = 64,
        slice_s: float = 0.0005,
        start_timeout_s: float = 30.0,
        restart_delay_s: float = 0.5,
        max_restart_delay_s: float = 30.0,
    ) -> None:
        self.settings, self.joiner = settings, joiner
        self.slice_records, self.slice_s = slice_records, slice_s
        self.start_timeout_s = start_timeout_s
        self.restart_delay_s, self.max_restart_delay_s = restart_delay_s, max_restart_delay_s
        self.port: int | None = None
        self.max_slice = 0
        """The most records joined between two yields to the event loop (at most ``slice_records``)."""
        self.slices = 0
        """Yields to the event loop while joining records."""
        self._child: _Child | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._replacing = False  # update() stopped the process on purpose: start the next one at once
        self._broken_records = 0

    @property
    def stats(self) -> ReceiverStats:
        return self.joiner.stats

    @property
    def pid(self) -> int | None:
        """The receiver process now running (None between two)."""
        return self._child.proc.pid if self._child is not None else None

    async def start(self) -> int:
        """Start the receiver process; its port once it listens. OSError if it cannot listen or start."""
        self._stopping = False
        child = await self._launch()
        self._task = asyncio.get_running_loop().create_task(self._supervise(child), name="otlp receiver")
        return self.port or 0

    async def stop(self) -> None:
        """Stop the process (it exits when its end of the socket closes; killed if it lingers). Idempotent."""
        self._stopping = True
        child, self._child = self._child, None
        if child is not None:
            await _end(child)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def update(self, settings: ReceiverSettings) -> None:
        """Use ``settings`` from now on: sent to the running process, or, when ``bind`` or another gRPC option
        changed, taken by a new one (the old is stopped; the supervisor starts the new one at once)."""
        if self.port is not None:
            settings = replace(settings, bind=_with_port(settings.bind, self.port))
        old, self.settings = self.settings, settings
        child = self._child
        if child is None:
            return  # not running, or between two processes: the next one gets these settings
        if old.restart_needed(settings):
            self._replacing = True
            child.writer.close()  # the process stops its server and exits; the supervisor starts the next
            return
        with contextlib.suppress(ConnectionError):
            child.writer.write(encode_json(Kind.SETTINGS, settings.to_json()))

    async def _launch(self) -> _Child:
        parent, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "inferlb.otel.receiverproc",
                "--fd",
                str(theirs.fileno()),
                "--log-level",
                logging.getLevelName(logging.getLogger("inferlb").getEffectiveLevel()),
                pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        child = _Child(proc, reader, writer)
        sent = self.settings
        try:
            writer.write(encode_json(Kind.SETTINGS, sent.to_json()))
            kind, payload = await asyncio.wait_for(read_frame(reader), self.start_timeout_s)
            document = json.loads(payload)
            if kind == Kind.FAILED:
                raise OSError(str(document.get("error", "the OTLP receiver process failed")))
            if kind != Kind.READY or not isinstance(document.get("port"), int):
                raise WireError(f"{kind.name} instead of READY")
        except BaseException as exc:  # cancelled too: the process must not outlive its start
            await _end(child)
            if isinstance(exc, OSError) or not isinstance(exc, Exception):
                raise
            raise OSError(f"the OTLP receiver process did not start: {exc!r}") from None
        if self.port is None:
            self.port = document["port"]
            # Later processes bind the same port: the servers' exporters keep their endpoint.
            self.settings = replace(self.settings, bind=_with_port(self.settings.bind, document["port"]))
        elif self.settings != sent:  # update() came while this process was starting
            if sent.restart_needed(self.settings):
                # Settings this process cannot take (a gRPC option such as the message limit): it ends at once,
                # and the supervisor starts the next with them.
                self._replacing = True
                writer.close()
            else:
                writer.write(encode_json(Kind.SETTINGS, self.settings.to_json()))
        self._child = child
        return child

    async def _supervise(self, child: _Child) -> None:
        delay = self.restart_delay_s  # before the next start after a death; doubles while deaths come quickly
        while True:
            await self._pump(child)
            self._child = None
            await _end(child)
            if self._stopping:
                return
            lived = time.monotonic() - child.started
            if lived >= _STEADY_S:
                delay = self.restart_delay_s
            replaced, self._replacing = self._replacing, False
            if replaced:
                wait = 0.0
                logger.info("restarting the OTLP receiver process with new settings")
            else:
                wait = delay
                delay = min(delay * 2, self.max_restart_delay_s)
                logger.error(
                    "the OTLP receiver process %d ended (exit status %s) after %.0f s; starting another in %.1f s",
                    child.proc.pid,
                    child.proc.returncode,
                    lived,
                    wait,
                )
            while True:
                await asyncio.sleep(wait)
                try:
                    child = await self._launch()
                    break
                except Exception as exc:  # whatever it was, routing goes on and the next try comes
                    wait, delay = delay, min(delay * 2, self.max_restart_delay_s)
                    logger.error("the OTLP receiver process could not start again (%s); next try in %.1f s", exc, wait)
            if not replaced:
                self.stats.restarts += 1
            logger.info("the OTLP receiver process %d listens again on port %s", child.proc.pid, self.port)

    async def _pump(self, child: _Child) -> None:
        """Read and join until the process's end closes or breaks the protocol."""
        try:
            while True:
                kind, payload = await read_frame(child.reader)
                if kind == Kind.RECORDS:
                    await self._join(payload)
                elif kind == Kind.STATS:
                    self.stats.add(_mapping(json.loads(payload)))
                else:
                    raise WireError(f"an unexpected {kind.name} frame")
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        except (WireError, ValueError) as exc:
            logger.error("the OTLP receiver process broke the protocol (%s); stopping it", exc)

    async def _join(self, payload: bytes) -> None:
        sender_text, records = decode_records(payload)
        sender: IPAddress | None
        try:
            sender = unmapped(sender_text)
        except ValueError:
            sender = None
        add, limit, count = self.joiner.add, self.slice_records, 0
        clock, budget = time.perf_counter, self.slice_s
        began = clock()
        for record in records:
            try:
                add(sender, record)
            except Exception:  # a bug of ours must not end the feed: count it, log the first
                self._broken_records += 1
                self.stats.malformed += 1
                if self._broken_records == 1:
                    logger.exception("a span record could not be joined (further ones are only counted)")
            count += 1
            # The clock is read every 16 records: the time cap holds even if joining a record became slow.
            if count >= limit or (count % 16 == 0 and clock() - began >= budget):
                self._yielded(count)
                count = 0
                await asyncio.sleep(0)
                began = clock()
        self._yielded(count)
        await asyncio.sleep(0)  # even a small frame: the next may already be buffered, and reading it would not yield

    def _yielded(self, count: int) -> None:
        self.slices += 1
        if count > self.max_slice:
            self.max_slice = count


async def _end(child: _Child) -> None:
    """Close the pipe (the process exits on its own) and wait for it; kill it if it lingers."""
    with contextlib.suppress(Exception):
        child.writer.close()
    if child.proc.returncode is None:
        try:
            await asyncio.wait_for(child.proc.wait(), _STOP_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                child.proc.kill()
            await child.proc.wait()


def _with_port(bind: str, port: int) -> str:
    return f"{bind.rpartition(':')[0]}:{port}"


def _mapping(document: Any) -> dict[str, Any]:
    if not isinstance(document, dict):
        raise WireError(f"a STATS frame that is not an object: {type(document).__name__}")
    return document
