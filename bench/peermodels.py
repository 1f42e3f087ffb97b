"""Models of the peer routers' policies for the discrete-event simulator (`inferlb.sim.des`).

Each model is a DES policy (``policy(arrival, view) -> server``) that decides as the real router does, from what
that router sees: the requests it routed itself (its in-flight counts, the prompts it sent where), plus the server
state the real router reads: scraped metrics for the Inference Extension (``view.snapshots``), the servers' KV
events for Dynamo (their exact caches, ``view.engines[i].cache``, as `PresetPolicy` with ``kv_events`` reads them).
The sources were read to learn the algorithms; no code was copied. Versions and defaults:

* sglang-router 0.3.2 (PyPI, the live peer; Rust core read at sgl-project/sglang ``sgl-router/src/policies/
  cache_aware.rs`` and ``tree.rs``, commit 026f853b): ``cache_aware`` keeps one approximate radix tree of the text
  it routed, each node tagged with the workers ("tenants") it sent that text to and when. Load is the router's own
  in-flight count per worker. When ``max - min > balance_abs_threshold`` (64) and ``max > min *
  balance_rel_threshold`` (1.5) it sends to the least-loaded worker (the first in worker order on a tie). Otherwise
  it finds the longest prefix of the text in the tree; if matched/total characters ``> cache_threshold`` (0.3) it
  sends to the *first* tenant of the deepest matched node (the first in that node's own DashMap's order: each
  node's map has hash keys of its own, so each node orders the workers its own arbitrary way; modelled as a
  seeded hash of the node and the worker), else to the tenant whose tree holds the fewest characters (ties: the
  order of that one map, a seeded permutation of the workers). Until 2026-12-05 the model ordered every node by
  one permutation, which sent 30% of the Mooncake window's requests to one worker and disagreed with the live
  peers at load 0.8 (bench/results/quality/peer-models/README.md). The text is then inserted under the chosen
  worker. Every ``eviction_interval_secs`` (60; the Python launcher's default, the Rust default is 120) each
  tenant over ``max_tree_size`` characters (2**26) loses its least recently used leaves. The live peer runs with these
  defaults (`inferlb.bench.peers` passes no cache-aware flag).
* vllm-router 0.1.17 (PyPI, the live peer; Rust read at vllm-project/router ``src/policies/cache_aware.rs``,
  ``consistent_hash.rs``, ``hash_key.rs``, commit 080589a0): ``cache_aware`` is sglang-router's algorithm (the
  project forked it) with its own defaults: threshold 0.3, 64, 1.5, eviction every 120 s, ``max_tree_size`` 2**25.
  ``power_of_two`` (both routers): two distinct workers drawn at random, the one with fewer in-flight requests
  wins (ties to the first drawn); their ``/get_load`` poll gets 404 from vLLM, so the in-flight count is what they
  use. ``consistent_hash``: a ring of 160 virtual nodes per worker (``"URL:i"``), the first node at or after the
  key's hash; the key is a session header (``x-session-id``, ``x-user-id``, ..., ``x-request-id``) or body field
  (``session_params.session_id``, ``user``), else the hash of the request text. The real ring hashes with
  mcrouter's furc/murmur hash; this model uses BLAKE2b, so its ring is a different but equally uniform one.
* The Gateway API Inference Extension's default scheduling profile (kubernetes-sigs/gateway-api-inference-extension
  ``pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go`` at 00913f92; the weights of the EPP's built-in
  ``defaultPluginsConfig``, as llm-d's inference scheduler deploys it): ``queue-scorer`` weight 2 (``(max - q) /
  (max - min)`` of the scraped waiting queues, 1 when all are equal), ``kv-cache-utilization-scorer`` weight 2
  (``1 - kv usage``), ``prefix-cache-scorer`` weight 3 (matched/total of the prompt's chained 64-character block
  hashes, the first "block" being the model name, at most 256 blocks; a greedy count from the first block that
  stops at the first block no server holds; the chosen server's blocks enter its LRU of 31,250 entries), then
  ``max-score-picker`` (highest weighted sum, ties at random). Its flow control (saturation detector) is not
  modelled.
* Dynamo's KV router (ai-dynamo/dynamo ``lib/llm/src/kv_router``: the scheduler's default worker selector and
  ``KvRouterConfig``; docs ``docs/router``): per worker, ``logit = overlap_score_weight * prefill_blocks +
  decode_blocks``, where ``prefill_blocks`` is the prompt tokens the worker would still have to prefill (those of
  its requests that have no first token yet, plus this request's tokens not in its cache) over the block size,
  and ``decode_blocks`` the distinct blocks of its active requests with this one's added. Overlap comes from KV
  events (on by default): the exact cache. Defaults: ``overlap_score_weight`` 1.0, ``router_temperature`` 0.0
  (the lowest logit, ties at random; above 0, a softmax over the negated logits scaled to [0, 1]).

The DES requests carry the servers' chained block hashes (16 tokens a block here) and token counts, not text: the
text-based trees take one block as one symbol (a match is counted in blocks, converted to characters at the
emulator's 4 characters per token). Prompts diverge only at block boundaries, but a character tree goes on a
character or two into a child that happens to start with the same character, and takes that child's tenant: the
model draws each symbol's first character from its key to do the same (checked against the live peers:
bench/results/quality/peer-models/README.md). For the Inference Extension one
DES block of 16 tokens is one of its 64-character blocks, as the emulator writes 4 characters per token.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from inferlb.sim.des import Arrival, FleetView, Policy, RequestRecord
from inferlb.sim.profiles import ServerProfile

__all__ = [
    "PEER_MODELS",
    "SGLANG_CACHE_AWARE",
    "VLLM_ROUTER_CACHE_AWARE",
    "ApproxTree",
    "CacheAware",
    "CacheAwareConfig",
    "ConsistentHash",
    "DynamoKv",
    "GieDefault",
    "HashRing",
    "PowerOfTwo",
    "peer_model",
]

CHARS_PER_TOKEN = 4  # what the emulator's synthetic prompts hold (`inferlb.sim.traces.prompt_text`)
ALPHABET = 64  # the characters the emulator's synthetic prompt text is drawn from, uniformly


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """The cache-aware policy's settings, named as the routers' flags are (``max_tree_chars``: ``max_tree_size``)."""

    cache_threshold: float
    balance_abs_threshold: int
    balance_rel_threshold: float
    eviction_interval_s: float
    max_tree_chars: int

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1]; got {self.cache_threshold!r}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 0:
            raise ValueError("balance_abs_threshold and balance_rel_threshold must be >= 0")
        if self.eviction_interval_s <= 0 or self.max_tree_chars < 1:
            raise ValueError("eviction_interval_s must be > 0 and max_tree_chars >= 1")


SGLANG_CACHE_AWARE = CacheAwareConfig(0.3, 64, 1.5, 60.0, 2**26)  # sglang-router 0.3.2's launcher defaults
VLLM_ROUTER_CACHE_AWARE = CacheAwareConfig(0.3, 64, 1.5, 120.0, 2**25)  # vllm-router 0.1.17's launcher defaults


class _Node:
    __slots__ = ("chars", "children", "parent", "tenants")

    def __init__(self, parent: int | None, chars: int) -> None:
        self.parent = parent
        self.chars = chars
        self.children: set[int] = set()
        self.tenants: dict[int, float] = {}  # worker -> last access time


class ApproxTree:
    """The routers' approximate radix tree over symbols that are chained block keys (a key names its whole prefix,
    so a path is a run of keys and the tree is a map from key to node). Tenants are worker indexes. Single-threaded;
    no I/O.

    Which tenant is a node's "first" is its tenant map's iteration order. In the routers every node has a map of
    its own (a ``DashMap`` built with a fresh ``RandomState``: Rust's std gives each one different hash keys), so
    each node orders the workers its own arbitrary way; a ``salt`` draws those orders (a node's rank of a worker is
    a hash of the salt, the node and the worker). Without one every node orders them as ``order`` does, which is
    also the order of the one map of characters per tenant that breaks the ties of `smallest`."""

    def __init__(self, workers: int, order: Sequence[int], alphabet: int = ALPHABET, salt: int | None = None) -> None:
        if alphabet < 1:
            raise ValueError(f"alphabet must be >= 1; got {alphabet!r}")
        self._nodes: dict[int, _Node] = {}
        self._roots: set[int] = set()
        self._rank = {w: k for k, w in enumerate(order)}
        self._salt = salt
        self._alphabet = alphabet
        self.chars = [0] * workers  # characters per tenant, as the routers' tenant_char_count

    def match(self, keys: Sequence[int], now: float) -> tuple[int, int | None]:
        """(symbols matched from the start, the first tenant of the deepest matched node or None); refreshes that
        tenant's access time along the path, as the routers' prefix_match does.

        Where the walk stops short of the prompt's end, the character-level tree goes on into a child whose text
        starts with the prompt's next character, if there is one: the routers then take that child's first tenant.
        Each symbol's first character is drawn from its key (``alphabet`` characters, uniform), and a child stands
        for the tenants of all the symbols under the node that start with that character, as the character tree
        has them in one node."""
        depth, last = 0, None
        for key in keys:
            if key not in self._nodes:
                break
            depth, last = depth + 1, key
        node = None if last is None else self._nodes[last]
        tenants: Iterable[int] = () if node is None else node.tenants
        holder = -1 if last is None else last  # the node whose map orders the tenants (-1: the root)
        if depth < len(keys):
            first = self._first_char(keys[depth])
            siblings = self._roots if node is None else node.children
            below = {t for c in siblings if self._first_char(c) == first for t in self._nodes[c].tenants}
            if below:
                tenants = below
                holder = _mix64(holder ^ (first + 1))  # the child that starts with that character
        if not tenants:
            return depth, None
        if self._salt is None:
            tenant = min(tenants, key=self._rank.__getitem__)
        else:
            salt = self._salt ^ holder
            tenant = min(tenants, key=lambda w: _mix64(salt ^ (w + 1) * 0x9E3779B97F4A7C15))
        cursor: int | None = last
        while cursor is not None:
            walk = self._nodes[cursor]
            if tenant in walk.tenants:
                walk.tenants[tenant] = now
            cursor = walk.parent
        return depth, tenant

    def _first_char(self, key: int) -> int:
        return (((key * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> 40) % self._alphabet

    def insert(self, keys: Sequence[int], chars: Sequence[int], tenant: int, now: float) -> None:
        """Record that ``tenant`` was sent the text whose symbols are ``keys`` (``chars[i]`` characters each)."""
        parent: int | None = None
        for key, size in zip(keys, chars, strict=True):
            node = self._nodes.get(key)
            if node is None:
                node = self._nodes[key] = _Node(parent, size)
                (self._roots if parent is None else self._nodes[parent].children).add(key)
            if tenant not in node.tenants:
                self.chars[tenant] += node.chars
            node.tenants[tenant] = now
            parent = key

    def smallest(self) -> int:
        """The tenant holding the fewest characters (ties: the first in ``order``)."""
        return min(range(len(self.chars)), key=lambda w: (self.chars[w], self._rank[w]))

    def evict(self, max_chars: int) -> None:
        """Each tenant over ``max_chars`` loses its least recently used leaves until it is not."""
        heap: list[tuple[float, int, int]] = []
        for key, each in self._nodes.items():
            for tenant, at in each.tenants.items():
                if self.chars[tenant] > max_chars and self._is_leaf(key, tenant):
                    heap.append((at, key, tenant))
        heapq.heapify(heap)
        while heap:
            _, key, tenant = heapq.heappop(heap)
            node = self._nodes.get(key)
            if node is None or tenant not in node.tenants or self.chars[tenant] <= max_chars:
                continue
            del node.tenants[tenant]
            self.chars[tenant] -= node.chars
            parent = node.parent
            if not node.tenants and not node.children:
                del self._nodes[key]
                (self._roots if parent is None else self._nodes[parent].children).discard(key)
            if parent is not None and self._is_leaf(parent, tenant):
                heapq.heappush(heap, (self._nodes[parent].tenants[tenant], parent, tenant))

    def _is_leaf(self, key: int, tenant: int) -> bool:
        node = self._nodes[key]
        return tenant in node.tenants and not any(tenant in self._nodes[c].tenants for c in node.children)


def _mix64(value: int) -> int:
    """A 64-bit finaliser (splitmix64's): independent-looking outputs for nearby inputs."""
    value &= 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return value ^ (value >> 31)


def _symbols(arrival: Arrival, block_size: int, tail_key: int) -> tuple[list[int], list[int]]:
    """The prompt as tree symbols: its full blocks' keys, then (if the prompt ends inside a block) one symbol for
    the rest, unique to the request. With the characters of each."""
    keys = list(arrival.prompt_hashes)
    chars = [block_size * CHARS_PER_TOKEN] * len(keys)
    rest = arrival.prompt_tokens - len(keys) * block_size
    if rest > 0:
        keys.append(tail_key)
        chars.append(rest * CHARS_PER_TOKEN)
    return keys, chars


class CacheAware:
    """sglang-router's and vllm-router's ``cache_aware`` policy (see the module docstring); ``config`` picks whose
    defaults. ``view.inflight`` is the router's own per-worker load."""

    def __init__(self, config: CacheAwareConfig, workers: int, block_size: int, seed: int) -> None:
        self.config = config
        self.block_size = block_size
        rng = random.Random(seed)
        order = list(range(workers))
        rng.shuffle(order)
        self.tree = ApproxTree(workers, order, salt=rng.getrandbits(64))
        self._evicted_at = 0.0
        self._tails = 0
        self.balanced = self.cached = self.smallest = 0  # decisions per branch

    def __call__(self, arrival: Arrival, view: FleetView) -> int:
        now = view.now
        if now - self._evicted_at >= self.config.eviction_interval_s:
            self._evicted_at = now
            self.tree.evict(self.config.max_tree_chars)
        self._tails -= 1  # negative: block keys of shared text are >= 0 for ids, and filler keys are per request
        keys, chars = _symbols(arrival, self.block_size, (-1 << 62) + self._tails)
        loads = view.inflight
        high, low = max(loads), min(loads)
        cfg = self.config
        if high - low > cfg.balance_abs_threshold and high > low * cfg.balance_rel_threshold:
            chosen = loads.index(low)
            self.balanced += 1
        else:
            depth, tenant = self.tree.match(keys, now)
            total = sum(chars)
            rate = sum(chars[:depth]) / total if total else 0.0
            if tenant is not None and rate > cfg.cache_threshold:
                chosen = tenant
                self.cached += 1
            else:
                chosen = self.tree.smallest()
                self.smallest += 1
        self.tree.insert(keys, chars, chosen, now)
        return chosen


class PowerOfTwo:
    """Both routers' ``power_of_two``: of two distinct random workers, the one with fewer in-flight requests."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def __call__(self, arrival: Arrival, view: FleetView) -> int:
        n = len(view.servers)
        if n == 1:
            return 0
        first = self._rng.randrange(n)
        second = self._rng.randrange(n - 1)
        second += second >= first
        return first if view.inflight[first] <= view.inflight[second] else second


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class HashRing:
    """A consistent-hash ring of ``virtual_nodes`` points per worker name; ``lookup`` gives the worker owning the
    first point at or after a key's hash (wrapping). Adding a worker moves only the keys its points capture. A
    ``salt`` other than "" places the points elsewhere: another deployment's ring (its workers' URLs differ)."""

    def __init__(self, names: Sequence[str], virtual_nodes: int = 160, salt: str = "") -> None:
        points = sorted((_hash64(f"{salt}{name}:{i}"), name) for name in names for i in range(virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._names = [name for _, name in points]

    def lookup(self, key: str) -> str:
        if not self._hashes:
            raise ValueError("the ring has no workers")
        k = bisect.bisect_left(self._hashes, _hash64(key))
        return self._names[k % len(self._names)]


class ConsistentHash:
    """vllm-router's ``consistent_hash``: a string ``arrival.tag`` stands for an ``x-session-id`` header; without
    one the key is the request's text (here its block keys and length), so each distinct prompt lands on a fixed
    but arbitrary worker.

    The real ring hashes the workers' URLs, so each deployment gets a ring of its own, and with 4 workers one of
    them may own 30% of the keys where another ring gives none over 27% (two live runs of 2026-12-05 on the same
    requests). Seed 0 is one ring; each other ``seed`` draws another, as another deployment would."""

    def __init__(self, virtual_nodes: int = 160, seed: int = 0) -> None:
        self.virtual_nodes = virtual_nodes
        self.salt = "" if seed == 0 else f"{seed}/"
        self._ring: HashRing | None = None
        self._names: tuple[str, ...] = ()

    def key(self, arrival: Arrival) -> str:
        if isinstance(arrival.tag, str) and arrival.tag:
            return f"header:x-session-id:{arrival.tag}"
        digest = hashlib.blake2b(digest_size=8)
        digest.update(b"%d:" % arrival.prompt_tokens)
        for key in arrival.prompt_hashes:
            digest.update(b"%d," % key)
        return f"request_hash:{digest.hexdigest()}"

    def __call__(self, arrival: Arrival, view: FleetView) -> int:
        if self._ring is None or view.servers != self._names:
            self._names = view.servers
            self._ring = HashRing(view.servers, self.virtual_nodes, self.salt)
        return view.servers.index(self._ring.lookup(self.key(arrival)))


@dataclass(frozen=True, slots=True)
class GieWeights:
    """The default profile's scorer weights."""

    queue: float = 2.0
    kv_cache: float = 2.0
    prefix: float = 3.0


class GieDefault:
    """The Inference Extension's default profile (see the module docstring): scraped queue and KV-cache scores,
    its own prefix index of the prompts it routed, the weighted sum's maximum with random ties."""

    MODEL_BLOCK = -(1 << 63)  # the first "block": the model name's hash, the same for every request here

    def __init__(
        self,
        workers: int,
        block_size: int,
        seed: int,
        weights: GieWeights = GieWeights(),
        max_blocks: int = 256,
        lru_capacity: int = 31250,
    ) -> None:
        self.weights = weights
        self.max_blocks = max_blocks
        self.lru_capacity = lru_capacity
        self._step = max(1, 64 // (block_size * CHARS_PER_TOKEN))  # DES blocks per 64-character block
        self._lrus: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(workers)]
        self._holders: dict[int, set[int]] = {}
        self._rng = random.Random(seed)

    def hashes(self, arrival: Arrival) -> list[int]:
        """The prompt's block hashes as the prefix scorer cuts them: the model's, then one per 64 characters."""
        return [self.MODEL_BLOCK, *arrival.prompt_hashes[self._step - 1 :: self._step][: self.max_blocks]]

    def prefix_scores(self, hashes: Sequence[int], n: int) -> list[float]:
        matched = [0] * n
        for block in hashes:
            holders = self._holders.get(block)
            if not holders:
                break
            for server in holders:
                matched[server] += 1
        return [m / len(hashes) for m in matched]

    def __call__(self, arrival: Arrival, view: FleetView) -> int:
        n = len(view.servers)
        waiting = [float(s.waiting) if s is not None else 0.0 for s in view.snapshots]
        usage = [s.kv_cache_usage if s is not None else 0.0 for s in view.snapshots]
        high, low = max(waiting), min(waiting)
        queue = [1.0 if high == low else (high - q) / (high - low) for q in waiting]
        hashes = self.hashes(arrival)
        prefix = self.prefix_scores(hashes, n)
        w = self.weights
        totals = [
            w.queue * queue[i] + w.kv_cache * min(1.0, max(0.0, 1.0 - usage[i])) + w.prefix * prefix[i]
            for i in range(n)
        ]
        best = max(totals)
        chosen = self._rng.choice([i for i in range(n) if totals[i] == best])
        self._record(hashes, chosen)
        return chosen

    def _record(self, hashes: Sequence[int], server: int) -> None:
        lru = self._lrus[server]
        for block in hashes:
            if block in lru:
                lru.move_to_end(block)
                continue
            lru[block] = None
            self._holders.setdefault(block, set()).add(server)
            if len(lru) > self.lru_capacity:
                old, _ = lru.popitem(last=False)
                holders = self._holders[old]
                holders.discard(server)
                if not holders:
                    del self._holders[old]


class DynamoKv:
    """Dynamo's KV router (see the module docstring). Overlap is read from each server's cache (KV events); the
    active and prefilling requests are the router's own: a request prefills until its first token reaches the
    router (here: the engine reports one) and is active until it ends (``finished``)."""

    def __init__(
        self,
        workers: int,
        block_size: int,
        seed: int,
        overlap_score_weight: float = 1.0,
        temperature: float = 0.0,
    ) -> None:
        if overlap_score_weight < 0 or temperature < 0:
            raise ValueError("overlap_score_weight and temperature must be >= 0")
        self.block_size = block_size
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self._rng = random.Random(seed)
        self._active: list[dict[int, int]] = [{} for _ in range(workers)]  # block key -> requests holding it
        self._prefilling: list[dict[str, int]] = [{} for _ in range(workers)]  # request id -> tokens to prefill
        self._routed: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._tails = 0

    def logits(self, arrival: Arrival, view: FleetView) -> list[float]:
        """Each worker's cost for this request (lower is better)."""
        self._first_tokens(view)
        bs = self.block_size
        own = len(arrival.prompt_hashes) + (1 if arrival.prompt_tokens % bs else 0)
        out = []
        for i, engine in enumerate(view.engines):
            overlap, _ = engine.cache.match(arrival.prompt_hashes, len(arrival.prompt_hashes))
            prefill = sum(self._prefilling[i].values()) + max(0, arrival.prompt_tokens - overlap * bs)
            active = self._active[i]
            fresh = own - sum(1 for key in arrival.prompt_hashes if key in active)
            out.append(self.overlap_score_weight * prefill / bs + len(active) + fresh)
        return out

    def __call__(self, arrival: Arrival, view: FleetView) -> int:
        logits = self.logits(arrival, view)
        chosen = self._sample(logits)
        overlap, _ = view.engines[chosen].cache.match(arrival.prompt_hashes, len(arrival.prompt_hashes))
        self._tails -= 1
        blocks = (
            *arrival.prompt_hashes,
            *(((-1 << 62) + self._tails,) if arrival.prompt_tokens % self.block_size else ()),
        )
        for key in blocks:
            self._active[chosen][key] = self._active[chosen].get(key, 0) + 1
        self._prefilling[chosen][arrival.id] = max(0, arrival.prompt_tokens - overlap * self.block_size)
        self._routed[arrival.id] = (chosen, blocks)
        return chosen

    def finished(self, record: RequestRecord, now: float) -> None:
        """A request ended: it is no longer active on its worker."""
        routed = self._routed.pop(record.id, None)
        if routed is None:
            return
        server, blocks = routed
        self._prefilling[server].pop(record.id, None)
        active = self._active[server]
        for key in blocks:
            left = active[key] - 1
            if left:
                active[key] = left
            else:
                del active[key]

    def _first_tokens(self, view: FleetView) -> None:
        for i, pending in enumerate(self._prefilling):
            if pending:
                for request in view.engines[i].running:
                    if request.first_token_at is not None:
                        pending.pop(request.id, None)

    def _sample(self, logits: Sequence[float]) -> int:
        low = min(logits)
        if self.temperature == 0:
            return self._rng.choice([i for i, v in enumerate(logits) if v == low])
        span = (max(logits) - low) or 1.0
        weights = [math.exp(-(v - low) / span / self.temperature) for v in logits]
        return self._rng.choices(range(len(logits)), weights)[0]


def _block_size(profiles: Sequence[ServerProfile]) -> int:
    sizes = {p.block_size for p in profiles}
    if len(sizes) != 1:
        raise ValueError(f"the peer models need one block size across the fleet, not {sorted(sizes)}")
    return sizes.pop()


_FACTORIES: dict[str, Callable[[Sequence[ServerProfile], int], Policy]] = {
    "sglang-cache-aware": lambda p, s: CacheAware(SGLANG_CACHE_AWARE, len(p), _block_size(p), s),
    "sglang-power-of-two": lambda p, s: PowerOfTwo(s),
    "vllm-router-cache-aware": lambda p, s: CacheAware(VLLM_ROUTER_CACHE_AWARE, len(p), _block_size(p), s),
    "vllm-router-power-of-two": lambda p, s: PowerOfTwo(s),
    "vllm-router-consistent-hash": lambda p, s: ConsistentHash(seed=s),
    "gie-default": lambda p, s: GieDefault(len(p), _block_size(p), s),
    "dynamo-kv": lambda p, s: DynamoKv(len(p), _block_size(p), s),
}
PEER_MODELS: tuple[str, ...] = tuple(_FACTORIES)


def peer_model(name: str, profiles: Sequence[ServerProfile], seed: int) -> Policy:
    """The model named ``name`` (one of `PEER_MODELS`) for a fleet of ``profiles``; ValueError for another name."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown peer model {name!r}; known: {', '.join(PEER_MODELS)}")
    return factory(profiles, seed)
