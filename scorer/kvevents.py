"""vLLM's KV-cache events on the wire: what a server publishes when blocks enter and leave its prefix cache.

A vLLM server started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``
publishes on a ZMQ PUB socket. Each message is three frames: ``[topic, sequence, payload]``, the sequence an
8-byte big-endian count that rises by one per message, the payload a msgpack ``EventBatch``: the array
``[ts, events, data_parallel_rank]`` (the rank may be left out). A replay socket (ZMQ ROUTER) answers a DEALER
that sends ``[b"", start sequence as 8 bytes]`` with ``[b"", topic, sequence, payload]`` for every batch it still
buffers from that sequence on, then ``[b"", b"", -1 as 8 signed bytes, b""]`` (vLLM before 0.32: the same without
the topic frame, ``[b"", sequence, payload]``).

Events come in two encodings, and both are in the field:

* a map tagged by its ``"type"`` key: ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h,
  "token_ids": [...], "block_size": 16, "lora_id": null, "medium": "GPU", ...}`` (vLLM 0.32, the version
  ``make test-vllm`` installs: its events are msgspec structs with ``tag=True`` and no ``array_like``);
* an array whose first element is the tag: ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, ...]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``
  (the vLLM releases before, whose events were ``array_like``; consumers written for it broke on the change).

A block hash is an int or bytes (vLLM's ``ExternalBlockHash``). Fields a newer vLLM adds are ignored, and a field
with a default may be left out. Everything here is pure: `decode_batch` turns bytes into frozen events or raises
`KVEventError` saying what was wrong; bounds on counts keep a hostile or broken publisher from costing more
than its message's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgpack

__all__ = [
    "END_SEQUENCE",
    "MAX_BATCH_EVENTS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "KVEventError",
    "decode_batch",
    "decode_frames",
    "sequence_bytes",
]

BlockHash: TypeAlias = int | bytes

# A replay ends with this sequence number (vLLM's END_SEQ).
END_SEQUENCE = -1
# Bounds on what one message may hold. vLLM publishes one batch per engine step: a step stores at most the blocks
# of the tokens it scheduled (16k tokens are about 1,000 blocks and 50 KB of msgpack), so these only stop garbage;
# the payload bound also keeps one message from holding the routing loop for long (the collector shares it).
MAX_BATCH_EVENTS = 65_536
MAX_EVENT_BLOCKS = 65_536
MAX_BLOCK_SIZE = 4096
# A step's prefill: vLLM schedules at most max_num_batched_tokens a step (8k-16k by default; 128k is about 640 KB of
# Llama 3's ids): no field holds more token ids than twice that, and no message is larger than 1 MiB.
MAX_BATCH_TOKENS = 1 << 18
MAX_PAYLOAD_BYTES = 1 << 20
# msgpack's C unpacker holds the GIL for the whole message, and every list or map it makes costs far more than a
# number (the garbage collector tracks it): a message of empty arrays once froze the routing loop for 0.9 s
# although decoded in a worker thread. So no array is longer than the longest field may be, no map has more keys
# than an event's dozen fields allow for, and a message holds at most a few lists or maps per event allowed
# (counted by hooks, Python calls that also let the GIL go to the loop).
MAX_BATCH_CONTAINERS = 4 * MAX_BATCH_EVENTS
_UNPACK_LIMITS = {
    "max_array_len": max(MAX_BATCH_EVENTS, MAX_EVENT_BLOCKS, MAX_BATCH_TOKENS),
    "max_map_len": 256,
    "max_str_len": 64 << 10,
    "max_bin_len": 1024,  # a block hash: vLLM's are 32 bytes at most
    "max_ext_len": 1024,
}


class KVEventError(ValueError):
    """A KV event message that cannot be read; the message says what was wrong with it."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that entered the server's prefix cache, in prompt order: ``block_hashes[i]`` covers
    ``token_ids[i * block_size : (i + 1) * block_size]`` and, through ``parent_block_hash`` (the block before the
    first, None for a prompt's first block), everything before it. ``medium``: "GPU", "CPU" (offloaded) or None."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the server evicted from its prefix cache."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The server's prefix cache was emptied (a reset)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: its events in order, the server's timestamp and its data-parallel rank."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


def sequence_bytes(sequence: int) -> bytes:
    """A sequence number as it travels (8 bytes, big-endian, signed as vLLM's end marker is)."""
    return sequence.to_bytes(8, "big", signed=True)


def decode_frames(frames: Sequence[bytes]) -> tuple[int, EventBatch]:
    """(sequence, batch) of a published message ``[topic, sequence, payload]``. Raises `KVEventError`."""
    if len(frames) != 3:
        raise KVEventError(f"a KV event message has 3 frames (topic, sequence, payload), not {len(frames)}")
    _, raw_sequence, payload = frames
    if len(raw_sequence) != 8:
        raise KVEventError(f"a sequence number is 8 bytes, not {len(raw_sequence)}")
    return int.from_bytes(raw_sequence, "big", signed=True), decode_batch(payload)


def decode_batch(payload: bytes) -> EventBatch:
    """The `EventBatch` in a msgpack ``payload``, events in either encoding. Raises `KVEventError`, and nothing
    else, whatever the bytes: a caller counts it as one missed batch."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise KVEventError(f"a KV event batch of {len(payload)} bytes is over the limit of {MAX_PAYLOAD_BYTES}")
    count = _Containers()
    try:
        document = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=False,
            use_list=True,
            list_hook=count,
            object_hook=count,
            **_UNPACK_LIMITS,
        )
    except KVEventError:
        raise
    except Exception as exc:  # valid msgpack can still fail in Python: a map keyed by an array is a TypeError
        raise KVEventError(f"a KV event batch is not valid msgpack: {type(exc).__name__}: {exc}") from None
    try:
        return _batch(document)
    except KVEventError:
        raise
    except Exception as exc:  # a shape the checks below did not foresee (an unhashable tag, say)
        raise KVEventError(f"a KV event batch cannot be read: {type(exc).__name__}: {exc}") from None


def _batch(document: Any) -> EventBatch:
    if isinstance(document, dict):  # tolerated: a batch written as a map
        ts, events, rank = document.get("ts"), document.get("events"), document.get("data_parallel_rank")
    elif isinstance(document, list) and 2 <= len(document) <= 3:
        ts, events = document[0], document[1]
        rank = document[2] if len(document) == 3 else None
    else:
        raise KVEventError(f"a KV event batch is [ts, events, rank?], not {_kind(document)}")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise KVEventError(f"a KV event batch's ts must be a number, not {_kind(ts)}")
    if not isinstance(events, list):
        raise KVEventError(f"a KV event batch's events must be a list, not {_kind(events)}")
    if len(events) > MAX_BATCH_EVENTS:
        raise KVEventError(f"a KV event batch of {len(events)} events is over the limit of {MAX_BATCH_EVENTS}")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise KVEventError(f"a KV event batch's data_parallel_rank must be an integer, not {_kind(rank)}")
    return EventBatch(float(ts), tuple(_event(e, i) for i, e in enumerate(events)), rank)


class _Containers:
    """msgpack's hook for every list and map decoded: counts them, and refuses a message with too many."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, value: Any) -> Any:
        self.count += 1
        if self.count > MAX_BATCH_CONTAINERS:
            raise KVEventError(f"a KV event batch holds more than {MAX_BATCH_CONTAINERS} lists and maps")
        return value


# The fields of each event in the array encoding, after the tag, in vLLM's order.
_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}


def _event(raw: Any, position: int) -> KVEvent:
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        names = _FIELDS.get(tag, ()) if isinstance(tag, str) else ()
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise KVEventError(f"event {position} is neither a tagged map nor a tagged array: {_kind(raw)}")
    if tag not in _FIELDS:
        raise KVEventError(f"event {position} has an unknown type {tag!r}; known: {', '.join(_FIELDS)}")
    missing = [name for name in _FIELDS[tag][: _REQUIRED[tag]] if name not in fields]
    if missing:
        raise KVEventError(f"event {position} ({tag}) lacks {', '.join(missing)}")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = _hashes(fields["block_hashes"], position)
    medium = fields.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise KVEventError(f"event {position}: medium must be a string or null, not {_kind(medium)}")
    if tag == "BlockRemoved":
        return BlockRemoved(hashes, medium)
    parent = fields["parent_block_hash"]
    if parent is not None and not _is_hash(parent):
        raise KVEventError(f"event {position}: parent_block_hash must be an int, bytes or null, not {_kind(parent)}")
    size = fields["block_size"]
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_BLOCK_SIZE:
        raise KVEventError(f"event {position}: block_size must be an integer in 1..{MAX_BLOCK_SIZE}, not {size!r}")
    tokens = fields["token_ids"]
    if not isinstance(tokens, list) or len(tokens) > MAX_EVENT_BLOCKS * size:
        raise KVEventError(f"event {position}: token_ids must be a list of at most one block per hash")
    if set(map(type, tokens)) - {int}:
        raise KVEventError(f"event {position}: token_ids must be integers")
    lora = fields.get("lora_id")
    if lora is not None and (not isinstance(lora, int) or isinstance(lora, bool)):
        raise KVEventError(f"event {position}: lora_id must be an integer or null, not {_kind(lora)}")
    return BlockStored(hashes, parent, tuple(tokens), size, lora, medium)


def _hashes(raw: Any, position: int) -> tuple[BlockHash, ...]:
    if not isinstance(raw, list):
        raise KVEventError(f"event {position}: block_hashes must be a list, not {_kind(raw)}")
    if len(raw) > MAX_EVENT_BLOCKS:
        raise KVEventError(f"event {position}: {len(raw)} block hashes is over the limit of {MAX_EVENT_BLOCKS}")
    if not all(map(_is_hash, raw)):
        raise KVEventError(f"event {position}: every block hash must be an int or bytes")
    return tuple(raw)


def _is_hash(value: Any) -> bool:
    return type(value) is int or type(value) is bytes


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__
