"""The Envoy ext_proc filter: the gRPC service that turns each request into a routing decision."""

from __future__ import annotations

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
