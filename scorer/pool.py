"""The endpoint pool: the inference servers a picker may choose from, fixed when the config is loaded."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from inferlb.scorer.address import parse_address
from inferlb.scorer.errors import ConfigError, UnknownModelError

if TYPE_CHECKING:
    from inferlb.scorer.config import EndpointConfig


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One inference server. ``index`` is its position in the pool and in every per-endpoint array."""

    index: int
    address: str
    host: str
    port: int
    models: frozenset[str] | None
    labels: Mapping[str, str]

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models


class Pool:
    """An immutable, ordered set of endpoints with per-model candidate masks computed up front.

    Safe to share between tasks and threads: nothing changes after construction.
    """

    def __init__(self, endpoints: Sequence[EndpointConfig]) -> None:
        if not endpoints:
            raise ConfigError("a pool needs at least one endpoint")
        built = []
        for i, cfg in enumerate(endpoints):
            host, port = parse_address(cfg.address)
            built.append(Endpoint(i, cfg.address, host, port, cfg.models, dict(cfg.labels)))
        self.endpoints: tuple[Endpoint, ...] = tuple(built)
        self.served_models: frozenset[str] = frozenset(m for e in built if e.models for m in e.models)
        self._any_model = np.array([e.models is None for e in built], dtype=bool)
        self._masks = {model: np.array([e.serves(model) for e in built], dtype=bool) for model in self.served_models}
        self._all = np.ones(len(built), dtype=bool)
        self.all_indices = np.arange(len(built), dtype=np.intp)
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
        if self._any_model.any():
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
        if len(self._any_model_indices):
            return self._any_model_indices
        raise UnknownModelError(model, self.served_models)
