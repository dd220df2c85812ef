"""Running the real engine on the tiny model (fp32, CPU), with a naive oracle and a leak check.

    make_llm(**engine_args)          an `LLM` over the session's tiny checkpoint; when the test
    make_async_engine(**engine_args) ends, each one built must hold nothing (see below)
    greedy_oracle.run(prompt, n)     the naive loop: n times, score the WHOLE sequence so far
                                     (model/score.py, one fresh pass) and append the argmax of
                                     the last row; cached per prompt for the session

Leak check (`assert_engine_empty`): no unfinished request, no engine-side request state (structured
output matchers included), no block or KDA slot in use; cached prefix blocks and checkpoints are
allowed (they are reusable, not used), then the prefix cache is cleared and both pools must be
completely empty.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from k3serve.engine.async_engine import AsyncEngine
from k3serve.engine.config import EngineArgs
from k3serve.engine.llm import LLM
from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.memory import cache_sizes
from k3serve.engine.outputs import RequestOutput
from k3serve.model.config import ModelConfig
from k3serve.model.loader import load_model
from k3serve.model.model import KimiForCausalLM
from k3serve.model.score import score_tokens

VOCAB_SIZE = 512  # k3-tiny
BLOCK_SIZE = 64  # the engine's default; prefix hits and KDA checkpoints are multiples of it
CACHE_MEMORY_BYTES = 32 * 2**20  # plenty for every test that does not force preemption
NEAR_TIE_LOGIT_GAP = 1e-4  # a greedy token may differ from the oracle's only on a near-tie


def engine_args(checkpoint: Path, **overrides: object) -> dict[str, object]:
    args: dict[str, object] = dict(
        model=str(checkpoint), dtype="float32", max_model_len=2100, cache_memory_bytes=CACHE_MEMORY_BYTES
    )
    args.update(overrides)
    return args


def random_prompt(gen: torch.Generator, num_tokens: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (num_tokens,), generator=gen).tolist()


# ---- leak check ----------------------------------------------------------------------------
def assert_engine_empty(engine: LLMEngine) -> None:
    scheduler = engine.scheduler
    assert not scheduler.has_unfinished(), f"unfinished requests: {sorted(scheduler.requests)}"
    assert not engine._tracked, f"engine still tracks {sorted(engine._tracked)}"
    assert engine.structured_outputs.num_matchers == 0, "a structured output matcher outlived its request"
    assert scheduler.block_pool.num_used == 0, f"{scheduler.block_pool.num_used} MLA blocks still in use"
    assert scheduler.state_pool.num_used == 0, f"{scheduler.state_pool.num_used} KDA slots still in use"
    if scheduler.prefix_cache is not None:
        scheduler.prefix_cache.clear()
    scheduler.block_pool.check_empty()
    scheduler.state_pool.check_empty()


@pytest.fixture
def make_llm(tiny_checkpoint: Path) -> Iterator[Callable[..., LLM]]:
    built: list[LLM] = []

    def make(**overrides: object) -> LLM:
        llm = LLM(**engine_args(tiny_checkpoint, **overrides))
        built.append(llm)
        return llm

    yield make
    for llm in built:
        assert_engine_empty(llm.engine)


@pytest.fixture
def make_async_engine(tiny_checkpoint: Path) -> Iterator[Callable[..., AsyncEngine]]:
    built: list[AsyncEngine] = []

    def make(**overrides: object) -> AsyncEngine:
        engine = AsyncEngine(EngineArgs.from_kwargs(**engine_args(tiny_checkpoint, **overrides)))
        built.append(engine)
        return engine

    yield make
    for engine in built:
        engine.shutdown()  # commands run in order: every abort queued before this is applied
        assert not engine._thread.is_alive(), "the engine thread did not stop"
        assert engine._error is None, f"the engine thread failed: {engine._error!r}"
        assert not engine._streams, f"streams left open: {sorted(engine._streams)}"
        assert_engine_empty(engine.engine)


# ---- the naive oracle ----------------------------------------------------------------------
@dataclass
class OracleRun:
    token_ids: list[int]  # [n] greedy continuation
    logits: list[torch.Tensor]  # [n] x [vocab] last-row logits each token was the argmax of


class GreedyOracle:
    """Greedy decoding with no cache at all: every token costs one full pass from token 0."""

    def __init__(self, model: KimiForCausalLM) -> None:
        self.model = model
        self._runs: dict[tuple[int, ...], OracleRun] = {}

    def run(self, prompt: Sequence[int], num_tokens: int) -> OracleRun:
        key = tuple(prompt)
        run = self._runs.setdefault(key, OracleRun([], []))
        while len(run.token_ids) < num_tokens:
            last = score_tokens(self.model, list(prompt) + run.token_ids)[-1]
            run.token_ids.append(int(last.argmax()))
            run.logits.append(last)
        return OracleRun(run.token_ids[:num_tokens], run.logits[:num_tokens])


@pytest.fixture(scope="session")
def greedy_oracle(tiny_checkpoint: Path) -> GreedyOracle:
    return GreedyOracle(load_model(tiny_checkpoint, dtype=torch.float32))


def assert_greedy_matches(
    oracle: GreedyOracle, prompts: Sequence[Sequence[int]], outputs: Sequence[RequestOutput]
) -> int:
    """Each output's tokens equal the naive loop's. Where a token differs, the oracle must have
    been at a near-tie (the engine's token within NEAR_TIE_LOGIT_GAP of its best logit); the
    sequences diverge from there, so comparison stops. Returns the number of such flips."""
    assert len(outputs) == len(prompts)
    num_flips = 0
    for prompt, out in zip(prompts, outputs):
        got = out.outputs[0].token_ids
        expected = oracle.run(prompt, len(got))
        for i, (token, want, logits) in enumerate(zip(got, expected.token_ids, expected.logits)):
            if token == want:
                continue
            gap = float(logits.max() - logits[token])
            assert gap <= NEAR_TIE_LOGIT_GAP, (
                f"prompt of {len(prompt)} tokens ({out.request_id}): output token {i} is {token}, the naive "
                f"loop takes {want} (logit gap {gap:.3g}); engine {got}, naive {expected.token_ids}"
            )
            warnings.warn(f"near-tie flip: prompt of {len(prompt)} tokens, output token {i} (gap {gap:.2e})")
            num_flips += 1
            break
    return num_flips


def cache_bytes_for(checkpoint: Path, num_blocks: int, num_slots: int) -> int:
    """`cache_memory_bytes` that plans exactly `num_blocks` MLA blocks next to `num_slots` KDA slots."""
    sizes = cache_sizes(ModelConfig.from_dir(checkpoint), 1, torch.float32)
    return num_slots * sizes.kda_bytes_per_slot + num_blocks * BLOCK_SIZE * sizes.mla_bytes_per_token
