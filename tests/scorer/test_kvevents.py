"""Decoding vLLM's KV events: both encodings in the field, and clear refusals of what is not one."""

from __future__ import annotations

import msgpack
import pytest

from inferlb.scorer.kvevents import (
    MAX_PAYLOAD_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventError,
    decode_batch,
    decode_frames,
    sequence_bytes,
)

STORED_MAP = {
    "type": "BlockStored",
    "block_hashes": [11, b"\x01\x02"],
    "parent_block_hash": None,
    "token_ids": list(range(32)),
    "block_size": 16,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": None,
}
STORED_ARRAY = ["BlockStored", [11, b"\x01\x02"], None, list(range(32)), 16, None, "GPU"]
EXPECTED = (
    BlockStored((11, b"\x01\x02"), None, tuple(range(32)), 16, None, "GPU"),
    BlockRemoved((11,), "GPU"),
    AllBlocksCleared(),
)


@pytest.mark.parametrize(
    "events",
    [
        pytest.param(
            [STORED_MAP, {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"}, {"type": "AllBlocksCleared"}],
            id="tagged-maps",
        ),
        pytest.param([STORED_ARRAY, ["BlockRemoved", [11], "GPU"], ["AllBlocksCleared"]], id="tagged-arrays"),
    ],
)
def test_both_encodings_decode_to_the_same_events(events: list[object]) -> None:
    batch = decode_batch(msgpack.packb([1.5, events, 0]))
    assert batch.ts == 1.5
    assert batch.data_parallel_rank == 0
    assert batch.events == EXPECTED


def test_a_batch_without_its_rank_and_events_with_new_fields_decode() -> None:
    newer = dict(STORED_MAP, group_idx=0, kv_cache_spec_kind="full", session_id="s")
    batch = decode_batch(msgpack.packb([2.0, [newer, ["BlockStored", [5], 11, list(range(16)), 16]]]))
    assert batch.data_parallel_rank is None
    assert batch.events[0] == EXPECTED[0]
    assert batch.events[1] == BlockStored((5,), 11, tuple(range(16)), 16)


def test_frames_carry_the_sequence_big_endian() -> None:
    sequence, batch = decode_frames([b"", sequence_bytes(7), msgpack.packb([0.0, []])])
    assert sequence == 7 and batch.events == ()
    assert sequence_bytes(-1) == b"\xff" * 8


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        pytest.param(b"\xc1", "not valid msgpack", id="garbage"),
        pytest.param(msgpack.packb([0.0, {"x": 1}]), "events must be a list", id="no-events"),
        pytest.param(msgpack.packb("text"), "[ts, events, rank?]", id="a-string"),
        pytest.param(msgpack.packb([0.0, [{"type": "BlockMoved"}]]), "unknown type 'BlockMoved'", id="unknown-type"),
        pytest.param(msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": [1]}]]), "lacks", id="missing"),
        pytest.param(msgpack.packb([0.0, [dict(STORED_MAP, block_hashes=[1.5])]]), "int or bytes", id="float-hash"),
        pytest.param(msgpack.packb([0.0, [dict(STORED_MAP, block_size=0)]]), "block_size", id="zero-block-size"),
        pytest.param(msgpack.packb([0.0, [dict(STORED_MAP, token_ids=["a"])]]), "integers", id="text-tokens"),
        pytest.param(msgpack.packb([0.0, [7]]), "neither a tagged map", id="a-number"),
        # Valid msgpack that Python cannot hold: a map keyed by an array (a TypeError inside the unpacker).
        pytest.param(b"\x81\x91\x01\x01", "not valid msgpack: TypeError", id="array-key"),
        pytest.param(msgpack.packb([0.0, [{"type": [1]}]]), "cannot be read: TypeError", id="array-tag"),
    ],
)
def test_what_is_not_a_batch_is_refused_saying_why(payload: bytes, message: str) -> None:
    with pytest.raises(KVEventError, match=message.replace("[", r"\[").replace("?", r"\?")):
        decode_batch(payload)


def test_frames_of_the_wrong_shape_are_refused() -> None:
    with pytest.raises(KVEventError, match="3 frames"):
        decode_frames([b"", b"\x00" * 8])
    with pytest.raises(KVEventError, match="8 bytes"):
        decode_frames([b"", b"\x00", msgpack.packb([0.0, []])])


def _array(count: int, item: bytes) -> bytes:
    return b"\xdd" + count.to_bytes(4, "big") + item * count


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        # msgpack's unpacker holds the GIL while it decodes, and a list or map costs ~0.2 us: 4 MiB of empty arrays
        # once froze the routing loop for 0.9 s. An array longer than any field may be is refused at its header...
        pytest.param(msgpack.packb([0.0, []])[:-1] + _array(1 << 19, b"\x90"), "max_array_len", id="long-array"),
        # ...and a message of many short ones after a bounded count of lists and maps.
        pytest.param(
            msgpack.packb([0.0, []])[:-1] + b"\xdc\x00\x05" + _array(1 << 16, b"\x90") * 5,
            "more than 262144 lists and maps",
            id="many-arrays",
        ),
        pytest.param(msgpack.packb([0.0, [], 0, {str(i): i for i in range(300)}]), "max_map_len", id="wide-map"),
        pytest.param(msgpack.packb([0.0, [dict(STORED_MAP, block_hashes=[b"h" * 2048])]]), "max_bin", id="long-bin"),
        pytest.param(msgpack.packb([0.0, [dict(STORED_MAP, medium="G" * (65 << 10))]]), "max_str_len", id="long-str"),
    ],
)
def test_what_would_cost_far_more_to_decode_than_a_real_batch_is_refused_while_decoding(
    payload: bytes, message: str
) -> None:
    assert len(payload) <= MAX_PAYLOAD_BYTES
    with pytest.raises(KVEventError, match=message):
        decode_batch(payload)


def test_a_long_prefill_step_still_decodes() -> None:
    # 128k tokens in one step (Llama 3's ids take 5 bytes each): about 700 KB.
    step = dict(STORED_MAP, block_hashes=list(range(8192)), token_ids=[100_000] * (8192 * 16), medium="GPU")
    payload = msgpack.packb([0.0, [step], 0])
    assert len(decode_batch(payload).events[0].token_ids) == 8192 * 16


def test_a_payload_over_the_bound_is_refused_before_it_is_read() -> None:
    huge = msgpack.packb([0.0, [], 0]) + b"\x00" * MAX_PAYLOAD_BYTES
    with pytest.raises(KVEventError, match="over the limit"):
        decode_batch(huge)
