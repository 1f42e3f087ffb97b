"""The filter's exceptions: each is one HTTP error the client receives as an Envoy ImmediateResponse.

``RequestError`` carries the HTTP status, an OpenAI-style error ``type`` and a message that says what was
wrong. Routing errors from the scorer are translated here, at the boundary, by ``from_routing_error``.
A message echoes a client's value only through ``inferlb.scorer.errors.shown``, and ``RequestError`` cuts any
message to ``MAX_MESSAGE_CHARS`` whatever it holds.
"""

from __future__ import annotations

from typing import Any

from inferlb.scorer.errors import NoEndpointError, RoutingError, UnknownModelError
from inferlb.scorer.quotas import QuotaRefusal

# The last bound on an error body, for a message that echoes a value without ``shown``: the longest message the
# picker composes (a 404 that lists twenty long model names) stays under it.
MAX_MESSAGE_CHARS = 2000


class RequestError(Exception):
    """A request the picker refuses; ``status`` is the HTTP status sent back to the client.

    ``message`` is the one given, cut to ``MAX_MESSAGE_CHARS`` characters (then ``…``)."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + "…"
        super().__init__(message)
        self.message = message


class MalformedRequestError(RequestError):
    """The body is not JSON, not an object, or a field the picker reads has the wrong type (HTTP 400)."""


class PayloadTooLargeError(RequestError):
    """The body is over the configured ``max_body_bytes`` (HTTP 413)."""

    status = 413
    type = "payload_too_large"


class ModelNotFoundError(RequestError):
    """No endpoint of the pool serves the requested model (HTTP 404)."""

    status = 404
    type = "model_not_found"


class OverloadedError(RequestError):
    """Every endpoint that could serve the request is saturated and its class sheds load (HTTP 429); the client
    should retry after ``retry_after_s`` seconds (sent as ``retry-after``)."""

    status = 429
    type = "overloaded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QuotaExceededError(RequestError):
    """The request's tenant is over its quota (HTTP 429, ``retry-after``); the body also names the tenant, the
    limit and its value (``details``)."""

    status = 429
    type = "quota_exceeded"

    def __init__(self, refusal: QuotaRefusal) -> None:
        super().__init__(refusal.message)
        self.retry_after_s = refusal.retry_after_s
        self.details: dict[str, Any] = {
            "tenant": refusal.tenant,
            "limit": refusal.limit,
            "limit_value": refusal.value,
            "retry_after_s": refusal.retry_after_s,
        }


class TenantRefusedError(RequestError):
    """Quotas name the tenant from the request's JWT (``quotas.source: jwt``) and this request's token names none,
    or names one that is no usable name (HTTP 403)."""

    status = 403
    type = "tenant_refused"


class NoEndpointAvailableError(RequestError):
    """Every endpoint that could serve the request is unavailable (HTTP 503)."""

    status = 503
    type = "no_endpoint_available"


def from_routing_error(exc: RoutingError) -> RequestError:
    """The HTTP error a scorer ``RoutingError`` becomes."""
    if isinstance(exc, UnknownModelError):
        return ModelNotFoundError(str(exc))
    if isinstance(exc, NoEndpointError):
        return NoEndpointAvailableError(f"no endpoint available: {exc}")
    return NoEndpointAvailableError(f"request cannot be routed: {exc}")
