"""Specification: speculative decoding changes how many tokens a step emits, never which ones.

Greedy output with speculation is token for token the output without it, with the same raw logprobs (within the
GEMMs' batch-shape rounding), for K = 1,
4 and 8: a scripted proposer makes every accepted length 0..K occur (the drafts are right for a prefix, wrong
after it), so each commit length of the KDA state is exercised through the real model; prompt lookup (`ngram`) on
a model that repeats itself accepts drafts. The output respects max_tokens, stops at the first EOS / stop token /
stop string inside an accepted run, and the leak check (`_llm_harness.make_llm`) finds no block, slot, matcher or
proposer index left. A path that decoded without speculating would fail: verify rows and accepted drafts are
counted (`LLMEngine.spec_stats`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.spec.proposer import Speculator

from _llm_harness import assert_engine_empty, engine_args, make_llm, random_prompt  # noqa: F401  (fixture)
from _spec_harness import ScriptedProposer, token_runs

PROMPT_LENS = [5, 70, 130]  # inside the first block, past it, past two (prefix-cache boundaries at 64, 128)
MAX_TOKENS = 24
# Rows of another batch shape round differently in the GEMMs (the plain engine's logprobs of one prompt alone vs in
# a batch differ by ~1.3e-5); a wrong KDA commit is off by orders of magnitude more.
LOGPROB_TOLERANCE = 1e-4


def _prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [random_prompt(gen, n) for n in PROMPT_LENS]


def _spec(k: int, method: str = "ngram") -> dict[str, object]:
    return {"method": method, "num_speculative_tokens": k}


def _scripted(llm: LLM, prompts: list[list[int]], references: list[list[int]], k: int) -> ScriptedProposer:
    proposer = ScriptedProposer({tuple(p): r for p, r in zip(prompts, references)}, k)
    llm.engine.speculator.proposer = proposer
    return proposer


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_output_and_logprobs_are_the_non_speculative_ones_at_every_accepted_length(make_llm, k: int) -> None:
    prompts = _prompts()
    # the scripted drafts are right for 0, 1, ..., K tokens in turn: room for every accepted length, and more
    params = SamplingParams(temperature=0.0, max_tokens=(k + 1) * (k + 2) // 2 + 4, logprobs=3)
    plain = make_llm(max_model_len=512).generate(prompts, params)
    llm = make_llm(max_model_len=512, speculative_config=_spec(k))
    proposer = _scripted(llm, prompts, token_runs(plain), k)
    spec = llm.generate(prompts, params)
    assert token_runs(spec) == token_runs(plain)
    for got, want in zip(spec, plain):
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for token in a:
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=LOGPROB_TOLERANCE)
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, "no verify step ran"
    assert len(stats.accepted_per_position) == k, "some accepted length never occurred"
    assert stats.mean_acceptance_length > 1.0
    labels = {"model_name": llm.engine.model_name}
    assert REGISTRY.get_sample_value("vllm:spec_decode_num_accepted_tokens_total", labels) >= stats.num_accepted_tokens
    assert REGISTRY.get_sample_value("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                     labels | {"position": str(k - 1)}) > 0
    assert proposer.released == set(proposer.calls), "a finished request's drafts outlived it"


def test_prompt_lookup_accepts_drafts_on_a_repeating_model_and_keeps_its_greedy_output(echo_checkpoint: Path) -> None:
    prompts = _prompts(1)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    args = engine_args(echo_checkpoint, max_model_len=512)
    plain, spec = LLM(**args), LLM(**args, speculative_config=_spec(4))
    try:
        want = token_runs(plain.generate(prompts, params))
        assert token_runs(spec.generate(prompts, params)) == want
        stats = spec.engine.spec_stats
        assert stats.num_accepted_tokens > 0, "prompt lookup accepted nothing on repeating output"
        assert stats.num_accepted_tokens < stats.num_draft_tokens, "no draft was ever rejected: a weak test"
        assert spec.engine.speculator.proposer.num_indexed == 0
    finally:
        for llm in (plain, spec):
            assert_engine_empty(llm.engine)


@pytest.mark.parametrize("k", [4, 8])
def test_max_tokens_and_stops_inside_an_accepted_run_end_the_output_there(make_llm, k: int) -> None:
    prompts = _prompts(2)
    plain_llm = make_llm(max_model_len=512)
    reference = token_runs(plain_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)))
    stop_token = reference[0][6]  # its first occurrence ends the output
    stop_text = plain_llm.get_tokenizer().decode(reference[1][5:7])
    cases = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_token]),
             SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop_text]),
             SamplingParams(temperature=0.0, max_tokens=7)]
    want = plain_llm.generate(prompts, cases)
    llm = make_llm(max_model_len=512, speculative_config=_spec(k))
    _scripted(llm, prompts, reference, k).calls = {f"req-{i}": k for i in range(3)}  # all drafts right: long runs
    got = llm.generate(prompts, cases)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert (g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (w.outputs[0].finish_reason,
                                                                          w.outputs[0].stop_reason)
    assert len(got[2].outputs[0].token_ids) == 7
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_prefix_cache_hits_and_preemption_keep_the_greedy_output(make_llm) -> None:
    gen = torch.Generator().manual_seed(3)
    shared = random_prompt(gen, 140)
    prompts = [shared + random_prompt(gen, n) for n in (3, 20, 1)] + [random_prompt(gen, n) for n in (90, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    reference = token_runs(make_llm(max_model_len=512).generate(prompts, params))
    llm = make_llm(max_model_len=512, speculative_config=_spec(8), num_gpu_blocks_override=8,
                   max_num_batched_tokens=64)
    _scripted(llm, prompts, reference, 8)
    assert token_runs(llm.generate(prompts[:1], params)) == reference[:1]  # caches the shared prefix
    got = llm.generate(prompts, params)
    assert token_runs(got) == reference
    assert any(out.num_cached_tokens for out in got[1:3]), "no prefix-cache hit"
    assert llm.engine.num_preemptions > 0, "nothing was preempted: shrink the pool"
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_an_abort_after_a_verify_step_leaves_nothing_behind(make_llm) -> None:
    from k3serve.engine.sampling_params import StructuredOutputsParams

    prompts = _prompts(4)
    cases = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
             SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2),
             SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{20,30}"))]  # a matcher too
    reference = token_runs(make_llm(max_model_len=512).generate(prompts, cases))
    llm = make_llm(max_model_len=512, speculative_config=_spec(8))
    _scripted(llm, prompts, reference, 8)
    engine = llm.engine
    ids = [engine.add_request(p, params) for p, params in zip(prompts, cases)]
    while engine.spec_stats.num_drafts < len(ids):
        engine.step()
    assert engine.structured_outputs.num_matchers == 1
    for rid in ids:
        engine.abort_request(rid)
    assert_engine_empty(engine)  # no block, slot, request state or matcher left
    assert engine.speculator.proposer.released >= set(ids) - {None}


def test_requests_that_cannot_speculate_decode_plainly_beside_those_that_do(make_llm) -> None:
    prompts = _prompts(5)
    plain = make_llm(max_model_len=512)
    cases = [SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3),
             SamplingParams(temperature=0.0, max_tokens=12, min_tokens=8),
             SamplingParams(temperature=0.0, max_tokens=12, logit_bias={7: 5.0})]
    want = token_runs(plain.generate(prompts, cases))
    reference = token_runs(plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12)))
    llm = make_llm(max_model_len=512, speculative_config=_spec(4))
    _scripted(llm, prompts, reference, 4)
    assert token_runs(llm.generate(prompts, cases)) == want


def test_seeded_speculative_sampling_is_reproducible_and_batch_invariant(make_llm) -> None:
    prompts = _prompts(6)
    params = SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=16)
    llm = make_llm(max_model_len=512, speculative_config=_spec(4))
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    reference = token_runs(make_llm(max_model_len=512).generate(prompts, greedy))
    _scripted(llm, prompts, reference, 4)
    together = token_runs(llm.generate(prompts, params))
    alone = [token_runs(llm.generate([p], params))[0] for p in prompts]
    assert together == alone
    assert llm.engine.spec_stats.num_drafts > 0


def test_a_bad_speculative_config_fails_at_start_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"speculative_config\.num_speculative_tokens"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 9})
    with pytest.raises(ValueError, match=r"speculative_config\.method"):
        EngineArgs(speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        EngineArgs(speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config\.prompt_lookup_min"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['num_spec'\]"):
        EngineArgs(speculative_config={"method": "ngram", "num_spec": 2})
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineArgs(speculative_config="{method: ngram}")
    assert isinstance(EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
                      .speculative_config.num_speculative_tokens, int)
    assert Speculator  # the engine's drafts come through it


def test_structured_outputs_mask_each_verify_row_and_keep_the_constrained_output(make_llm) -> None:
    from k3serve.engine.sampling_params import StructuredOutputsParams

    prompts = _prompts(7)
    cases = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex))
             for regex in ("(ab|cd){3,6}x", "[0-9]{2,12}", r"\{\"k\": (true|false)\}")]
    plain = make_llm(max_model_len=512)
    want = plain.generate(prompts, cases)
    llm = make_llm(max_model_len=512, speculative_config=_spec(8))
    proposer = _scripted(llm, prompts, token_runs(want), 8)
    proposer.calls = {f"req-{i}": 8 for i in range(3)}  # start with all drafts right: long accepted runs
    got = llm.generate(prompts, cases)
    assert token_runs(got) == token_runs(want)
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert llm.engine.structured_outputs.num_matchers == 0
