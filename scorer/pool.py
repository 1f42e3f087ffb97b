"""The endpoint pool: the inference servers a picker may choose from, fixed for the life of one engine.

Membership changes (`scorer.membership`) build a new pool: an endpoint that left but still has requests in flight
stays in it as *draining* (no new requests, its arrays kept until its last request ends), and one that joined may
carry a slow-start `Ramp`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from inferlb.scorer.address import parse_address
from inferlb.scorer.errors import ConfigError, UnknownModelError

if TYPE_CHECKING:
    from inferlb.scorer.config import EndpointConfig
    from inferlb.scorer.membership import Ramp


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One inference server. ``index`` is its position in the pool and in every per-endpoint array."""

    index: int
    address: str
    host: str
    port: int
    models: frozenset[str] | None
    labels: Mapping[str, str]
    draining: bool = False  # left the pool; its requests in flight finish, no new one comes

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models


class Pool:
    """An immutable, ordered set of endpoints with per-model candidate masks computed up front.

    ``draining``: addresses of endpoints that left but still have requests in flight; they keep their index (and
    their place in every per-endpoint array) but are in no candidate mask, so no new request goes to them.
    ``ramps``: slow-start ramps of endpoints that joined recently, by address (`scorer.membership`); the pool's
    ``ramping`` pairs each with its endpoint's index. Safe to share between tasks and threads: nothing but the
    ramps' own progress changes after construction.
    """

    def __init__(
        self,
        endpoints: Sequence[EndpointConfig],
        *,
        draining: frozenset[str] = frozenset(),
        ramps: Mapping[str, Ramp] | None = None,
    ) -> None:
        if not endpoints:
            raise ConfigError("a pool needs at least one endpoint")
        built = []
        for i, cfg in enumerate(endpoints):
            host, port = parse_address(cfg.address)
            built.append(Endpoint(i, cfg.address, host, port, cfg.models, dict(cfg.labels), cfg.address in draining))
        self.endpoints: tuple[Endpoint, ...] = tuple(built)
        self.configs: tuple[EndpointConfig, ...] = tuple(endpoints)
        self.served_models: frozenset[str] = frozenset(m for e in built if e.models for m in e.models)
        serving = np.array([not e.draining for e in built], dtype=bool)
        # An endpoint that accepts any model name, draining or not: a model it alone serves is known, not refused.
        self._accepts_any = any(e.models is None for e in built)
        self._any_model = np.array([e.models is None for e in built], dtype=bool) & serving
        self._masks = {
            model: np.array([e.serves(model) for e in built], dtype=bool) & serving for model in self.served_models
        }
        self._all = serving
        self._by_address = {e.address: e.index for e in built}
        self.all_indices = np.flatnonzero(serving)
        ramps = ramps or {}
        self.ramping: tuple[tuple[int, Ramp], ...] = tuple(
            (e.index, ramps[e.address]) for e in built if e.address in ramps and not e.draining
        )
        self._indices = {model: np.flatnonzero(mask) for model, mask in self._masks.items()}
        self._any_model_indices = np.flatnonzero(self._any_model)
        # Handed to every plugin on every request: a plugin editing one in place must fail, not corrupt the pool.
        arrays = (self._any_model, self._all, self.all_indices, self._any_model_indices)
        for array in (*arrays, *self._masks.values(), *self._indices.values()):
            array.flags.writeable = False

    def __len__(self) -> int:
        return len(self.endpoints)

    def __iter__(self) -> Iterator[Endpoint]:
        return iter(self.endpoints)

    @property
    def draining(self) -> tuple[Endpoint, ...]:
        return tuple(e for e in self.endpoints if e.draining)

    def find(self, address: str) -> int | None:
        """The index of the member at ``address``, or None."""
        return self._by_address.get(address)

    def index_of(self) -> dict[str, int]:
        """Each endpoint's index by its address."""
        return {e.address: e.index for e in self.endpoints}

    def address_mask(self, addresses: Iterable[str]) -> np.ndarray:
        """Boolean mask of the serving endpoints at ``addresses`` (addresses not in the pool are ignored)."""
        mask = np.zeros(len(self.endpoints), dtype=bool)
        for address in addresses:
            index = self._by_address.get(address)
            if index is not None:
                mask[index] = True
        return mask & self._all

    def model_mask(self, model: str | None) -> np.ndarray:
        """Boolean mask of endpoints that serve ``model`` (all of them for None).

        Raises ``UnknownModelError`` when no endpoint serves it. Unknown names are never cached, so clients
        sending random model names cannot grow memory.
        """
        if model is None:
            return self._all
        mask = self._masks.get(model)
        if mask is not None:
            return mask
        if self._accepts_any:
            return self._any_model
        raise UnknownModelError(model, self.served_models)

    def model_indices(self, model: str | None) -> np.ndarray:
        """Indices of the endpoints that serve ``model`` (all for None), ascending; the same contract and
        errors as ``model_mask``."""
        if model is None:
            return self.all_indices
        indices = self._indices.get(model)
        if indices is not None:
            return indices
        if self._accepts_any:
            return self._any_model_indices
        raise UnknownModelError(model, self.served_models)
