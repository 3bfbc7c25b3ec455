"""Grammar compilation off the engine loop: a thread pool and an LRU cache.

Compiling a grammar against the tokenizer (xgrammar's per-token mask cache) takes from
milliseconds to seconds; the loop only submits and polls, so a step never waits on it.
xgrammar releases the GIL while it compiles (measured: the loop's 1 ms sleeps kept
their pace while an 80-field schema compiled for 0.55 s), so threads suffice and
compiled grammars never cross a process boundary.

The cache is keyed by `grammar_key` (kind + canonical text + whitespace options): the
same schema sent with other key order or spacing compiles once. A compile that fails
is not cached. The tokenizer's vocabulary table (xgrammar's `TokenizerInfo`) is built
on the first compile, in the pool, so a server that never sees a guided request never
pays for it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvflow.sampling_params import StructuredOutputsParams
from kvflow.structured_outputs import build_grammar, grammar_key

if TYPE_CHECKING:
    import xgrammar

    from kvflow.services.scheduler.admission import EngineLimits

TokenizerSource = Callable[[], Any]  # -> a Hugging Face tokenizer


@dataclass(frozen=True)
class GrammarCompilerConfig:
    vocab_size: int  # the model's full vocabulary (logits width), padded ids included
    stop_token_ids: frozenset[int]  # the engine's EOS ids: a finished grammar allows these
    cache_size: int = 256  # compiled grammars kept
    max_workers: int = 2  # a pathological compile holds one thread; others keep going


@dataclass
class CompileStats:
    """Counts since start; `compile_seconds` is drained by whoever exports metrics."""

    cache_hits: int = 0
    cache_misses: int = 0
    timeouts: int = 0
    compile_seconds: list[float] = field(default_factory=list)
    requests_by_kind: dict[str, int] = field(default_factory=dict)

    def take_compile_seconds(self) -> list[float]:
        taken, self.compile_seconds = self.compile_seconds, []
        return taken


class GrammarCompiler:
    def __init__(self, config: GrammarCompilerConfig, tokenizer: TokenizerSource) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._init_lock = threading.Lock()
        self._cache: OrderedDict[str, xgrammar.CompiledGrammar] = OrderedDict()
        self._inflight: dict[str, Future[xgrammar.CompiledGrammar]] = {}
        self._pool = ThreadPoolExecutor(config.max_workers, thread_name_prefix="grammar")
        self.stats = CompileStats()

    def submit(self, params: StructuredOutputsParams) -> Future[xgrammar.CompiledGrammar]:
        """A future of the compiled grammar: already done on a cache hit; shared with a
        compile of the same grammar already under way (also a hit: misses count the
        compiles). Called from the loop only."""
        kind = params.kind
        self.stats.requests_by_kind[kind] = self.stats.requests_by_kind.get(kind, 0) + 1
        key = grammar_key(params)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.stats.cache_hits += 1
            done: Future[xgrammar.CompiledGrammar] = Future()
            done.set_result(cached)
            return done
        future = self._inflight.get(key)
        if future is not None:  # the same grammar is compiling: share it (no compile)
            self.stats.cache_hits += 1
            return future
        self.stats.cache_misses += 1
        future = self._pool.submit(self._compile, params)
        self._inflight[key] = future
        return future

    def collect(self) -> None:
        """Move finished compiles into the cache (the loop calls this; the cache is only
        touched from the loop's thread)."""
        for key, future in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[key]
            if future.exception() is None:
                self._cache[key] = future.result()
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)

    def _compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        start = time.perf_counter()
        grammar = build_grammar(params)
        compiled = self._get_compiler().compile_grammar(grammar)
        _check_some_token_starts(compiled)
        self.stats.compile_seconds.append(time.perf_counter() - start)
        return compiled

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer(),
                    vocab_size=self.config.vocab_size,
                    stop_token_ids=sorted(self.config.stop_token_ids),
                )
                # Our own cache is keyed by canonical text; xgrammar's would duplicate it.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _check_some_token_starts(compiled: xgrammar.CompiledGrammar) -> None:
    """ValueError (the request's 400) when no token of the vocabulary may come first: the
    grammar matches text (checked at the frontend), but only text this tokenizer cannot
    write, e.g. a character none of its tokens or byte tokens spell. Sampling would
    otherwise pick from an empty mask and fail the request mid-way."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    if not bool(bitmask.any()):
        raise ValueError("no token of this model's vocabulary can begin text that it accepts")


def grammar_compiler(limits: EngineLimits, tokenizer: TokenizerSource) -> GrammarCompiler:
    """The compiler of an engine: its vocabulary and EOS ids are the engine's."""
    return GrammarCompiler(
        GrammarCompilerConfig(limits.vocab_size, limits.eos_token_ids), tokenizer
    )
