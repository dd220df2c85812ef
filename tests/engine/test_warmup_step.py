"""The warm-up step is a step the real runner and sampler run: on a CPU engine (which runs no warm-up check: its
plan reserves nothing), the step `warmup_output` builds for that engine's plan goes through `ModelRunner.execute`
and `Sampler.sample`, every sequence sampled. (On CUDA, measured against the plan: test_warmup_gpu.py.)"""

from __future__ import annotations

from pathlib import Path

import torch

from k3serve.engine.llm import LLM
from k3serve.engine.sampler import Sampler
from k3serve.engine.warmup import WARMUP_SAMPLING, warmup_output


def test_the_warm_up_step_runs_through_the_runner_and_the_sampler(tiny_checkpoint: Path) -> None:
    engine = LLM(model=str(tiny_checkpoint), max_model_len=96, max_num_seqs=3, max_num_batched_tokens=120,
                 max_adaptive_batched_tokens=200, cache_memory_bytes=4 * 2**20).engine
    assert engine.warmup is None  # CPU: nothing reserved, nothing checked
    output = warmup_output(engine.args, engine.plan, engine.config.vocab_size, None)
    assert [len(s.token_ids) for s in output.seqs] == [95, 53, 52]
    result = engine.runner.execute(output)
    ids = list(result.sample_logits)
    assert ids == [s.request_id for s in output.seqs]
    logits = torch.stack([result.sample_logits[i] for i in ids]).float()
    sampled = Sampler().sample(logits, [WARMUP_SAMPLING] * len(ids), [[] for _ in ids], [[] for _ in ids],
                               [None] * len(ids)).sampled_token_ids
    assert len(sampled) == 3 and all(0 <= t < engine.config.vocab_size for t in sampled)
