"""Prompts tokenized as the servers tokenize them, and keyed for the exact cache index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from inferlb.scorer.tokenizer import (
    CacheKeyer,
    HuggingFaceTokenizer,
    PieceTokenizer,
    TokenizerError,
    cache_keys,
    chat_text,
    piece_ids,
)

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer folder like a model's: a small BPE trained here, a BOS post-processor, a chat template."""
    folder = tmp_path_factory.mktemp("model")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator(["the cache holds the prefix of the prompt"] * 50, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def test_the_piece_tokenizer_is_four_characters_a_token_the_same_in_every_process() -> None:
    ids = piece_ids("abcdabcdxyz")
    assert len(ids) == 3 and ids[0] == ids[1] != ids[2]
    assert piece_ids("abcd") == [ids[0]]  # no per-process salt: the emulator computes the same ids
    assert PieceTokenizer().chat_ids([{"role": "user", "content": "hi"}]) == piece_ids("<|user|>\nhi\n<|assistant|>\n")
    assert chat_text([]) == "<|assistant|>\n"


def test_a_model_tokenizer_adds_its_bos_to_completions_and_renders_chats(model_folder: Path) -> None:
    tokenizer = HuggingFaceTokenizer(model_folder)
    ids = tokenizer.text_ids("the cache holds")
    assert ids[0] == 0 and len(ids) > 1
    chat = tokenizer.chat_ids([{"role": "user", "content": "the prompt"}])
    raw = Tokenizer.from_file(str(model_folder / "tokenizer.json"))
    assert chat == raw.encode("<s><user>the prompt\n<assistant>", add_special_tokens=False).ids


def test_a_template_cannot_reach_outside_its_sandbox(tmp_path: Path, model_folder: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((model_folder / "tokenizer.json").read_bytes())
    nasty = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": nasty}), encoding="utf-8")
    with pytest.raises(TokenizerError, match="refused"):
        HuggingFaceTokenizer(tmp_path).chat_ids([{"role": "user", "content": "x"}])


def test_a_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="cannot load"):
        HuggingFaceTokenizer(tmp_path)


def test_cache_keys_chain_full_blocks_only() -> None:
    keys = cache_keys(list(range(40)), 16)
    assert len(keys) == 2
    assert cache_keys(list(range(32)) + [9] * 16, 16)[:2] == keys
    assert cache_keys([5, *list(range(1, 40))], 16)[1] != keys[1]  # one token differs: the chain differs after


@pytest.mark.parametrize(
    ("document", "blocks"),
    [
        pytest.param({"prompt": "a" * 64}, 4, id="text"),
        pytest.param({"prompt": ["a" * 64]}, 4, id="one-text-in-a-list"),
        pytest.param({"prompt": list(range(33))}, 2, id="token-ids"),
        pytest.param({"messages": [{"role": "user", "content": "b" * 100}]}, 7, id="chat"),
        pytest.param({"prompt": ["a" * 64, "b" * 64]}, 0, id="a-batch"),
    ],
)
def test_the_keyer_keys_what_it_can_tokenize(document: dict[str, object], blocks: int) -> None:
    keyer = CacheKeyer(
        {"m": PieceTokenizer()}, 4 if "messages" in document or document["prompt"] != list(range(33)) else 16
    )
    assert len(keyer.keys("m", document)) == blocks
    assert keyer.keys("other-model", document) == ()


def test_a_chat_the_template_refuses_gets_no_keys_and_is_counted(tmp_path: Path, model_folder: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((model_folder / "tokenizer.json").read_bytes())
    strict = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": strict}), encoding="utf-8")
    keyer = CacheKeyer({"m": HuggingFaceTokenizer(tmp_path)}, 4)
    assert keyer.keys("m", {"messages": [{"role": "user", "content": "x" * 99}]}) == ()
    assert keyer.failed == 1


def test_a_slow_tokenizer_is_planned_for_a_worker_and_a_fast_one_runs_at_once(model_folder: Path) -> None:
    document = {"prompt": "the cache holds the prefix " * 10}
    keys, later = CacheKeyer({"m": PieceTokenizer()}, 4).plan("m", document)
    assert keys and later is None
    keyer = CacheKeyer({"m": HuggingFaceTokenizer(model_folder)}, 4)
    keys, later = keyer.plan("m", document)
    assert keys == () and later is not None
    assert later() == keyer.keys("m", document) != ()
    # Token ids need no tokenizer, however slow it is: keyed at once.
    assert keyer.plan("m", {"prompt": list(range(16))})[1] is None
