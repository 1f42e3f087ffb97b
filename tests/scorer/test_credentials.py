"""Tests for scorer/credentials.py: where a token comes from, what is refused, and constant-time matching."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferlb.scorer.credentials import Credential, TokenSource
from inferlb.scorer.errors import ConfigError

TOKEN = "s3cr3t-token-of-32-characters!!"


def test_a_token_file_is_read_and_its_newline_dropped(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    credential = TokenSource(file=str(path)).read("admin_auth")
    assert credential.matches(TOKEN) and not credential.matches(TOKEN + "x")
    assert TOKEN not in repr(credential)


def test_a_token_env_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_TOKEN", TOKEN)
    assert TokenSource(env="MY_TOKEN").read("x").matches_bearer(f"bearer {TOKEN}")


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        pytest.param(None, "cannot read", id="missing"),
        pytest.param("", "empty or unset", id="empty"),
        pytest.param("short", "the token must be 16", id="short"),
        pytest.param("has a space in it, sixteen+", "without spaces", id="space"),
    ],
)
def test_an_unusable_token_file_is_refused(tmp_path: Path, content: str | None, fragment: str) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=fragment):
        TokenSource(file=str(path)).read("admin_auth")


@pytest.mark.parametrize(
    ("header", "matches"),
    [
        pytest.param(f"Bearer {TOKEN}", True, id="bearer"),
        pytest.param(f"BEARER  {TOKEN} ", True, id="case-and-spaces"),
        pytest.param(f"Basic {TOKEN}", False, id="basic"),
        pytest.param(TOKEN, False, id="no-scheme"),
        pytest.param("Bearer ", False, id="empty"),
        pytest.param(None, False, id="absent"),
        pytest.param(f"Bearer {TOKEN[:-1]}", False, id="prefix"),
    ],
)
def test_bearer_matching(header: str | None, matches: bool) -> None:
    assert Credential(TOKEN.encode()).matches_bearer(header) is matches
