"""The Envoy ext_proc filter: the gRPC service that turns each request into a routing decision."""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferlb.scorer.lazy import lazy_exports

if TYPE_CHECKING:
    from inferlb.filter.errors import (
        MalformedRequestError,
        ModelNotFoundError,
        NoEndpointAvailableError,
        PayloadTooLargeError,
        RequestError,
    )
    from inferlb.filter.replies import DESTINATION_HEADER, METADATA_NAMESPACE, RouteReplies, error_reply
    from inferlb.filter.request import apply_body, features_from_headers
    from inferlb.filter.server import EXT_PROC_SERVICE, ExtProcService, FilterStats, PickerServer

__all__ = [
    "DESTINATION_HEADER",
    "EXT_PROC_SERVICE",
    "METADATA_NAMESPACE",
    "ExtProcService",
    "FilterStats",
    "MalformedRequestError",
    "ModelNotFoundError",
    "NoEndpointAvailableError",
    "PayloadTooLargeError",
    "PickerServer",
    "RequestError",
    "RouteReplies",
    "apply_body",
    "error_reply",
    "features_from_headers",
]

# Each name above is imported when first used (scorer/lazy.py says why).
__getattr__, __dir__ = lazy_exports(globals())
