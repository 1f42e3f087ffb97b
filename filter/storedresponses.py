"""Where each stored Responses API response lives, so that a request that continues one reaches its server.

A Responses API request may continue a stored response (``previous_response_id``); vLLM keeps stored responses in
the memory of the server that made them, so any other server answers 404. The picker learns where each response
was made from the response itself: with ``otel.latency_source: stream`` Envoy mirrors the first chunk of every
response body to the picker (`filter.observe`), and a Responses API response names its id at its start (``{"id":
"resp_..."`` whole, or in its first ``response.created`` event when streamed). `StoredResponses` keeps the newest
`CAPACITY` ids with the address that served each; a request that names one of them as its
``previous_response_id`` is routed to that address alone, as the gateway's subset hint would (if it is a serving
member of the pool: otherwise it routes as any other request, and its server answers as it will). Without the
mirrored responses nothing is learned and nothing is pinned; with several pickers each learns what it observes.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

import orjson

__all__ = ["CAPACITY", "StoredResponses", "StoredStats", "previous_response_id"]

CAPACITY = 1 << 16
# A response's id, within the first FIRST_BYTES of its body: the first "id" whose value starts with resp_.
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_\-]{1,200})"')
FIRST_BYTES = 4096
_PREVIOUS = b'"previous_response_id"'
MAX_ID_CHARS = 256


@dataclass(slots=True)
class StoredStats:
    """Counters (event-loop owned)."""

    learned: int = 0  # response ids seen in the responses observed
    pinned: int = 0  # requests routed to the server that stored the response they continue
    unknown: int = 0  # requests naming a response this picker has not seen (made before it, elsewhere, forgotten)
    gone: int = 0  # requests whose response's server is no longer a serving member


class StoredResponses:
    """The newest `CAPACITY` response ids observed, with the address that served each. One event loop."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self.stats = StoredStats()
        self._homes: OrderedDict[str, str] = OrderedDict()

    def learn(self, body: bytes, address: str) -> None:
        """The first chunk of a response ``address`` served: if it is a Responses API response, remember its id."""
        if b'"resp_' not in body[:FIRST_BYTES]:
            return  # most responses: one substring search
        found = _RESPONSE_ID.search(body, 0, FIRST_BYTES)
        if found is None:
            return
        homes = self._homes
        key = found.group(1).decode()
        homes.pop(key, None)
        homes[key] = address
        while len(homes) > self.capacity:
            homes.popitem(last=False)
        self.stats.learned += 1

    def home(self, response_id: str) -> str | None:
        """The address that served response ``response_id``, or None where it was not observed (or is forgotten)."""
        address = self._homes.get(response_id)
        if address is None:
            self.stats.unknown += 1
        return address


def previous_response_id(body: bytes) -> str | None:
    """The ``previous_response_id`` a Responses API request body names (None: none, or not a string of at most
    `MAX_ID_CHARS`). Reads the JSON only when the name is in the body at all."""
    if _PREVIOUS not in body:
        return None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    value = doc.get("previous_response_id") if isinstance(doc, dict) else None
    return value if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS else None
