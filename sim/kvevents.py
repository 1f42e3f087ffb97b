"""KV-cache events, published as vLLM publishes them, so a router can keep an exact index of each server's cache.

The wire format, as read in vLLM 0.32.0's own source (``vllm/distributed/kv_events.py``, the ``ZmqEventPublisher``
and the msgspec structs; ``vllm/v1/core/block_pool.py``, where the events are made):

- A ZMQ PUB socket sends each batch as three frames: ``[topic, seq, payload]``. ``topic`` is UTF-8 (vLLM's
  ``KVEventsConfig.topic`` defaults to ``""``); ``seq`` is the batch's sequence number, unsigned 8 bytes big-endian,
  from 0 up by one per batch; ``payload`` is msgpack.
- The payload is an ``EventBatch`` struct with ``array_like=True, omit_defaults=True``: the array
  ``[ts, events, data_parallel_rank]``, ``ts`` a float64 (Unix seconds), the rank filled in by the publisher (0
  for one engine). All three are always present: msgspec (0.23.0, the version vLLM 0.32.0 installs) writes every
  field of an array-like struct, defaults included.
- Events are msgspec structs with ``tag=True, omit_defaults=True`` and, in 0.32.0, *not* array-like: each is a map
  whose first key ``"type"`` names it, then its fields in declaration order, fields equal to their default left
  out. For a plain text model (one KV-cache group, no LoRA, no multimodal input) vLLM 0.32.0 emits:

  - ``{"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": p | None, "token_ids": [...],
    "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, ...],
    "group_idx": 0}`` — one per run of blocks one request newly cached; ``parent_block_hash`` is the hash of the
    block before the run (None for a prompt's first block); ``token_ids`` are the run's tokens (``block_size`` per
    block); ``extra_keys`` has one None per block. ``lora_id``/``lora_name`` have no default, so they are sent.
  - ``{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}`` — one event per evicted
    block.
  - ``{"type": "AllBlocksCleared"}`` — the prefix cache was reset.

  Block hashes are ints by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the low 64 bits of the SHA-256
  block hash) or bytes. The emulator sends its own 63-bit ints (`sim/tokens.py`).
- The older encoding (before vLLM changed the events to maps, vLLM PR #42892) is the same structs array-like: a
  list whose first item is the tag, then every field by position (older versions had fewer fields; readers take
  them by position and ignore the tail). ``encoding="array"`` sends that, with the fields above up to
  ``group_idx``: ``["BlockStored", hashes, parent, token_ids, block_size, None, "GPU", None, [None, ...], 0]``,
  ``["BlockRemoved", [h], "GPU", 0]``, ``["AllBlocksCleared"]``; the batch is the same array either way.
- Replay: a ROUTER socket (vLLM's ``replay_endpoint``) takes a request of one frame after the envelope, the start
  sequence number as 8 bytes big-endian (a DEALER sends ``[b"", start]``; a REQ adds the empty frame itself). It
  answers, for every buffered batch with ``seq >= start`` in order, ``[b"", topic, seq, payload]`` (the same frames
  as the live stream after the empty delimiter), then the end marker ``[b"", b"", END_SEQ, b""]`` with
  ``END_SEQ`` = -1 as 8 signed big-endian bytes (``ff`` x 8) and an empty topic. A request of another shape is
  ignored (no answer). vLLM keeps the last ``buffer_steps`` (10,000) batches.

vLLM publishes one batch per engine step that changed the cache. The emulator publishes one batch per `flush`
(the server flushes each time it brings its engine up to date, so a batch may cover several steps), split in
batches of at most ``max_batch_events`` events; a flush with no events publishes nothing.

Threading: the listener methods and `flush` run on the caller's thread (the server's event loop) and only append
and encode; a dedicated thread owns the PUB and ROUTER sockets, keeps the replay buffer and answers replays, so
the event loop never waits on a socket. Everything is bounded: the events waiting for a flush, the hand-over
queue to the thread, the replay buffer.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

__all__ = [
    "DEFAULT_TOPIC",
    "ENCODINGS",
    "END_SEQ",
    "KVEventPublisher",
    "KVEventsError",
    "KVEventsOptions",
    "encode_batch",
]

logger = logging.getLogger(__name__)

ENCODINGS = ("map", "array")
DEFAULT_TOPIC = ""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM = "GPU"
_GROUP_IDX = 0  # one KV-cache group: a plain attention model
_DP_RANK = 0
_STOP = b"stop"
_LIVE, _HIDDEN = b"1", b"0"

# Internal events: ("s", hashes, parent, token_ids), ("r", hash), ("c",). block_size is the publisher's.
_Event = tuple[Any, ...]


class KVEventsError(RuntimeError):
    """The publisher could not start (a port in use, a bad address)."""


@dataclass(frozen=True, slots=True)
class KVEventsOptions:
    """Where and how one server publishes. ``port`` is the PUB socket's TCP port on ``host``; ``replay_port``
    the ROUTER's (None: no replay). ``encoding`` is ``"map"`` (vLLM 0.32.0's) or ``"array"`` (older vLLM's).
    ``buffer_batches`` batches are kept for replay; a batch holds at most ``max_batch_events`` events; at most
    ``max_pending_events`` wait for a flush (more are dropped and counted)."""

    host: str
    port: int
    replay_port: int | None = None
    encoding: str = "map"
    topic: str = DEFAULT_TOPIC
    buffer_batches: int = 10_000
    max_batch_events: int = 1_000
    max_pending_events: int = 1_000_000

    def __post_init__(self) -> None:
        for name in ("port", "replay_port"):
            port = getattr(self, name)
            if port is not None and not 1 <= port <= 65535:
                raise ValueError(f"kv events {name} must be in 1..65535; got {port!r}")
        if self.replay_port is not None and self.replay_port == self.port:
            raise ValueError(f"kv events replay_port must differ from port; both are {self.port}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"kv events encoding must be one of {', '.join(ENCODINGS)}; got {self.encoding!r}")
        for name in ("buffer_batches", "max_batch_events", "max_pending_events"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv events {name} must be >= 1; got {getattr(self, name)!r}")


def _event_obj(event: _Event, block_size: int, encoding: str) -> object:
    kind = event[0]
    if kind == "s":
        _, hashes, parent, ids = event
        extra = [None] * len(hashes)
        if encoding == "map":
            return {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": ids,
                "block_size": block_size,
                "lora_id": None,
                "medium": MEDIUM,
                "lora_name": None,
                "extra_keys": extra,
                "group_idx": _GROUP_IDX,
            }
        return ["BlockStored", hashes, parent, ids, block_size, None, MEDIUM, None, extra, _GROUP_IDX]
    if kind == "r":
        if encoding == "map":
            return {"type": "BlockRemoved", "block_hashes": [event[1]], "medium": MEDIUM, "group_idx": _GROUP_IDX}
        return ["BlockRemoved", [event[1]], MEDIUM, _GROUP_IDX]
    return {"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]


def encode_batch(ts: float, events: Sequence[_Event], block_size: int, encoding: str = "map") -> bytes:
    """The msgpack payload of one batch, byte for byte as vLLM 0.32.0's msgspec encoder writes it (``map``)."""
    return msgpack.packb([float(ts), [_event_obj(e, block_size, encoding) for e in events], _DP_RANK])


class KVEventPublisher:
    """A `KVListener` that publishes what it hears as vLLM's KV events; see the module docstring.

    The listener methods, `flush`, `pause` and `drop_next` must be called from one thread (the owner's); `close`
    from that thread too, once (a second call does nothing). Sockets are bound in the constructor: a port in use
    raises `KVEventsError` there. Faults: while ``paused`` events are dropped unnumbered, as by a server whose
    publisher died; `drop_next` (n) numbers and buffers the next n batches but does not send them live, so a
    subscriber sees a gap that replay fills.
    """

    def __init__(self, options: KVEventsOptions, block_size: int, *, clock: Callable[[], float] = time.time) -> None:
        self.options = options
        self.block_size = block_size
        self._clock = clock
        self._pending: list[_Event] = []
        self.next_seq = 0
        self.paused = False
        self.drop_remaining = 0
        self.dropped_events = 0  # heard while paused or past max_pending_events
        self.lost_batches = 0  # numbered but not handed to the thread (its queue was full)
        self._closed = False
        self._ctx = zmq.Context()
        self._feed_address = f"inproc://kvevents-{id(self)}"
        pub = self._ctx.socket(zmq.PUB)
        router = self._ctx.socket(zmq.ROUTER) if options.replay_port is not None else None
        pull = self._ctx.socket(zmq.PULL)
        self._push = self._ctx.socket(zmq.PUSH)
        sockets = [s for s in (pub, router, pull, self._push) if s is not None]
        try:
            host = f"[{options.host}]" if ":" in options.host else options.host
            for sock in sockets:
                sock.setsockopt(zmq.LINGER, 0)
                if ":" in options.host:
                    sock.setsockopt(zmq.IPV6, 1)
            pub.setsockopt(zmq.SNDHWM, 100_000)
            pub.bind(f"tcp://{host}:{options.port}")
            if router is not None:
                # Room for a whole replay per client: ROUTER drops, silently, what passes its high-water mark.
                router.setsockopt(zmq.SNDHWM, options.buffer_batches + 1)
                router.bind(f"tcp://{host}:{options.replay_port}")
            for sock in (pull, self._push):
                sock.setsockopt(zmq.SNDHWM, options.buffer_batches)
                sock.setsockopt(zmq.RCVHWM, options.buffer_batches)
            pull.bind(self._feed_address)
            self._push.connect(self._feed_address)
        except zmq.ZMQError as exc:
            for sock in sockets:
                sock.close(linger=0)
            self._ctx.term()
            raise KVEventsError(
                f"cannot publish KV events on {options.host}:{options.port} (replay {options.replay_port}): {exc}"
            ) from exc
        self._thread = threading.Thread(
            target=_serve, args=(pub, router, pull, options), name=f"kv events {options.port}", daemon=True
        )
        self._thread.start()

    # ---- the listener ---------------------------------------------------------------------------------------

    def _add(self, event: _Event, count: int) -> None:
        if self.paused or len(self._pending) >= self.options.max_pending_events:
            self.dropped_events += count
            return
        self._pending.append(event)

    def stored(self, hashes: list[int], parent: int | None, token_ids: Sequence[int]) -> None:
        self._add(("s", hashes, parent, list(token_ids)), 1)

    def removed(self, hashes: list[int]) -> None:
        if self.paused:
            self.dropped_events += len(hashes)
            return
        for h in hashes:
            self._add(("r", h), 1)

    def cleared(self) -> None:
        self._add(("c",), 1)

    # ---- batches and faults ---------------------------------------------------------------------------------

    def flush(self) -> int:
        """Publish the events heard since the last flush, in batches of at most ``max_batch_events``; returns how
        many batches were numbered. Never blocks."""
        pending = self._pending
        if not pending or self._closed:
            return 0
        self._pending = []
        ts = self._clock()
        size = self.options.max_batch_events
        batches = 0
        for start in range(0, len(pending), size):
            payload = encode_batch(ts, pending[start : start + size], self.block_size, self.options.encoding)
            seq = self.next_seq
            self.next_seq += 1
            live = _LIVE
            if self.drop_remaining > 0:
                self.drop_remaining -= 1
                live = _HIDDEN
            try:
                self._push.send_multipart([seq.to_bytes(8, "big"), payload, live], flags=zmq.NOBLOCK)
            except zmq.Again:
                self.lost_batches += 1
            batches += 1
        return batches

    def pause(self, paused: bool) -> None:
        """Stop (True) or resume (False) publishing; events heard while paused are lost."""
        self.paused = paused
        if paused:
            self.dropped_events += len(self._pending)
            self._pending = []

    def drop_next(self, n: int) -> None:
        """Keep the next ``n`` (>= 0) batches off the live stream (still numbered and kept for replay)."""
        if n < 0:
            raise ValueError(f"drop count must be >= 0; got {n}")
        self.drop_remaining = n

    def close(self) -> None:
        """Stop the thread and close every socket (pending events are dropped). Blocks at most about a second."""
        if self._closed:
            return
        self._closed = True
        try:
            self._push.send(_STOP, flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("kv events on port %d: could not signal the publisher thread", self.options.port)
        self._thread.join(timeout=1.0)
        self._push.close(linger=0)
        if self._thread.is_alive():
            logger.warning("kv events on port %d: the publisher thread did not stop", self.options.port)
            return  # its sockets are still open: terminating the context would hang
        self._ctx.term()


def _serve(
    pub: zmq.Socket[bytes], router: zmq.Socket[bytes] | None, pull: zmq.Socket[bytes], opts: KVEventsOptions
) -> None:
    """The publisher thread: send what `flush` handed over, keep it for replay, answer replays; closes its sockets."""
    topic = opts.topic.encode("utf-8")
    buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=opts.buffer_batches)
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    if router is not None:
        poller.register(router, zmq.POLLIN)
    try:
        while True:
            ready = dict(poller.poll())
            if pull in ready:
                frames = pull.recv_multipart()
                if len(frames) != 3:
                    return  # the stop signal
                seq_bytes, payload, live = frames
                buffer.append((int.from_bytes(seq_bytes, "big"), seq_bytes, payload))
                if live == _LIVE:
                    # PUB drops past its high-water mark; a subscriber replays the gap.
                    with contextlib.suppress(zmq.Again):
                        pub.send_multipart([topic, seq_bytes, payload], flags=zmq.NOBLOCK)
            if router is not None and router in ready:
                _replay(router, buffer, topic)
    except Exception:
        logger.exception("kv events publisher thread failed")
    finally:
        for sock in (pub, router, pull):
            if sock is not None:
                sock.close(linger=0)


def _replay(router: zmq.Socket[bytes], buffer: deque[tuple[int, bytes, bytes]], topic: bytes) -> None:
    frames = router.recv_multipart()
    if len(frames) != 3:
        logger.warning("kv events: ignored a replay request of %d frames", len(frames))
        return
    client, _, start_bytes = frames
    start = int.from_bytes(start_bytes, "big")
    try:
        for seq, seq_bytes, payload in buffer:
            if seq >= start:
                router.send_multipart([client, b"", topic, seq_bytes, payload], flags=zmq.NOBLOCK)
        router.send_multipart([client, b"", b"", END_SEQ, b""], flags=zmq.NOBLOCK)
    except zmq.Again:
        logger.warning("kv events: a replay client stopped reading; its replay was cut short")
