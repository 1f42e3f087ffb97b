"""Chats rendered as vLLM renders them, for the exact cache keys of a chat request (`scorer.tokenizer`).

vLLM's OpenAI server turns a request's messages into the template's input first (``vllm/entrypoints/chat_utils.py``,
``parse_chat_messages``), then renders the model's chat template with transformers (``apply_chat_template`` →
``render_jinja_template``). What of that changes the rendered text is repeated here:

- The messages: each keeps its role, its content, ``name`` (a string), and by role ``tool_calls`` (arguments parsed
  from JSON into objects), ``reasoning`` (also as ``reasoning_content`` and ``thinking``), ``tool_call_id``, ``task``,
  ``tools`` (developer); keys whose value is None are dropped. Text content parts (``text``, ``input_text``,
  ``output_text``, ``refusal``, ``thinking``, plain strings) become one string joined by newlines for a template that
  prints ``message['content']`` (vLLM's "string" content format), or a list of ``{"type": "text"}`` parts for one that
  loops over it (the "openai" format, which vLLM detects in the template's syntax tree; the check here is simpler:
  any loop over a ``content`` item). A message with other parts (images, audio, ...) is not rendered: vLLM puts
  placeholders there that depend on the model's processor (`MediaContent`).
- The template's environment: a sandbox with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension and a
  ``{% generation %}`` block, the globals ``raise_exception`` and ``strftime_now`` (the local date and time, as the
  server reads its own clock), a ``tojson`` filter without HTML escaping; rendered with ``messages``, ``tools=None``,
  ``documents=None``, ``add_generation_prompt=True`` and the tokenizer's named special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jinja2 import Environment, nodes

__all__ = ["ChatTemplate", "MediaContent", "TemplateRefused"]

# Content part type → the key that holds its text (vLLM's MM_PARSER_MAP, text kinds).
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# Names of a message's reasoning that transformers copies to `reasoning_content` and `thinking`.
_REASONING = ("reasoning_content", "thinking", "reasoning")


class TemplateRefused(ValueError):
    """The template cannot be compiled, or refuses a chat (its own ``raise_exception``, or an error rendering it)."""


class MediaContent(ValueError):
    """A message holds content other than text (an image, audio): its rendering depends on the model's processor."""


def _raise_exception(message: str) -> None:
    raise TemplateRefused(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> Environment:
    """transformers' sandbox for chat templates (Jinja is imported here: only a model's tokenizer needs it)."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.parser import Parser
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}…{% endgeneration %}`` (transformers marks the assistant's tokens with it, for
        training): the body renders unchanged."""

        tags = {"generation"}  # noqa: RUF012 (Jinja's own attribute, a set)

        def parse(self, parser: Parser) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


class ChatTemplate:
    """A model's chat template (``source``, from ``where``), compiled in a sandbox; raises `TemplateRefused` when it
    does not compile. `render` is thread-safe (a compiled Jinja template is)."""

    def __init__(self, source: str, where: Path, specials: Mapping[str, str]) -> None:
        environment = _environment()
        try:
            tree = environment.parse(source)
            self._template = environment.from_string(tree)
        except Exception as exc:  # TemplateSyntaxError, or anything a broken template makes the compiler raise
            raise TemplateRefused(f"the chat_template in {where} does not compile: {exc}") from exc
        self.parts_format = "openai" if _loops_over_content(tree) else "string"
        self._specials = dict(specials)

    def render(self, messages: Any) -> str:
        """The prompt vLLM renders for ``messages`` (with the generation prompt). Raises `MediaContent` for a message
        with non-text content, `TemplateRefused` for a chat the template refuses or that is not a list of messages."""
        conversation = server_messages(messages, self.parts_format)
        try:
            return self._template.render(
                messages=conversation, tools=None, documents=None, add_generation_prompt=True, **self._specials
            )
        except Exception as exc:  # a template's own raise_exception, or one that fails on this chat
            raise TemplateRefused(f"the chat template refused these messages: {exc}") from None


def _loops_over_content(tree: nodes.Template) -> bool:
    """Whether the template loops over a ``content`` item (``for part in message['content']``): vLLM then hands it
    content as a list of parts."""
    from jinja2 import nodes

    for loop in tree.find_all(nodes.For):
        target = loop.iter
        while isinstance(target, nodes.Filter) and target.node is not None:  # message['content'] | list
            target = target.node
        if isinstance(target, nodes.Getattr) and target.attr == "content":
            return True
        if isinstance(target, nodes.Getitem) and isinstance(target.arg, nodes.Const) and target.arg.value == "content":
            return True
    return False


def server_messages(messages: Any, parts_format: str) -> list[dict[str, Any]]:
    """``messages`` as vLLM hands them to the template (see the module's docstring); ``parts_format``: "string" or
    "openai". Raises `MediaContent`, or `TemplateRefused` for what is not a list of messages with roles."""
    if not isinstance(messages, list):
        raise TemplateRefused("messages is not a list")
    conversation = []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise TemplateRefused("a message is not an object with a role")
        role = message["role"]
        texts = _texts(message.get("content"))
        content: Any = "\n".join(texts)
        if parts_format == "openai" and role != "tool":  # vLLM joins a tool result's text parts in either format
            content = [{"type": "text", "text": text} for text in texts]
        out: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            calls = message.get("tool_calls")
            if isinstance(calls, list) and calls:
                out["tool_calls"] = [_parsed_call(call) for call in calls]
            if message.get("reasoning") is not None:
                out["reasoning"] = out["reasoning_content"] = message["reasoning"]
        elif role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                out[key] = message[key]
        if role == "developer":
            out["tools"] = message.get("tools")
        out = {k: v for k, v in out.items() if v is not None}
        reasoning = next((out[k] for k in _REASONING if out.get(k) is not None), None)
        if reasoning is not None:
            out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
        conversation.append(out)
    return conversation


def _texts(content: Any) -> list[str]:
    """The text parts of a message's content, in order; raises `MediaContent` for any other part."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise TemplateRefused("a message's content is neither a string nor a list of parts")
    texts = []
    for part in content:
        if isinstance(part, str):
            if part:  # vLLM drops empty parts before joining
                texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise MediaContent(f"a content part of type {kind!r}")
        text = part.get(key)
        if isinstance(text, str):
            if text:
                texts.append(text)
        elif text is not None:
            raise TemplateRefused(f"a {kind!r} part whose {key!r} is not a string")
    return texts


def _parsed_call(call: Any) -> Any:
    """A tool call with its arguments as an object, as vLLM passes it (invalid JSON becomes ``{}``)."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            function["arguments"] = {}
    elif not isinstance(arguments, dict | list):
        function["arguments"] = {}
    return {**call, "function": function}
