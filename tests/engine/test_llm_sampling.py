"""Specification of `SamplingParams` as `LLM.generate` honours them (vLLM semantics).

Reference runs are greedy with `ignore_eos`, so what a stop condition cuts short is known in
advance: a stop string ends the text right before it (or after it, with
`include_stop_str_in_output`) with finish_reason "stop" and stop_reason the string, even when
the same token also reaches max_tokens; a stop token id ends the tokens at it (stop_reason the
id); otherwise the request ends at max_tokens with "length". Logprobs are raw (log_softmax of
the model's logits): per generated token the chosen one plus the top-n, summing to
cumulative_logprob; prompt logprobs have one entry per prompt token, the first None. Values
are checked against full-sequence passes of the model (model/score.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.score import score_tokens

from _llm_harness import (
    greedy_oracle,  # noqa: F401  (fixture)
    make_llm,  # noqa: F401  (fixture)
    random_prompt,
)

LOGPROB_ATOL = 1e-4  # fp32 engine (batched, chunked, cached) vs one full-sequence pass; times max(1, |logprob|)
NUM_REFERENCE_TOKENS = 24
CHUNKED = dict(max_num_batched_tokens=64, max_adaptive_batched_tokens=64, long_prefill_token_threshold=48)
REPLACEMENT_CHAR = "\ufffd"


def greedy(**overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": NUM_REFERENCE_TOKENS, "ignore_eos": True, **overrides})


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return random_prompt(torch.Generator().manual_seed(11), 200)


@pytest.fixture
def llm(make_llm):
    return make_llm()


def reference_texts(llm, prompt: list[int]) -> tuple[list[int], list[str]]:
    """The greedy reference: its tokens and the text after each token (no stop strings held back)."""
    engine = llm.engine
    request_id = engine.add_request(prompt, greedy())
    token_ids, texts = [], []
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.request_id == request_id
            token_ids += delta.new_token_ids
            texts.append((texts[-1] if texts else "") + delta.new_text)
    assert len(token_ids) == NUM_REFERENCE_TOKENS
    return token_ids, texts


def first_clean_stop_string(texts: list[str], length: int = 2) -> tuple[int, str]:
    """(k, s): s is the last `length` chars of the text after token k, plain ASCII, and its first
    occurrence in the full text ends exactly there, so generation must stop at token k."""
    full = texts[-1]
    for k in range(3, len(texts) - 1):
        end = len(texts[k])
        if end < length or texts[k] == texts[k - 1]:
            continue
        s = texts[k][end - length :]
        if s.isascii() and s.isprintable() and full.find(s) == end - length:
            return k, s
    raise AssertionError(f"no usable stop string in {full!r}")


def assert_logprob_close(got: float, expected: float) -> None:
    assert got == pytest.approx(expected, abs=LOGPROB_ATOL * max(1.0, abs(expected)))


# ---- stop conditions -----------------------------------------------------------------------
@pytest.mark.parametrize("include_stop_str_in_output", [False, True], ids=["stop_str_dropped", "stop_str_kept"])
def test_stop_string_truncates_the_text(llm, prompt, include_stop_str_in_output: bool):
    ref_tokens, texts = reference_texts(llm, prompt)
    k, stop = first_clean_stop_string(texts)

    params = greedy(stop=["never-generated", stop], include_stop_str_in_output=include_stop_str_in_output)
    out = llm.generate(prompt, params)[0].outputs[0]

    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == ref_tokens[: k + 1]
    assert out.text == (texts[k] if include_stop_str_in_output else texts[k][: -len(stop)])


def test_stop_string_completed_by_the_last_allowed_token_still_reports_stop(llm, prompt):
    ref_tokens, texts = reference_texts(llm, prompt)
    k, stop = first_clean_stop_string(texts)

    out = llm.generate(prompt, greedy(stop=stop, max_tokens=k + 1))[0].outputs[0]

    assert out.token_ids == ref_tokens[: k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == texts[k][: -len(stop)]


def test_stop_token_id_ends_generation_at_that_token(llm, prompt):
    ref_tokens, _ = reference_texts(llm, prompt)
    k = next(i for i in range(2, NUM_REFERENCE_TOKENS) if ref_tokens.index(ref_tokens[i]) == i)

    out = llm.generate(prompt, greedy(stop_token_ids=[ref_tokens[k]]))[0].outputs[0]

    assert out.token_ids == ref_tokens[: k + 1]  # the stop token is part of the output tokens
    assert (out.finish_reason, out.stop_reason) == ("stop", ref_tokens[k])


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_ignore_eos_runs_to_max_tokens(llm, prompt, greedy_oracle, max_tokens: int):
    out = llm.generate(prompt, greedy(max_tokens=max_tokens))[0].outputs[0]
    assert out.token_ids == greedy_oracle.run(prompt, max_tokens).token_ids
    assert (out.finish_reason, out.stop_reason) == ("length", None)


# ---- logprobs ------------------------------------------------------------------------------
def test_greedy_logprobs_are_the_models_and_sum_to_cumulative_logprob(llm, prompt, greedy_oracle):
    num_top = 3
    out = llm.generate(prompt, greedy(max_tokens=6, logprobs=num_top))[0].outputs[0]
    oracle = greedy_oracle.run(prompt, 6)

    assert len(out.logprobs) == len(out.token_ids) == 6
    for token_id, entry, logits in zip(out.token_ids, out.logprobs, oracle.logits):
        expected = torch.log_softmax(logits, dim=-1)
        assert next(iter(entry)) == token_id  # the chosen token comes first
        assert entry[token_id].rank == 1  # greedy: it is also the top-1, so only 3 entries
        assert len(entry) == num_top
        top = expected.topk(num_top)
        assert list(entry) == top.indices.tolist()
        assert [e.rank for e in entry.values()] == [1, 2, 3]
        for tid, lp in entry.items():
            assert_logprob_close(lp.logprob, float(expected[tid]))
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_sampled_logprobs_rank_the_chosen_token_among_the_whole_vocabulary(llm, prompt):
    params = SamplingParams(temperature=1.5, seed=5, max_tokens=16, ignore_eos=True, logprobs=2)
    out = llm.generate(prompt, params)[0].outputs[0]

    seq = list(prompt)
    for token_id, entry in zip(out.token_ids, out.logprobs):
        expected = torch.log_softmax(score_tokens(llm.engine.runner.model, seq)[-1], dim=-1)
        rank = int((expected > expected[token_id]).sum()) + 1
        assert next(iter(entry)) == token_id
        assert entry[token_id].rank == rank
        assert_logprob_close(entry[token_id].logprob, float(expected[token_id]))
        assert len(entry) == (2 if rank <= 2 else 3)
        seq.append(token_id)
    assert any(e[t].rank > 1 for t, e in zip(out.token_ids, out.logprobs)), "temperature 1.5 never left the argmax"
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))
    assert math.isfinite(out.cumulative_logprob) and out.cumulative_logprob < 0


def test_no_logprobs_unless_asked(llm, prompt):
    out = llm.generate(prompt, greedy(max_tokens=2))[0]
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert out.prompt_logprobs is None


@pytest.mark.parametrize("engine_args", [{}, CHUNKED], ids=["one_pass", "chunked_prefill"])
def test_prompt_logprobs_score_every_prompt_token_after_the_first(make_llm, prompt, engine_args):
    llm = make_llm(**engine_args)
    out = llm.generate(prompt, greedy(max_tokens=1, prompt_logprobs=2))[0]

    assert len(out.outputs[0].token_ids) == 1
    assert len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    expected = torch.log_softmax(score_tokens(llm.engine.runner.model, prompt), dim=-1)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert next(iter(entry)) == prompt[i]
        assert_logprob_close(entry[prompt[i]].logprob, float(expected[i - 1, prompt[i]]))
        assert len(entry) in (2, 3)


def test_prompt_logprobs_are_complete_even_when_the_prompt_is_cached(llm, prompt):
    llm.generate(prompt, greedy(max_tokens=1))  # leaves the prompt's blocks and KDA checkpoint cached
    out = llm.generate(prompt, greedy(max_tokens=1, prompt_logprobs=0))[0]
    assert len(out.prompt_logprobs) == len(prompt)
