"""A stand-in for GPU inference servers: one vLLM-like engine model on two clocks.

`EmulatedServer` serves vLLM's HTTP API, metrics and spans in real (or scaled) time; `simulate` runs fleets of the
same engine on a virtual clock, driven by traces from `load_trace`. See sim/README.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferlb.scorer.lazy import lazy_exports

if TYPE_CHECKING:
    from inferlb.sim.des import Arrival, FaultEvent, FleetView, RequestRecord, ServerSnapshot, SimResult, simulate
    from inferlb.sim.engine import EngineModel, EngineOptions, SimRequest
    from inferlb.sim.profiles import PROFILES, ServerProfile, get_profile
    from inferlb.sim.server import EmulatedServer, ServerOptions
    from inferlb.sim.traces import Trace, TraceError, TraceRequest, block_keys, load_trace, prompt_text

__all__ = [
    "PROFILES",
    "Arrival",
    "EmulatedServer",
    "EngineModel",
    "EngineOptions",
    "FaultEvent",
    "FleetView",
    "RequestRecord",
    "ServerOptions",
    "ServerProfile",
    "ServerSnapshot",
    "SimRequest",
    "SimResult",
    "Trace",
    "TraceError",
    "TraceRequest",
    "block_keys",
    "get_profile",
    "load_trace",
    "prompt_text",
    "simulate",
]

# Each name above is imported when first used (scorer/lazy.py says why).
__getattr__, __dir__ = lazy_exports(globals())
