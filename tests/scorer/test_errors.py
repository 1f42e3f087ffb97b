"""Tests for scorer/errors.py: what an error message may echo of a client's input (``shown``) and the 404's text."""

from __future__ import annotations

import pytest

from inferlb.scorer.errors import SHOWN_CHARS, UnknownModelError, shown


@pytest.mark.parametrize(
    ("value", "limit", "expected"),
    [
        pytest.param("gpt-4", SHOWN_CHARS, "'gpt-4'", id="short-string-whole"),
        pytest.param("x" * SHOWN_CHARS, SHOWN_CHARS, repr("x" * SHOWN_CHARS), id="at-the-limit-whole"),
        pytest.param(
            "x" * (SHOWN_CHARS + 1),
            SHOWN_CHARS,
            f"{'x' * SHOWN_CHARS!r}… ({SHOWN_CHARS + 1} characters)",
            id="one-over-is-cut",
        ),
        pytest.param("\u00e9" * 5, 3, "'\u00e9\u00e9\u00e9'… (5 characters)", id="counts-characters-not-bytes"),
        pytest.param("", 3, "''", id="empty"),
        pytest.param(-1, 3, "-1", id="int"),
        pytest.param(True, SHOWN_CHARS, "True", id="bool"),
        pytest.param(16.0, SHOWN_CHARS, "16.0", id="float"),
        pytest.param(None, SHOWN_CHARS, "None", id="none"),
        pytest.param([1, 2], SHOWN_CHARS, "[1, 2]", id="small-list-whole"),
        pytest.param({"a": "b"}, SHOWN_CHARS, "{'a': 'b'}", id="small-dict-whole"),
    ],
)
def test_shown(value: object, limit: int, expected: str) -> None:
    assert shown(value, limit) == expected


@pytest.mark.parametrize(
    "value",
    [
        pytest.param([1] * 1_000_000, id="long-list"),
        pytest.param({f"k{i}": "v" * 1000 for i in range(1000)}, id="big-dict"),
        pytest.param([["x" * 100_000] * 10] * 10, id="nested-long-strings"),
        pytest.param(["\x00" * 1000], id="escapes"),
        pytest.param(10**4000, id="huge-int"),
    ],
)
def test_shown_bounds_any_value(value: object) -> None:
    text = shown(value)
    assert len(text) <= SHOWN_CHARS + 1
    assert text[:2] == repr(value)[:2]


def test_shown_escapes_before_it_counts() -> None:
    # A cut string stays a valid repr: the cut is made on the characters, then they are escaped.
    text = shown("\x00" * 500, 10)
    assert text == f"{chr(0) * 10!r}… (500 characters)"


def test_unknown_model_error_bounds_what_it_echoes() -> None:
    model = "m" * 3_000_000
    served = frozenset(f"model-{i:03d}" for i in range(100))
    error = UnknownModelError(model, served)
    message = str(error)
    assert len(message) < 1000
    assert message.startswith(f"model {'m' * SHOWN_CHARS!r}… (3000000 characters) is not served by this pool (served: ")
    listed = ", ".join(f"model-{i:03d}" for i in range(20))
    assert message.endswith(f"(served: {listed} and 80 more)")
    assert error.model == model  # the attributes keep the whole values
    assert error.served == served


@pytest.mark.parametrize(
    ("count", "tail"),
    [
        pytest.param(0, "(served: none)", id="none"),
        pytest.param(1, "(served: m00)", id="one"),
        pytest.param(20, "m18, m19)", id="twenty-all-listed"),
        pytest.param(21, "m18, m19 and 1 more)", id="twenty-one"),
    ],
)
def test_unknown_model_error_lists_at_most_twenty(count: int, tail: str) -> None:
    message = str(UnknownModelError("x", frozenset(f"m{i:02d}" for i in range(count))))
    assert message.startswith("model 'x' is not served by this pool (served: ")
    assert message.endswith(tail)
