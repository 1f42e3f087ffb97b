"""A package's public names load with their first use (scorer/lazy.py), on a package made for each test."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

INIT = """
from __future__ import annotations

from typing import TYPE_CHECKING

from inferlb.scorer.lazy import lazy_exports

if TYPE_CHECKING:
    from {package}.heavy import HEAVY, Heavy
    from {package}.light import light as renamed

__all__ = ["HEAVY", "Heavy", "renamed"]

__getattr__, __dir__ = lazy_exports(globals())
"""


@pytest.fixture
def package(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"lazy_pkg_{request.node.name.replace('[', '_').replace(']', '_').replace('-', '_')}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text(INIT.format(package=name))
    (root / "heavy.py").write_text("HEAVY = 42\n\nclass Heavy:\n    pass\n")
    (root / "light.py").write_text("def light() -> int:\n    return 1\n")
    (root / "other.py").write_text("VALUE = 'other'\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield name
    finally:
        sys.path.remove(str(tmp_path))
        for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            del sys.modules[module]


def test_a_name_imports_its_module_on_first_use_and_not_before(package: str) -> None:
    pkg = importlib.import_module(package)
    assert f"{package}.heavy" not in sys.modules
    assert pkg.HEAVY == 42
    assert f"{package}.heavy" in sys.modules
    assert pkg.Heavy is sys.modules[f"{package}.heavy"].Heavy
    assert "Heavy" in vars(pkg)  # kept: the second use is a plain attribute


def test_an_import_as_another_name_exports_that_name(package: str) -> None:
    pkg = importlib.import_module(package)
    assert pkg.renamed is sys.modules[f"{package}.light"].light


def test_an_unknown_name_is_an_attribute_error_and_a_submodule_still_imports(package: str) -> None:
    pkg = importlib.import_module(package)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        pkg.nothing  # noqa: B018
    namespace: dict[str, object] = {}
    exec(f"from {package} import other", namespace)  # the import system falls back to the submodule
    assert namespace["other"] is sys.modules[f"{package}.other"]


def test_dir_lists_the_public_names_before_they_load(package: str) -> None:
    pkg = importlib.import_module(package)
    assert {"HEAVY", "Heavy", "renamed"} <= set(dir(pkg))
    assert f"{package}.heavy" not in sys.modules


def test_a_package_without_the_block_exports_nothing(tmp_path: Path) -> None:
    root = tmp_path / "lazy_pkg_empty"
    root.mkdir()
    (root / "__init__.py").write_text(
        textwrap.dedent(
            """
            from inferlb.scorer.lazy import lazy_exports

            __getattr__, __dir__ = lazy_exports(globals())
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        pkg = importlib.import_module("lazy_pkg_empty")
        with pytest.raises(AttributeError):
            pkg.anything  # noqa: B018
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("lazy_pkg_empty", None)
