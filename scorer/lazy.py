"""Package-level names that are imported when first used, not when the package is.

``import inferlb.scorer.gpustate`` runs ``inferlb/scorer/__init__.py`` first. If that file imported every public
name, each process that needs one small module would load the whole package: the GPU agent (two scorer modules)
would load the config models and the routing unit, and each emulated server (``inferlb sim``) the whole product,
about a second of start-up for nothing. So a package writes its public names as imports under
``if TYPE_CHECKING:`` (what type checkers and readers see) and hands its module attributes to `lazy_exports`,
which reads those same imports from the package's source and performs one when its name is first asked for.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of the package whose ``globals()`` is ``namespace``: a name
    imported under ``if TYPE_CHECKING:`` in its ``__init__.py`` resolves to that module's attribute on first use
    (then stays in the package's namespace); any other name raises AttributeError, which lets
    ``from package import submodule`` import the submodule."""
    package, init_file = namespace["__name__"], namespace["__file__"]
    table: Mapping[str, tuple[str, str]] | None = None

    def source_of(name: str) -> tuple[str, str] | None:
        nonlocal table
        if table is None:
            table = _type_checking_imports(Path(init_file))
        return table.get(name)

    def __getattr__(name: str) -> Any:
        source = source_of(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = source
        value = getattr(importlib.import_module(module), attribute)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return __getattr__, __dir__


def _type_checking_imports(init_file: Path) -> Mapping[str, tuple[str, str]]:
    """name -> (module, attribute) for each ``from module import attribute [as name]`` under
    ``if TYPE_CHECKING:`` in ``init_file``."""
    tree = ast.parse(init_file.read_text(encoding="utf-8"), str(init_file))
    table: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom) and statement.module and statement.level == 0:
                    for alias in statement.names:
                        table[alias.asname or alias.name] = (statement.module, alias.name)
    return table
