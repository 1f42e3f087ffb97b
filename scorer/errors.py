"""The scorer package's exceptions, in one place.

``ScorerError`` is the root. ``ConfigError`` is raised while loading configuration and names the exact
place of the problem. ``RoutingError`` and its subclasses are raised by the engine when a request cannot be
placed; the filter translates them into HTTP statuses at its boundary (404 and 503).
"""

from __future__ import annotations


class ScorerError(Exception):
    """Root of the scorer package's exceptions."""


class ConfigError(ScorerError):
    """The configuration is invalid; the message names the field, e.g. ``pool.endpoints[1].address``."""


class RoutingError(ScorerError):
    """A request cannot be routed. Subclasses say why."""


class UnknownModelError(RoutingError):
    """No endpoint of the pool serves the requested model."""

    def __init__(self, model: str, served: frozenset[str]) -> None:
        self.model = model
        self.served = served
        listed = ", ".join(sorted(served)) or "none"
        super().__init__(f"model {model!r} is not served by this pool (served: {listed})")


class NoEndpointError(RoutingError):
    """Every endpoint that could serve the request was filtered out."""
