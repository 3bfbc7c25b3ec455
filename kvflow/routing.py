"""Which engine serves a request (data parallelism): a sans-IO policy core.

    request ──▶ Router.route(tokens, salt, rank, lora, images) ──▶ Decision(engine, policy, prefix_hit)
    stats   ──▶ Router.observe_load(engine, waiting, running)
    availability ──▶ Router.set_available(engine, bool)   restart ──▶ Router.forget(engine)

Policies (`--load-balance`):
- `least-load`: the lowest score `waiting * 4 + running` (vLLM's), from the engine's last
  stats plus the requests this frontend sent it since those stats (its own in flight
  that the engine could not count yet), so a burst between two stats messages spreads
  out instead of landing on the engine that looked idle; counting every request this
  frontend has in flight on top would count each twice once the stats include it;
- `prefix-aware` (default): the engine that last took the longest prefix of this prompt,
  by block-hash chain (the same `extend_block_hashes` the engines' prefix cache uses,
  with the images' hashes, so a "hit" here is a block the engine may still hold: two
  prompts whose placeholder runs hold different images share no block); least-load when no prefix is known
  or when that engine's score exceeds the least-loaded one's by `overload_threshold`;
- `round-robin`.
An explicit `data_parallel_rank` wins over every policy. Engines not available (dead,
silent, restarting) are never picked; the map forgets an engine that restarted (its
cache died with it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvflow.block_hash import BlockHash, ImageSpan, extend_block_hashes
from kvflow.config import LoadBalance

WAITING_WEIGHT = 4


class NoEngineError(Exception):
    """No engine can take the request (all down, or the asked rank is)."""


@dataclass(frozen=True)
class RoutingConfig:
    policy: LoadBalance = "prefix-aware"
    block_size: int = 16  # the engines' KV block size: hashes must match theirs
    max_prefix_entries: int = 1 << 16  # block hashes remembered (LRU), ~100 B each
    overload_threshold: int = 16  # score margin over the least-loaded engine


@dataclass(frozen=True)
class Decision:
    engine: int
    policy: str  # the policy that decided: the configured one, "rank" or "least-load"
    prefix_hit: bool = False  # a known prefix chose the engine


@dataclass
class _Load:
    waiting: int = 0
    running: int = 0
    sent: int = 0  # this frontend's requests sent since the engine's last stats

    @property
    def score(self) -> int:
        return self.waiting * WAITING_WEIGHT + self.running + self.sent


@dataclass
class Router:
    config: RoutingConfig
    num_engines: int
    _loads: list[_Load] = field(init=False)
    _available: list[bool] = field(init=False)
    _prefixes: OrderedDict[BlockHash, int] = field(init=False, default_factory=OrderedDict)
    _next: int = 0

    def __post_init__(self) -> None:
        self._loads = [_Load() for _ in range(self.num_engines)]
        self._available = [True] * self.num_engines

    def set_available(self, engine: int, available: bool) -> None:
        self._available[engine] = available

    def forget(self, engine: int) -> None:
        """The engine restarted: its prefix cache is empty."""
        for key in [k for k, owner in self._prefixes.items() if owner == engine]:
            del self._prefixes[key]
        self._loads[engine] = _Load()

    def observe_load(self, engine: int, waiting: int, running: int) -> None:
        """The stats count every request the engine took, ours included."""
        self._loads[engine] = _Load(waiting, running)

    def score(self, engine: int) -> int:
        return self._loads[engine].score

    def route(
        self, token_ids: list[int], cache_salt: str | None = None, rank: int | None = None,
        lora_id: int = 0, image_spans: Sequence[ImageSpan] = (),
    ) -> Decision:  # fmt: skip
        candidates = [i for i in range(self.num_engines) if self._available[i]]
        if rank is not None:
            if not 0 <= rank < self.num_engines or not self._available[rank]:
                raise NoEngineError(f"data_parallel_rank {rank} is not serving")
            decision = Decision(rank, "rank")
        elif not candidates:
            raise NoEngineError("no engine is serving")
        elif self.num_engines == 1:  # nothing to choose: no hashing on the default path
            decision = Decision(0, self.config.policy)
        elif self.config.policy == "round-robin":
            decision = Decision(self._round_robin(candidates), "round-robin")
        elif self.config.policy == "least-load":
            decision = Decision(self._least_loaded(candidates), "least-load")
        else:
            decision = self._prefix_aware(candidates, token_ids, cache_salt, lora_id, image_spans)
        self._loads[decision.engine].sent += 1
        return decision

    def _round_robin(self, candidates: list[int]) -> int:
        engine = min(candidates, key=lambda i: (i - self._next) % self.num_engines)
        self._next = (engine + 1) % self.num_engines
        return engine

    def _least_loaded(self, candidates: list[int]) -> int:
        # Ties go round-robin, so an idle DP group spreads its first requests.
        best = min(self.score(i) for i in candidates)
        return self._round_robin([i for i in candidates if self.score(i) == best])

    def _prefix_aware(
        self, candidates: list[int], token_ids: list[int], cache_salt: str | None, lora_id: int,
        image_spans: Sequence[ImageSpan],
    ) -> Decision:  # fmt: skip
        block_size = self.config.block_size
        hashes = extend_block_hashes([], token_ids, block_size, cache_salt, image_spans, lora_id)
        owner = self._longest_prefix_owner(hashes, candidates)
        least = self._least_loaded(candidates) if owner is None else None
        if owner is not None:
            floor = min(self.score(i) for i in candidates)
            if self.score(owner) - floor > self.config.overload_threshold:
                least = self._least_loaded(candidates)
        engine = least if least is not None else owner
        assert engine is not None
        self._remember(hashes, engine)
        if least is not None:
            return Decision(engine, "least-load")
        return Decision(engine, "prefix-aware", prefix_hit=True)

    def _longest_prefix_owner(self, hashes: list[BlockHash], candidates: list[int]) -> int | None:
        # A chained hash stands for its whole prefix: the deepest known one wins.
        for key in reversed(hashes):
            owner = self._prefixes.get(key)
            if owner is not None and owner in candidates:
                return owner
        return None

    def _remember(self, hashes: list[BlockHash], engine: int) -> None:
        for key in hashes:
            self._prefixes[key] = engine
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > self.config.max_prefix_entries:
            self._prefixes.popitem(last=False)
