"""Prompts tokenized as the servers tokenize them, and keyed for the exact cache index."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

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


# Llama 3.2's template (Llama 3.3 and 4 alike) reads today's date through transformers' strftime_now.
DATED_TEMPLATE = (
    "{{ bos_token }}{% if strftime_now is defined %}{% set day = strftime_now('%d %b %Y') %}"
    "{% else %}{% set day = '26 Jul 2024' %}{% endif %}Today Date: {{ day }}\n"
    "{% if tools is defined and tools is none %}no tools\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _folder(tmp_path: Path, model_folder: Path, template: str) -> Path:
    (tmp_path / "tokenizer.json").write_bytes((model_folder / "tokenizer.json").read_bytes())
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return tmp_path


def test_a_chat_is_rendered_with_the_globals_transformers_gives_its_template(
    tmp_path: Path, model_folder: Path
) -> None:
    """vLLM renders through transformers, which defines strftime_now (today's date) and passes tools=None: a template
    that reads them renders what the server renders, not its fallback."""
    tokenizer = HuggingFaceTokenizer(_folder(tmp_path, model_folder, DATED_TEMPLATE))
    raw = Tokenizer.from_file(str(model_folder / "tokenizer.json"))
    days = [datetime.now().strftime("%d %b %Y")]
    chat = tokenizer.chat_ids([{"role": "user", "content": "the prompt"}])
    days.append(datetime.now().strftime("%d %b %Y"))  # another where it ran across midnight
    servers = [f"<s>Today Date: {day}\nno tools\n<user>the prompt\n<assistant>" for day in days]
    assert any(chat == raw.encode(server, add_special_tokens=False).ids for server in servers)


def test_a_template_may_break_out_of_loops_and_mark_generations(tmp_path: Path, model_folder: Path) -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] | tojson }}{% endfor %}"
        "{% generation %}<assistant>{% endgeneration %}"
    )
    tokenizer = HuggingFaceTokenizer(_folder(tmp_path, model_folder, template))
    raw = Tokenizer.from_file(str(model_folder / "tokenizer.json"))
    ids = tokenizer.chat_ids([{"role": "user", "content": "the <cache>"}, {"role": "user", "content": "x"}])
    assert ids == raw.encode('"the <cache>"<assistant>', add_special_tokens=False).ids  # tojson: no HTML escapes


@pytest.mark.parametrize(
    ("content", "rendered"),
    [
        pytest.param([{"type": "text", "text": "the cache"}], "the cache", id="one-part"),
        pytest.param(
            [
                {"type": "text", "text": "the cache"},
                {"type": "text", "text": ""},
                "holds",
                {"type": "text", "text": "it"},
            ],
            "the cache\nholds\nit",
            id="parts-joined-by-newlines",
        ),
        pytest.param(None, "", id="no-content"),
    ],
)
def test_text_content_parts_are_joined_as_vllm_joins_them(
    tmp_path: Path, model_folder: Path, content: object, rendered: str
) -> None:
    """vLLM hands a template that prints ``message['content']`` the text parts joined by newlines (its "string"
    content format), not the list."""
    tokenizer = HuggingFaceTokenizer(_folder(tmp_path, model_folder, TEMPLATE))
    as_parts = tokenizer.chat_ids([{"role": "user", "content": content}])
    assert as_parts == tokenizer.chat_ids([{"role": "user", "content": rendered}])


def test_a_template_that_loops_over_the_parts_gets_them_as_parts(tmp_path: Path, model_folder: Path) -> None:
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    )
    tokenizer = HuggingFaceTokenizer(_folder(tmp_path, model_folder, template))
    raw = Tokenizer.from_file(str(model_folder / "tokenizer.json"))
    ids = tokenizer.chat_ids(
        [
            {"role": "user", "content": "the cache"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    )
    assert ids == raw.encode("<user>[the cache]<user>[a][b]", add_special_tokens=False).ids


def test_a_chat_with_an_image_gets_no_exact_keys_and_is_counted(tmp_path: Path, model_folder: Path) -> None:
    """vLLM puts a processor-dependent placeholder where an image was: the picker cannot key it exactly."""
    keyer = CacheKeyer({"m": HuggingFaceTokenizer(_folder(tmp_path, model_folder, TEMPLATE))}, 4)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "the cache holds " * 9}, image]}]
    assert keyer.keys("m", {"messages": messages}) == ()
    assert (keyer.media, keyer.failed) == (1, 0)


class _CountingTokenizer:
    """A Hugging Face tokenizer that records the length of each text it encodes."""

    def __init__(self, tokenizer: HuggingFaceTokenizer) -> None:
        self.inner = tokenizer
        self.encoded: list[int] = []
        encode = tokenizer._tokenizer.encode_batch

        def counting(texts: list[str], add_special_tokens: bool) -> Any:
            self.encoded.extend(len(t) for t in texts)
            return encode(texts, add_special_tokens=add_special_tokens)

        tokenizer._tokenizer = type("T", (), {"encode_batch": staticmethod(counting)})()


@pytest.mark.parametrize(
    ("text", "passes"),
    [
        pytest.param("the cache holds the prefix of the prompt " * 3000, 1, id="words"),
        pytest.param(" prefix prompt" * 3000, 2, id="long-tokens-grow-the-head"),
        pytest.param("the prompt", 1, id="short"),
    ],
)
def test_only_the_head_a_prompt_is_keyed_by_is_tokenized(
    model_folder: Path, monkeypatch: pytest.MonkeyPatch, text: str, passes: int
) -> None:
    """Of a long prompt only the head that holds the keyed blocks is tokenized (guessed at 6 characters a token,
    grown where its tokens are longer), and its keys are the whole prompt's."""
    monkeypatch.setattr("inferlb.scorer.tokenizer.MAX_CACHE_BLOCKS", 64)
    monkeypatch.setattr("inferlb.scorer.tokenizer.CUT_SLACK_TOKENS", 16)
    whole = HuggingFaceTokenizer(model_folder).text_ids(text)
    counting = _CountingTokenizer(HuggingFaceTokenizer(model_folder))
    keys = CacheKeyer({"m": counting.inner}, 4).keys("m", {"prompt": text})
    assert keys == cache_keys(whole, 4)
    assert len(counting.encoded) == passes
    assert max(counting.encoded) < len(text) or len(text) < 64 * 4 * 6
