"""What the engine knows about one request: ``RequestFeatures``, built by the filter from headers and body."""

from __future__ import annotations

from dataclasses import dataclass

# A rough English-text rule (OpenAI's own rule of thumb): one token per four characters. It only has to rank
# requests by size and estimate load; no tokenizer is loaded on the request path.
CHARS_PER_TOKEN = 4


def estimate_tokens(chars: int) -> int:
    """Estimated token count of ``chars`` characters of prompt text (ceiling division)."""
    return -(-chars // CHARS_PER_TOKEN)


@dataclass(slots=True)
class RequestFeatures:
    """The routing-relevant facts of one request. Built once per request; treat as read-only.

    ``model`` is None for requests whose body was not read (headers-only routes). ``prompt_tokens`` is an
    estimate unless the prompt was given as token ids.
    """

    path: str = ""
    method: str = ""
    request_id: str = ""
    model: str | None = None
    stream: bool = False
    max_tokens: int | None = None
    prompt_chars: int = 0
    prompt_tokens: int = 0
