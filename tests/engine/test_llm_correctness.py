"""Specification: however the engine schedules a request, its greedy tokens are the naive loop's.

The naive loop runs the whole sequence so far through one fresh forward pass per token (no
cache, no batching, no chunks) and takes the argmax of the last row. `LLM.generate` on 32
concurrent prompts of 1 to 2000 random tokens must produce exactly those tokens, whether
prompts are prefilled whole or in small chunks next to running decodes, whether requests are
preempted and recomputed, and whether their prefix comes from the prefix cache (KDA
checkpoint taken in-pass or at an aligned chunk end) or prefix caching is off. Seeded sampling
gives the same tokens alone, in any batch and under chunked prefill.

Every test ends with nothing left in the block and state pools (`_llm_harness.make_llm`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from k3serve.engine.sampling_params import SamplingParams

from _llm_harness import (
    BLOCK_SIZE,
    assert_greedy_matches,
    cache_bytes_for,
    greedy_oracle,  # noqa: F401  (fixture)
    make_llm,  # noqa: F401  (fixture)
    random_prompt,
)

SHARED_PREFIX_LEN = 500  # each of 3 groups shares one; its last block boundary is 448
STANDALONE_LENS = [1, 2, 3, 9, 16, 31, 63, 64, 65, 100, 127, 128, 129, 200, 256, 300, 450, 700, 1000, 2000]
LONG_PROMPT_LEN = 1000  # prompts this long generate fewer tokens: the naive loop is O(len^2) per token
PREEMPTION_NUM_BLOCKS = 40  # 2560 tokens of MLA cache for ~12k prompt tokens: requests must be preempted
PREEMPTION_BUDGET = 512  # admitted prompts grow chunk by chunk into the cache while others decode


@dataclass(frozen=True)
class MixedPrompt:
    token_ids: list[int]
    wave: int  # 0 or 1: submission order in the two-wave variants
    cached_in_second_wave: int = 0  # prefix-cache hit expected when submitted in wave 1

    @property
    def max_tokens(self) -> int:
        return 4 if len(self.token_ids) >= LONG_PROMPT_LEN else 8


@functools.cache
def mixed_prompts() -> tuple[MixedPrompt, ...]:
    """32 prompts in a seeded random order: 20 unrelated ones of 1..2000 tokens (around block
    boundaries too), and 3 groups of 4 sharing a 500-token prefix. In the two-wave variants each
    group's first wave leaves KDA checkpoints at 448 (prompt of 505) and 576 (prompt of 600);
    its second wave then hits 448 (prompt of 501) and 576 (the 600-token prompt again)."""
    gen = torch.Generator().manual_seed(2024)
    prompts = [MixedPrompt(random_prompt(gen, n), wave=i % 2) for i, n in enumerate(STANDALONE_LENS)]
    for _ in range(3):
        prefix = random_prompt(gen, SHARED_PREFIX_LEN)
        tail_600 = random_prompt(gen, 100)
        prompts += [
            MixedPrompt(prefix + random_prompt(gen, 5), wave=0),
            MixedPrompt(prefix + tail_600, wave=0),
            MixedPrompt(prefix + random_prompt(gen, 1), wave=1, cached_in_second_wave=448),
            MixedPrompt(prefix + tail_600, wave=1, cached_in_second_wave=576),
        ]
    order = torch.randperm(len(prompts), generator=gen).tolist()
    return tuple(prompts[i] for i in order)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@dataclass(frozen=True)
class Variant:
    name: str
    engine_args: dict[str, object] = field(default_factory=dict)
    two_waves: bool = False  # the second wave is submitted after the first has finished
    forces_preemption: bool = False

    @property
    def expects_prefix_hits(self) -> bool:
        return self.two_waves and self.engine_args.get("enable_prefix_caching", True)


CHUNKED = dict(
    max_num_seqs=32, max_num_batched_tokens=64, max_adaptive_batched_tokens=64, long_prefill_token_threshold=48
)
VARIANTS = [
    Variant("default"),
    Variant("chunked_prefill", CHUNKED),
    Variant(
        "preemption",
        dict(max_num_seqs=32, max_num_batched_tokens=PREEMPTION_BUDGET, max_adaptive_batched_tokens=PREEMPTION_BUDGET),
        forces_preemption=True,
    ),
    Variant("prefix_hits_in_pass", dict(kda_checkpoint_mode="in_pass"), two_waves=True),
    Variant("prefix_hits_align", dict(kda_checkpoint_mode="align"), two_waves=True),
    Variant("prefix_caching_off", dict(enable_prefix_caching=False), two_waves=True),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_greedy_tokens_equal_the_naive_loop(variant: Variant, make_llm, greedy_oracle, tiny_checkpoint: Path):
    args = dict(variant.engine_args)
    if variant.forces_preemption:
        args["cache_memory_bytes"] = cache_bytes_for(tiny_checkpoint, PREEMPTION_NUM_BLOCKS, 2 * args["max_num_seqs"])
    llm = make_llm(**args)
    scheduler_config = llm.engine.scheduler.config
    for name, value in args.items():  # the engine passed the variant's knobs through
        assert getattr(scheduler_config, name, value) == value, name
    if variant.forces_preemption:
        assert llm.engine.plan.num_blocks == PREEMPTION_NUM_BLOCKS
    prompts = mixed_prompts()
    waves = [[p for p in prompts if p.wave == w] for w in (0, 1)] if variant.two_waves else [list(prompts)]

    for wave in waves:
        outputs = llm.generate([p.token_ids for p in wave], [greedy(p.max_tokens) for p in wave])
        for p, out in zip(wave, outputs):
            assert out.finished and out.outputs[0].finish_reason == "length"
            assert len(out.outputs[0].token_ids) == p.max_tokens
        assert_greedy_matches(greedy_oracle, [p.token_ids for p in wave], outputs)

        if variant.two_waves and wave is waves[1]:
            expected_cached = [p.cached_in_second_wave if variant.expects_prefix_hits else 0 for p in wave]
            assert [out.num_cached_tokens for out in outputs] == expected_cached

    if variant.forces_preemption:
        assert llm.engine.num_preemptions > 0, "the small cache never ran out: nothing was preempted"


def test_mixed_prompts_cover_one_to_two_thousand_tokens_and_shared_prefixes():
    lens = sorted(len(p.token_ids) for p in mixed_prompts())
    assert len(lens) == 32 and lens[0] == 1 and lens[-1] == 2000
    hits = sorted(p.cached_in_second_wave for p in mixed_prompts() if p.cached_in_second_wave)
    assert hits == [448] * 3 + [576] * 3
    assert all(h % BLOCK_SIZE == 0 for h in hits)


# ---- seeded sampling -----------------------------------------------------------------------
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=16, ignore_eos=True)


def _batch_of_eight(gen: torch.Generator, prompt: list[int]) -> tuple[list[list[int]], list[SamplingParams]]:
    """Seven different requests around `prompt` (index 3): unseeded, other seeds, the same seed on
    another prompt, greedy, with top-k and penalties."""
    others = [random_prompt(gen, n) for n in (1, 40, 129, 250, 700, 1000, 64)]
    other_params = [
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=5, seed=7, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.9, presence_penalty=0.5, seed=99, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, max_tokens=30, ignore_eos=True),
    ]
    return others[:3] + [prompt] + others[3:], other_params[:3] + [SEEDED] + other_params[3:]


def _run_preempted(llm, others: list[list[int]], prompt: list[int]) -> tuple[list[int], int]:
    """Step the engine on `others` plus `prompt` arriving last (so it is the first preemption
    victim). Returns its tokens and how many it had sampled when it was first seen preempted."""
    engine = llm.engine
    for other in others:
        engine.add_request(other, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
    request_id = engine.add_request(prompt, SEEDED)
    token_ids, num_sampled_at_preemption = [], -1
    while engine.has_unfinished():
        token_ids += [t for d in engine.step() if d.request_id == request_id for t in d.new_token_ids]
        request = engine.scheduler.requests.get(request_id)
        if request is not None and request.num_preemptions and num_sampled_at_preemption < 0:
            num_sampled_at_preemption = request.num_output_tokens
    return token_ids, num_sampled_at_preemption


def test_seeded_sampling_is_reproducible_alone_in_a_batch_chunked_and_preempted(make_llm, tiny_checkpoint: Path):
    gen = torch.Generator().manual_seed(7)
    prompt = random_prompt(gen, 300)
    batch, batch_params = _batch_of_eight(gen, prompt)

    alone = make_llm().generate(prompt, SEEDED)[0].outputs[0].token_ids
    in_batch = make_llm().generate(batch, batch_params)[3].outputs[0].token_ids
    chunked = make_llm(**{**CHUNKED, "max_num_seqs": 8}).generate(batch, batch_params)[3].outputs[0].token_ids
    small_cache = cache_bytes_for(tiny_checkpoint, num_blocks=22, num_slots=16)
    preempted, num_sampled = _run_preempted(
        make_llm(max_num_seqs=8, max_model_len=1100, cache_memory_bytes=small_cache),
        [random_prompt(gen, n) for n in (1, 40, 126, 250, 700, 1020, 62)],
        prompt,
    )
    assert num_sampled > 0, "the seeded request was not preempted after sampling"

    assert len(alone) == 16
    assert in_batch == alone
    assert chunked == alone
    assert preempted == alone
    other_seed = SamplingParams(temperature=0.8, top_p=0.9, seed=124, max_tokens=16, ignore_eos=True)
    assert make_llm().generate(prompt, other_seed)[0].outputs[0].token_ids != alone
