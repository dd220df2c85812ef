"""Prompt logprobs are made a slice of prompt rows at a time (`ModelRunner.prompt_logprobs_rows`; in production
`PROMPT_LOGPROBS_ROWS`), so no [chunk, vocab] tensor ever exists: the lm_head never gets more rows than a slice,
and the values are those of the whole prompt's logits at once (log_softmax of one full-sequence pass,
`model/score.py`): each prompt token's logprob and rank, and the top-k ids and logprobs.

Slices of 5 rows here: a one-pass prompt of 23 tokens scores 22 rows (4 slices and a ragged 2); chunked, a prompt
of 110 tokens scores chunks of several slices each with ragged ends. (TP2, where every slice is gathered over a
padded vocab: test_tp_engine.py.)"""

from __future__ import annotations

import pytest
import torch

from k3serve.engine.outputs import Logprob
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.model import KimiForCausalLM
from k3serve.model.score import score_tokens

from _llm_harness import make_llm, random_prompt  # noqa: F401  (fixture)

SLICE_ROWS = 5
LOGPROB_ATOL = 1e-5  # fp32: GEMMs of a slice's rows and of the whole prompt's round differently
CHUNKED_LOGPROB_ATOL = 1e-4  # fp32: chunked prefill vs one full-sequence pass (as test_llm_sampling.py)
CHUNKED = dict(max_num_batched_tokens=64, max_adaptive_batched_tokens=64, long_prefill_token_threshold=48)


def record_lm_head_rows(model: KimiForCausalLM) -> list[int]:
    """Instrumentation, not a stand-in: the real lm_head still computes, and each call's row count is written down
    (every [rows, vocab] tensor of a step, the sampled rows' and the prompt slices', starts there)."""
    rows: list[int] = []
    compute_logits = model.lm_head.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return compute_logits(hidden)

    model.lm_head.compute_logits = recording
    return rows


def assert_scored_like_the_whole_prompt(got: list[dict[int, Logprob] | None], prompt: list[int], num_top: int,
                                        model: KimiForCausalLM, atol: float) -> None:
    """Against log_softmax of the whole prompt's logits, up to `atol`: ranks and top-k order are those of the
    reference up to tokens within `atol` of one another (ties in fp32 rounding)."""
    ref = torch.log_softmax(score_tokens(model, prompt), dim=-1)  # [T, V]: row t scores prompt[t + 1]
    assert len(got) == len(prompt) and got[0] is None
    for t in range(1, len(prompt)):
        entry, row, target = got[t], ref[t - 1], prompt[t]
        chosen = entry[target]
        assert next(iter(entry)) == target
        assert chosen.logprob == pytest.approx(row[target].item(), abs=atol)
        assert int((row > row[target] + atol).sum()) < chosen.rank <= int((row > row[target] - atol).sum()) + 1
        top_lp = row.topk(num_top).values.tolist()
        top = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if tid != target or chosen.rank <= num_top)
        assert [rank for rank, _, _ in top] == list(range(1, num_top + 1))
        for (_, tid, lp), want in zip(top, top_lp):  # the k-th token holds the k-th largest logprob
            assert lp == pytest.approx(want, abs=atol) and row[tid].item() == pytest.approx(want, abs=atol)


@pytest.mark.parametrize(("engine_args", "prompt_len", "atol"),
                         [({}, 23, LOGPROB_ATOL), (CHUNKED, 110, CHUNKED_LOGPROB_ATOL)], ids=["one_pass", "chunked_prefill"])
def test_prompt_logprobs_scored_in_slices_equal_the_whole_prompts(make_llm, engine_args: dict, prompt_len: int,
                                                                  atol: float) -> None:
    llm = make_llm(enable_prefix_caching=False, **engine_args)
    runner = llm.engine.runner
    runner.prompt_logprobs_rows = SLICE_ROWS
    lm_head_rows = record_lm_head_rows(runner.model)
    gen = torch.Generator().manual_seed(prompt_len)
    scored, plain = random_prompt(gen, prompt_len), random_prompt(gen, 17)

    outs = llm.generate([scored, plain], [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=4),
                                          SamplingParams(temperature=0.0, max_tokens=1)])

    assert max(lm_head_rows) == SLICE_ROWS  # never a whole chunk's rows
    assert sum(lm_head_rows) == (prompt_len - 1) + 2  # every prompt row scored once, beside the 2 sampled rows
    assert outs[1].prompt_logprobs is None
    assert_scored_like_the_whole_prompt(outs[0].prompt_logprobs, scored, 4, runner.model, atol)


def test_one_slice_row_scores_the_same_as_the_default_slices(make_llm) -> None:
    """The smallest slice, one row a lm_head call, against the production slice size (the whole prompt at once
    here): the same tokens, ranks and top-k, logprobs within fp32 rounding."""
    llm = make_llm(enable_prefix_caching=False)
    prompt = random_prompt(torch.Generator().manual_seed(4), 12)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    whole = llm.generate(prompt, params)[0].prompt_logprobs
    llm.engine.runner.prompt_logprobs_rows = 1
    lm_head_rows = record_lm_head_rows(llm.engine.runner.model)
    sliced = llm.generate(prompt, params)[0].prompt_logprobs

    assert lm_head_rows == [1] * len(prompt)  # the sampled row, then each prompt row alone
    assert sliced[0] is None and whole[0] is None
    for got, want in zip(sliced[1:], whole[1:]):
        assert [(tid, lp.rank) for tid, lp in got.items()] == [(tid, lp.rank) for tid, lp in want.items()]
        assert [lp.logprob for lp in got.values()] == pytest.approx([lp.logprob for lp in want.values()],
                                                                    abs=LOGPROB_ATOL)
