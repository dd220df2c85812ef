"""The model-based drafters on CUDA (`K3_TINY_GPU`, whose shapes meet the GPU kernels' rules), for a GPU session.

* fp32 (the torch reference ops on the GPU): greedy output with each drafter is token for token the output
  without speculation, as on the CPU (tests/engine/test_spec_drafters.py).
* bf16 (the GPU kernels): each drafter runs (forwards counted) and proposes drafts; with EAGLE and draft_model the
  decode-only steps still replay their CUDA graphs (EAGLE's hidden states are the graph's output). Tokens are not compared: the
  verify rows run the reference verify kernels, the decode rows Triton's, which round differently in bf16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.checkpoint import make_checkpoint
from k3serve.model.draft.checkpoint import make_drafter_checkpoint
from k3serve.model.presets import K3_TINY_GPU

pytestmark = pytest.mark.gpu

PROMPT_LENS = [3, 64, 200]
ENGINE_ARGS = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256, cache_memory_bytes=256 * 2**20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    vocab = K3_TINY_GPU["text_config"]["vocab_size"]
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def drafter_for(method: str, target: Path, out: Path) -> Path:
    """A random drafter of `method` for `target` (draft_model: K3_TINY_GPU's first 2 layers, another seed)."""
    if method == "draft_model":
        return make_checkpoint(K3_TINY_GPU, out, seed=1, num_layers=2)
    return make_drafter_checkpoint(method, target, out)


def run_drafter(checkpoint: Path, drafter: Path, method: str, prompts: list[list[int]], device: str, dtype: str
                ) -> tuple[list[list[int]], list[list[int]], LLM]:
    """(tokens without speculation, with the drafter at K = 4, the speculating LLM)."""
    plain = LLM(model=str(checkpoint), device=device, dtype=dtype, **ENGINE_ARGS)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    spec = LLM(model=str(checkpoint), device=device, dtype=dtype, **ENGINE_ARGS,
               speculative_config={"method": method, "model": str(drafter), "num_speculative_tokens": 4})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)]
    return want, got, spec


@pytest.mark.parametrize("method", ["eagle", "dspark", "draft_model"])
def test_fp32_on_cuda_keeps_the_greedy_output(k3_tiny_gpu_checkpoint: Path, tmp_path: Path, prompts, method: str
                                              ) -> None:
    drafter = drafter_for(method, k3_tiny_gpu_checkpoint, tmp_path / method)
    want, got, spec = run_drafter(k3_tiny_gpu_checkpoint, drafter, method, prompts, "cuda", "float32")
    assert got == want
    assert spec.engine.spec_stats.num_drafts > 0 and spec.engine.runner.drafter.num_forwards > 0


@pytest.mark.parametrize("method", ["eagle", "dspark", "draft_model"])
def test_bf16_on_cuda_drafts_with_the_gpu_kernels(k3_tiny_gpu_checkpoint: Path, tmp_path: Path, prompts,
                                                  method: str) -> None:
    drafter = drafter_for(method, k3_tiny_gpu_checkpoint, tmp_path / method)
    _, got, spec = run_drafter(k3_tiny_gpu_checkpoint, drafter, method, prompts, "cuda", "bfloat16")
    assert all(len(tokens) == GREEDY.max_tokens for tokens in got)
    runner = spec.engine.runner
    assert spec.engine.spec_stats.num_drafts > 0 and runner.drafter.num_forwards > 0
    if method != "dspark" and runner.graphs is not None:
        assert sum(runner.graphs.replays.values()) > 0, "no decode-only step replayed its graph"
