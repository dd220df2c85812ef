"""Engine test harness: a real Scheduler over real pools, no model, and a leak check after every test.

`make_scheduler(num_blocks, num_slots, eos_token_id, max_running_to_scale, **EngineArgs)` builds the
scheduler the engine would for those EngineArgs (`engine/memory.py` `scheduler_config`, no GPU; at most 16
requests, 16384 tokens each, unless given); when the test ends, every scheduler it built must
have no unfinished request and no block or slot still referenced or pinned (cached prefix
blocks and checkpoints are fine: they are reusable, not used).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from types import SimpleNamespace

import pytest

from k3serve.engine.block_pool import BlockPool
from k3serve.engine.budget import DEFAULT_MAX_RUNNING_TO_SCALE
from k3serve.engine.config import EngineArgs
from k3serve.engine.memory import scheduler_config
from k3serve.engine.prefix_cache import PrefixCache
from k3serve.engine.request import Request
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.scheduler import Scheduler
from k3serve.engine.scheduler_output import SchedulerOutput
from k3serve.engine.state_pool import StatePool


def assert_pools_empty(scheduler: Scheduler) -> None:
    assert not scheduler.has_unfinished(), f"unfinished: {sorted(scheduler.requests)}"
    scheduler.block_pool.check_empty()
    scheduler.state_pool.check_empty()
    assert scheduler.block_pool.usage == 0.0
    assert scheduler.state_pool.usage == 0.0


@pytest.fixture
def make_scheduler() -> Iterator[Callable[..., Scheduler]]:
    built: list[Scheduler] = []

    def make(num_blocks: int = 1024, num_slots: int = 64, eos_token_id: int | None = None,
             max_running_to_scale: int = DEFAULT_MAX_RUNNING_TO_SCALE, **engine_args: object) -> Scheduler:
        engine_args.setdefault("max_num_seqs", 16)
        engine_args.setdefault("max_model_len", 16384)
        cfg = replace(scheduler_config(EngineArgs(**engine_args), None, eos_token_id),
                      max_running_to_scale=max_running_to_scale)
        block_pool = BlockPool(num_blocks, cfg.block_size)
        state_pool = StatePool(num_slots)
        scheduler = Scheduler(cfg, block_pool, state_pool, PrefixCache(block_pool, state_pool))
        built.append(scheduler)
        return scheduler

    yield make
    for scheduler in built:
        assert_pools_empty(scheduler)


def request(request_id: str, prompt: list[int] | int, max_tokens: int | None = 4, **params: object) -> Request:
    """A request; an int prompt means that many distinct tokens (seeded by the id, so two ids differ)."""
    if isinstance(prompt, int):
        base = zlib.crc32(request_id.encode()) % 1000 * 100_000
        prompt = list(range(base, base + prompt))
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params))


def step(scheduler: Scheduler, token_id: int | dict[str, int] = 1) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with hand-written sampled tokens (the same token for everyone, or per id)."""
    output = scheduler.schedule()
    if isinstance(token_id, int):
        sampled = {seq.request_id: token_id for seq in output.seqs if seq.needs_sample}
    else:
        sampled = {seq.request_id: token_id[seq.request_id] for seq in output.seqs if seq.needs_sample}
    return output, scheduler.update_from_output(output, sampled)


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return outputs
        output, _ = step(scheduler)
        outputs.append(output)
    raise AssertionError(f"not finished after {max_steps} steps: {sorted(scheduler.requests)}")


def chunk_lens(output: SchedulerOutput) -> dict[str, int]:
    return {seq.request_id: seq.num_scheduled_tokens for seq in output.seqs}


@pytest.fixture
def h() -> SimpleNamespace:
    """The helpers above, for test modules (a conftest is not importable by name)."""
    return SimpleNamespace(
        request=request, step=step, run_to_completion=run_to_completion, chunk_lens=chunk_lens
    )
