"""The scorer package's exceptions, in one place, and ``shown``: how much of a client's input a message may echo.

``ScorerError`` is the root. ``ConfigError`` is raised while loading configuration and names the exact
place of the problem. ``RoutingError`` and its subclasses are raised by the engine when a request cannot be
placed; the filter translates them into HTTP statuses at its boundary (404 and 503).
"""

from __future__ import annotations

import reprlib

# What an error message echoes of a client's value: enough to recognise it, never the megabytes a body may hold
# (an error body is built and sent whole; a 3 MB model name once made a 3 MB 404).
SHOWN_CHARS = 200
# The 404 lists the pool's models; a pool of many would make every such reply long.
LISTED_MODELS = 20


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, bounded.

    A string longer than ``limit`` characters is cut to its first ``limit`` characters, then escaped, and the
    full length follows: ``'abc…'… (3000000 characters)``. Any other value is rendered by ``reprlib`` (which
    looks at a few items of a container, so the work is bounded too) and cut to ``limit`` characters with a
    trailing ``…``. Short values come out exactly as ``repr`` gives them.
    """
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        return f"{value[:limit]!r}… ({len(value)} characters)"
    bounded = reprlib.Repr()  # per call: the instance is configured by assignment, and is cheap
    bounded.maxlevel = 3
    bounded.maxstring = bounded.maxother = bounded.maxlong = limit
    text = bounded.repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


class ScorerError(Exception):
    """Root of the scorer package's exceptions."""


class ConfigError(ScorerError):
    """The configuration is invalid; the message names the field, e.g. ``pool.endpoints[1].address``."""


class RoutingError(ScorerError):
    """A request cannot be routed. Subclasses say why."""


class UnknownModelError(RoutingError):
    """No endpoint of the pool serves the requested model.

    ``model`` and ``served`` keep the whole values; the message shows the model through ``shown`` and lists at
    most ``LISTED_MODELS`` served models (in name order) and how many more there are.
    """

    def __init__(self, model: str, served: frozenset[str]) -> None:
        self.model = model
        self.served = served
        names = sorted(served)
        listed = ", ".join(names[:LISTED_MODELS]) or "none"
        if len(names) > LISTED_MODELS:
            listed += f" and {len(names) - LISTED_MODELS} more"
        super().__init__(f"model {shown(model)} is not served by this pool (served: {listed})")


class NoEndpointError(RoutingError):
    """Every endpoint that could serve the request was filtered out."""
