"""One eager prefill step on the GPU allocates no more than the memory plan sets aside for it
(`engine/memory.py` `prefill_activation_bytes`), and not much less: the estimate is a bound, not a guess.

Model: `K3_TINY_GPU` (KDA 12 x 128 heads, MLA latent 512 + 64, MXFP4 latent MoE), bf16, so the step runs the
GPU kernels the estimate describes (fla's chunk_kda, SDPA, the Triton MoE). Its max_position_embeddings (4096)
caps one prompt at 4095 tokens, so the step is two whole prompts of 4095: 8190 tokens, the engine's whole token
budget (`max_step_tokens`), each prompt a sequence of max_model_len, the estimate's longest. The first such
step compiles and autotunes and makes cuBLAS's workspace (costs the estimate's constants cover); a second one,
on fresh prompts (no prefix caching), is measured: the peak of `torch.cuda.max_memory_allocated()` during
`engine.step()` above what was allocated before it (the weights and pools).

The same step with prompt logprobs asked for on both prompts stays within it too; and at K3's vocab, where a
prompt's whole [4095, vocab] fp32 logits would be 2.7 GB, one prompt-logprobs slice (`ModelRunner.score_prompt`)
takes what `prompt_logprobs_slice_bytes` counts (at least MIN_FRACTION of it) whatever the number of rows.

Lower bound: at least MIN_FRACTION of what a warm step can allocate of the estimate, i.e. without its constants
that only a first step makes (Triton's autotune flush, the workspaces kept from the first GEMM on):
an estimate off by 2x (a part counted twice, every token counted per sequence) fails. (Until the KDA conv's
prefill became one Triton launch, its fp32 reference loop was this step's peak: 698 of 888 MiB on the H200.)
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.memory import (max_step_tokens, prefill_activation_bytes, prefill_fixed_bytes,
                                   prompt_logprobs_slice_bytes)
from k3serve.engine.runner import ModelRunner
from k3serve.engine.sampler import PromptScoring
from k3serve.engine.sampling_params import SamplingParams
from k3serve.kernels import kda, mla, moe
from k3serve.kernels._backend import AUTOTUNE_FLUSH_BYTES
from k3serve.model.batch import ModelCache
from k3serve.model.config import ModelConfig
from k3serve.model.model import KimiForCausalLM
from k3serve.model.presets import K3_TINY_GPU, preset_config

pytestmark = pytest.mark.gpu

PROMPT_LEN = 4095
NUM_PROMPTS = 2
STEP_TOKENS = NUM_PROMPTS * PROMPT_LEN
MIN_FRACTION = 0.5
ENGINE_ARGS = dict(
    device="cuda", dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False, seed=0,
    max_model_len=PROMPT_LEN + 1, max_num_seqs=NUM_PROMPTS, max_num_batched_tokens=STEP_TOKENS,
    max_adaptive_batched_tokens=STEP_TOKENS, cache_memory_bytes=256 * 2**20,
)


def _prefill_step_growth(engine: LLMEngine, gen: torch.Generator, prompt_logprobs: int | None = None) -> int:
    """Bytes allocated at the peak of one step that prefills NUM_PROMPTS fresh prompts whole and samples their
    one token, above what was allocated before it."""
    vocab = engine.config.vocab_size
    for _ in range(NUM_PROMPTS):
        prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                                  prompt_logprobs=prompt_logprobs))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    deltas = engine.step()
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - before
    assert len(deltas) == NUM_PROMPTS and all(d.finished for d in deltas), "the prompts did not run as one step"
    return growth


@pytest.mark.parametrize("prompt_logprobs", [None, 5], ids=["plain", "prompt_logprobs"])
def test_a_prefill_step_stays_within_the_planned_reserve(k3_tiny_gpu_checkpoint: Path,
                                                         prompt_logprobs: int | None) -> None:
    engine = LLMEngine(EngineArgs(model=str(k3_tiny_gpu_checkpoint), **ENGINE_ARGS))
    assert max_step_tokens(engine.args, None) == STEP_TOKENS
    bound = prefill_activation_bytes(engine.config, engine.args)
    gen = torch.Generator().manual_seed(0)
    _prefill_step_growth(engine, gen, prompt_logprobs)  # compiles, autotunes, makes cuBLAS's workspace
    growth = _prefill_step_growth(engine, gen, prompt_logprobs)
    assert (kda.last_backend["chunk_kda"], mla.last_backend["mla_prefill_attention"],
            moe.last_backend["fused_experts"]) == ("fla", "sdpa", "triton"), "not the kernels the estimate describes"
    warm_bound = bound - AUTOTUNE_FLUSH_BYTES - prefill_fixed_bytes(engine.config, 1)  # what a warm step can allocate of it
    print(f"\nprefill step of {STEP_TOKENS} tokens: peak growth {growth / 2**20:.1f} MiB, estimate "
          f"{bound / 2**20:.1f} MiB ({growth / bound:.2f}; {growth / warm_bound:.2f} of its warm part)")
    assert growth <= bound, f"the step took {growth / 2**20:.1f} MiB, the plan set aside {bound / 2**20:.1f} MiB"
    assert growth >= MIN_FRACTION * warm_bound, (
        f"the step took {growth / 2**20:.1f} MiB, under {MIN_FRACTION:.0%} of the {warm_bound / 2**20:.1f} MiB a warm "
        f"step can take of the estimate")


def test_a_prompt_logprobs_slice_at_k3s_vocab_takes_what_the_plan_counts() -> None:
    """The lm_head of a K3-vocab model (163840 rows, bf16, one rank) scoring a prompt's 4095 rows: the peak above
    the hidden states is one slice's, within `prompt_logprobs_slice_bytes` and at least MIN_FRACTION of it."""
    config = dataclasses.replace(ModelConfig.from_hf_dict(copy.deepcopy(K3_TINY_GPU)),
                                 vocab_size=preset_config("kimi-k3").vocab_size)
    with torch.device("cuda"):
        model = KimiForCausalLM(config, dtype=torch.bfloat16)
    model.lm_head.weight.data.normal_(std=0.02)
    runner = ModelRunner(model, ModelCache.allocate(config, 1, 1, 64, 1, torch.bfloat16, "cuda"))
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(PROMPT_LEN, config.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    scoring = PromptScoring(torch.randint(0, config.vocab_size, (PROMPT_LEN,), generator=gen).tolist(), num_top=5)
    warm = 300  # a whole slice and a ragged one, both on cuBLAS: its workspace is made once, before the count
    runner.score_prompt(hidden[:warm], PromptScoring(scoring.target_token_ids[:warm], 5))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    entries = runner.score_prompt(hidden, scoring)
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - before
    bound = prompt_logprobs_slice_bytes(config, 1, 2)
    assert len(entries) == PROMPT_LEN
    whole = PROMPT_LEN * config.vocab_size * 4
    print(f"\nprompt logprobs of {PROMPT_LEN} rows at vocab {config.vocab_size}: peak growth {growth / 2**20:.1f} MiB, "
          f"slice estimate {bound / 2**20:.1f} MiB (the rows' whole fp32 logits: {whole / 2**20:.0f} MiB)")
    assert MIN_FRACTION * bound <= growth <= bound, (growth, bound)
