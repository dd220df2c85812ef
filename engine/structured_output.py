"""Structured outputs: a request's output held to a JSON schema, any JSON object, a regex, a choice or an EBNF
grammar (`SamplingParams.structured_outputs`), with xgrammar, as vLLM v1 does it.

    submission   the constraint compiled on a thread pool, never on the engine's thread (an LRU of grammars keyed
                 by the constraint); a bad schema, regex or grammar is a ValueError before the request enters;
                 the request gets its own matcher once its grammar is ready
    every step   the batch's constrained rows only: every token a row's constraint does not allow -> -inf in the
                 logits, before anything else samples (`engine/sampler.py`; logprobs stay raw)
    after it     each constrained row's token goes into its matcher: a rejected token fails the request, an
                 accepted stop token (EOS, `stop_token_ids`) ends it with finish_reason "stop"

A matcher lives as long as its request, through preemption; an engine without xgrammar serves everything else
and refuses a constrained request with a ValueError. The lifecycle in full (stop tokens and min_tokens,
preemption, handed-off requests, the cost of an unconstrained step): docs/design/structured_output.md.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from k3serve.engine.constraint import ConstraintCompileError, import_xgrammar, parse_constraint, xgrammar_message
from k3serve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from k3serve.engine.structured_output_metrics import BoundGrammarCompileMetrics
from k3serve.kernels._backend import to_device_async

if TYPE_CHECKING:
    from k3serve.model.tokenizer import Tokenizer

COMPILED_GRAMMAR_CACHE_SIZE = 64
"""Compiled grammars kept for reuse. A request holds its own grammar while it runs, so eviction never recompiles
a running request's; it only makes a later request with that constraint compile it again."""

COMPILE_THREADS = 2
"""Constraints compiled at once, on their own threads: more than one, so a slow schema does not hold up every
request behind it; few, since xgrammar spreads each compilation over its own threads (`max_threads`, 8)."""


class ConstraintViolationError(RuntimeError):
    """A request's sampled token is not one its constraint allows (the mask left no token, e.g. min_tokens banned
    the only one, or the token came from another engine): the request cannot go on."""


class GrammarCompiler:
    """Compiles constraints against one engine's vocabulary, on `COMPILE_THREADS` threads of its own (started with
    the first compilation), so a compilation never stalls the thread that asks for it; thread-safe. The
    vocabulary (xgrammar's TokenizerInfo: every token id's bytes, the special tokens emptied so no grammar can match
    their text, the tokenizer's stop ids) is built with the first compilation, on those threads: an engine without
    constrained requests never pays it. Each constraint is compiled once while it stays among the `cache_size`
    last used; requests that ask for one being compiled share that compilation. `metrics`: where each compilation's
    seconds and each request served without one (a cache hit) are recorded."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = COMPILED_GRAMMAR_CACHE_SIZE,
                 metrics: BoundGrammarCompileMetrics | None = None) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (the model's vocabulary): the bitmask covers it
        self.cache_size = cache_size
        self.num_compiled = 0  # compilations so far (cache misses that compiled)
        self.metrics = metrics
        self.on_compile: Callable[[StructuredOutputsParams], None] | None = None
        """Called on the compiling thread as each compilation starts: where a test holds one."""
        self._lock = threading.Lock()  # the cache, the compilations under way, num_compiled, the pool
        self._cache: OrderedDict[StructuredOutputsParams, Any] = OrderedDict()
        self._compiling: dict[StructuredOutputsParams, Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._vocabulary_lock = threading.Lock()  # one vocabulary, built by the first compilation
        self._compiler: Any = None

    def compile(self, constraint: StructuredOutputsParams) -> Any:
        """The xgrammar CompiledGrammar of `constraint`, waiting for it; ValueError naming what does not compile."""
        return self.compile_async(constraint).result()

    def compile_async(self, constraint: StructuredOutputsParams) -> Future:
        """A future of `compile(constraint)`, done at once when the grammar is cached. Each caller gets its own
        future: cancelling it (a request that went away) cancels nobody else's wait, nor the compilation."""
        result: Future = Future()
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
                result.set_result(compiled)
                self._count_cache_hit()
                return result
            compiling = self._compiling.get(constraint)
            if compiling is not None:
                self._count_cache_hit()
            else:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="k3serve-grammar")
                compiling = self._compiling[constraint] = self._pool.submit(self._compile_and_cache, constraint)
        compiling.add_done_callback(lambda done: _pass_on(done, result))
        return result

    def close(self) -> None:
        """Let the compile threads end once the compilations queued finish (the engine stops)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)

    def _compile_and_cache(self, constraint: StructuredOutputsParams) -> Any:
        """A compile thread: compile, then cache the grammar (nothing for a failure: a ValueError each time)."""
        try:
            if self.on_compile is not None:
                self.on_compile(constraint)
            started = time.perf_counter()
            compiled = self._compile(constraint)
            if self.metrics is not None:
                self.metrics.observe_compile(started)
        except BaseException:
            with self._lock:
                del self._compiling[constraint]
            raise
        with self._lock:
            del self._compiling[constraint]
            self.num_compiled += 1
            self._cache[constraint] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _count_cache_hit(self) -> None:
        if self.metrics is not None:
            self.metrics.cache_hit()

    def _compile(self, constraint: StructuredOutputsParams) -> Any:
        grammar = parse_constraint(constraint)
        try:
            return self._xgrammar_compiler().compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise ConstraintCompileError(
                f"structured output {constraint.kind} does not compile: {xgrammar_message(e)}") from None

    def _xgrammar_compiler(self) -> Any:
        with self._vocabulary_lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                self._compiler = xgr.GrammarCompiler(tokenizer_info(xgr, self.tokenizer, self.vocab_size),
                                                     cache_enabled=False)  # this class is the cache
            return self._compiler


def _pass_on(source: Future, target: Future) -> None:
    """`source`'s outcome into `target`, unless `target`'s caller cancelled it."""
    if source.cancelled():
        target.cancel()
    elif target.set_running_or_notify_cancel():
        error = source.exception()
        if error is None:
            target.set_result(source.result())
        else:
            target.set_exception(error)


def tokenizer_info(xgr: Any, tokenizer: Tokenizer, vocab_size: int) -> Any:
    """xgrammar's view of the vocabulary: each id's raw bytes (`VocabType.RAW`: byte-level BPE and tiktoken
    alike), `vocab_size` ids (the model's; ids past the tokenizer's are never allowed). Special tokens other than
    the stop tokens get empty bytes, which xgrammar takes as special: never allowed by a grammar (their text
    would otherwise match, and the detokenizer drops it). The stop tokens end a complete output."""
    stop_token_ids = sorted(t for t in tokenizer.stop_token_ids if t < vocab_size)
    if not stop_token_ids:
        raise ValueError("structured outputs need a tokenizer with an end-of-sequence token")
    hidden = tokenizer.special_token_ids - set(stop_token_ids)
    ids = range(min(tokenizer.vocab_size, vocab_size))
    vocab = [b"" if i in hidden else piece for i, piece in zip(ids, tokenizer.token_bytes(list(ids)))]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids)


@dataclass
class TokenMask:
    """The allowed tokens of a batch's constrained rows: bit t of `bitmask[j]` says whether logits row `rows[j]`
    may take token t."""

    bitmask: torch.Tensor  # [len(rows), ceil(V / 32)] int32 on the host (pinned for a CUDA engine)
    rows: list[int]  # [M] ascending rows of the batch's logits

    def apply(self, logits: torch.Tensor) -> None:
        """`logits` [N, V] fp32, contiguous, in place: every token a row's constraint does not allow -> -inf.
        One host-to-device copy of the bitmask (and of the row index when not every row is constrained)."""
        xgr = import_xgrammar()
        device = logits.device
        bitmask = self.bitmask.to(device, non_blocking=True)
        every_row = len(self.rows) == logits.shape[0]
        index = None if every_row else to_device_async(self.rows, device)
        rows = logits if every_row else logits.index_select(0, index)
        # xgrammar's CUDA kernel (Triton) launches on the current device, which need not be the engine's
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            xgr.apply_token_bitmask_inplace(rows, bitmask, vocab_size=logits.shape[1])
        if not every_row:
            logits.index_copy_(0, index, rows)


@dataclass
class Verdict:
    """What the constrained rows' sampled tokens did to their requests."""

    terminated: set[str]  # request ids whose constraint is complete (stop token accepted): finish "stop"
    failed: dict[str, str]  # request id -> why its token was rejected: the request fails


class StructuredOutputs:
    """The constrained requests of one engine: a compiled grammar and one xgrammar GrammarMatcher a request,
    from `add` to `release`."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, pin_memory: bool = False,
                 cache_size: int = COMPILED_GRAMMAR_CACHE_SIZE,
                 metrics: BoundGrammarCompileMetrics | None = None) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, cache_size, metrics)
        self.eos_token_id = tokenizer.eos_token_id
        self.pin_memory = pin_memory  # a CUDA engine: the bitmask is copied from pinned memory, non_blocking
        self._matchers: dict[str, Any] = {}  # request id -> its GrammarMatcher
        self._batch_matcher: Any = None  # xgrammar's multi-threaded bitmask filler

    @property
    def num_matchers(self) -> int:
        """Live matchers: one a constrained request between `add` and `release`."""
        return len(self._matchers)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def add(self, request_id: str, params: SamplingParams, grammar: Any = None) -> None:
        """Give a constrained request its matcher (nothing for an unconstrained one). `grammar`: its constraint's
        CompiledGrammar where the caller compiled it off this thread (`GrammarCompiler.compile_async`); compiled
        here otherwise, waiting for it (the offline `LLM`). ValueError for a constraint that does not compile."""
        if params.structured_outputs is None:
            return
        if request_id in self._matchers:
            raise ValueError(f"duplicate request_id {request_id!r}")
        compiled = grammar if grammar is not None else self.compiler.compile(params.structured_outputs)
        stop_token_ids = {self.eos_token_id, *params.stop_token_ids} - {None}
        stop_token_ids = sorted(t for t in stop_token_ids if t < self.compiler.vocab_size)
        if not stop_token_ids:
            raise ValueError("structured outputs need an end token: the tokenizer has no EOS and the request no "
                             "stop_token_ids")
        self._matchers[request_id] = import_xgrammar().GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)

    def close(self) -> None:
        """The engine stops: so do the compile threads."""
        self.compiler.close()

    def release(self, request_id: str) -> None:
        """The request finished, was aborted or failed: its matcher goes."""
        self._matchers.pop(request_id, None)

    def token_mask(self, request_ids: list[str]) -> TokenMask | None:
        """The bitmask of the constrained rows of a batch (`request_ids` [N], one a logits row); None without
        any."""
        if not self._matchers:
            return None
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return None
        xgr = import_xgrammar()
        bitmask = torch.empty(xgr.get_bitmask_shape(len(rows), self.compiler.vocab_size), dtype=xgr.bitmask_dtype,
                              pin_memory=self.pin_memory)  # a fresh buffer: the last step's copy may be in flight
        matchers = [self._matchers[request_ids[i]] for i in rows]
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher()
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
        return TokenMask(bitmask, rows)

    def verify_mask(self, request_id: str, draft_ids: list[int]) -> TokenMask | None:
        """A constrained verify row's mask, [1 + k] rows: row i the tokens allowed after the first i drafts (the
        matcher walks the drafts, then rolls back: it ends where it began). Rows past a draft the constraint
        refuses, or past its end, repeat the last row filled: that draft is rejected there (its probability is
        0), so they are never sampled from. None for an unconstrained request."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return None
        xgr = import_xgrammar()
        bitmask = torch.empty(xgr.get_bitmask_shape(len(draft_ids) + 1, self.compiler.vocab_size),
                              dtype=xgr.bitmask_dtype, pin_memory=self.pin_memory)
        matcher.fill_next_token_bitmask(bitmask, 0)
        walked = 0
        for draft in draft_ids:
            if matcher.is_terminated() or not matcher.accept_token(draft):
                break
            walked += 1
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, walked)
        bitmask[walked + 1 :] = bitmask[walked]
        if walked:
            matcher.rollback(walked)
        return TokenMask(bitmask, list(range(len(draft_ids) + 1)))

    def accept_run(self, request_id: str, token_ids: list[int]) -> tuple[int, bool]:
        """`accept` a verify row's emitted tokens in order, up to the one that completes the constraint: (how many
        were taken, whether the constraint is complete). ConstraintViolationError as `accept`."""
        for i, token_id in enumerate(token_ids):
            if self.accept(request_id, token_id):
                return i + 1, True
        return len(token_ids), False

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher by its new token; True when that completed the constraint (its stop
        token). ConstraintViolationError when the constraint does not allow the token."""
        matcher = self._matchers[request_id]
        if not matcher.accept_token(token_id):
            raise ConstraintViolationError(
                f"request {request_id!r}: token {token_id} is not allowed by its structured output constraint "
                f"(no allowed token was left to sample, or the token was sampled without the constraint)")
        return matcher.is_terminated()

    def accept_sampled(self, sampled: dict[str, int]) -> Verdict:
        """`accept` for every constrained request of a step's sampled tokens (request id -> token id)."""
        verdict = Verdict(set(), {})
        if not self._matchers:
            return verdict
        for request_id, token_id in sampled.items():
            if request_id not in self._matchers:
                continue
            try:
                if self.accept(request_id, token_id):
                    verdict.terminated.add(request_id)
            except ConstraintViolationError as e:
                verdict.failed[request_id] = str(e)
        return verdict
