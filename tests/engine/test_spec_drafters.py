"""Specification: the model-based drafters (EAGLE, DSpark, draft_model) change how many tokens a step emits, never
which ones.

Over the self-repeating target (`echo_checkpoint`) with drafters that propose the last token again (`drafters`),
greedy output with speculation is token for token the output without it, for each method at K = 1, 4 and 8, with
prefix-cache hits and preemption, and an abort after a verify step leaves no block, slot or stored draft. A path
that decoded without speculating, or without running the drafter, fails: verify rows, accepted drafts and drafter
forwards are counted. The target itself as its own draft_model has (almost) every draft accepted: its KDA state,
kept one token ahead and recomputed from the tokens after a prefix hit, a preemption or a handoff, is exact. A
drafter that does not fit its target fails at start, naming the field; probabilistic drafting keeps the target's
law (the rejection sampler with q, and the first tokens' joint law through the engine).
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.spec.rejection import rejection_sample
from k3serve.model.config import ConfigError

from _llm_harness import assert_engine_empty, engine_args, random_prompt
from _spec_harness import token_runs

PROMPT_LENS = [5, 70, 130]
METHODS = ["eagle", "dspark", "draft_model"]
P_THRESHOLD_Z = 3.0902  # the standard normal's upper 1e-3 quantile


def _chi2_critical(df: int) -> float:
    c = 2.0 / (9.0 * df)  # Wilson-Hilferty
    return df * (1.0 - c + P_THRESHOLD_Z * math.sqrt(c)) ** 3


def _spec(drafters: dict[str, Path], method: str, k: int, **more: object) -> dict[str, object]:
    return {"method": method, "model": str(drafters[method]), "num_speculative_tokens": k, **more}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [random_prompt(gen, n) for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(echo_checkpoint: Path, prompts: list[list[int]]) -> list[list[int]]:
    plain = LLM(**engine_args(echo_checkpoint, max_model_len=512))
    out = token_runs(plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32)))
    assert_engine_empty(plain.engine)
    return out


def _check_speculated(llm: LLM, method: str) -> None:
    engine = llm.engine
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts, "no verify step ran"
    assert engine.runner.drafter.num_forwards > 0, "the drafter never ran"
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, f"{method}: no draft accepted, or none rejected"
    assert engine.speculator.proposer.num_indexed == 0, "a finished request's drafts outlived it"
    assert engine.runner.drafter.num_tracked == 0, "a finished request's drafter state outlived it"
    assert_engine_empty(engine)


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_with_a_drafter_is_the_non_speculative_one(echo_checkpoint: Path, drafters: dict[str, Path],
                                                                prompts, reference, method: str, k: int) -> None:
    llm = LLM(**engine_args(echo_checkpoint, max_model_len=512), speculative_config=_spec(drafters, method, k))
    assert token_runs(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))) == reference
    if k > 1:  # their drafts continue the repetition (DSpark's through its Markov head): later positions too
        assert len(llm.engine.spec_stats.accepted_per_position) > 1
    _check_speculated(llm, method)


@pytest.mark.parametrize("method", METHODS)
def test_prefix_cache_hits_and_preemption_keep_the_greedy_output(echo_checkpoint: Path, drafters: dict[str, Path],
                                                                 method: str) -> None:
    gen = torch.Generator().manual_seed(3)
    shared = random_prompt(gen, 140)
    prompts = [shared + random_prompt(gen, n) for n in (3, 20, 1)] + [random_prompt(gen, n) for n in (90, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain = LLM(**engine_args(echo_checkpoint, max_model_len=512))
    want = token_runs(plain.generate(prompts, params))
    llm = LLM(**engine_args(echo_checkpoint, max_model_len=512, num_gpu_blocks_override=8, max_num_batched_tokens=64),
              speculative_config=_spec(drafters, method, 4))
    assert token_runs(llm.generate(prompts[:1], params)) == want[:1]  # caches the shared prefix
    got = llm.generate(prompts, params)
    assert token_runs(got) == want
    assert any(out.num_cached_tokens for out in got[1:3]), "no prefix-cache hit"
    assert llm.engine.num_preemptions > 0, "nothing was preempted: shrink the pool"
    _check_speculated(llm, method)
    assert_engine_empty(plain.engine)


@pytest.mark.parametrize("method", METHODS)
def test_an_abort_after_a_verify_step_leaves_nothing_behind(echo_checkpoint: Path, drafters: dict[str, Path],
                                                            prompts, method: str) -> None:
    llm = LLM(**engine_args(echo_checkpoint, max_model_len=512), speculative_config=_spec(drafters, method, 8))
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=40)) for p in prompts]
    while engine.spec_stats.num_drafts < 2 * len(ids):
        engine.step()
    assert engine.speculator.proposer.num_indexed == len(ids)  # each holds its next drafts
    for rid in ids:
        engine.abort_request(rid)
    assert engine.speculator.proposer.num_indexed == 0
    assert not engine.runner.has_pending_commit
    assert_engine_empty(engine)


def _edited(drafter: Path, tmp_path: Path, **fields: object) -> Path:
    out = tmp_path / f"drafter-{'-'.join(fields)}"
    shutil.copytree(drafter, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **fields}))
    return out


def test_a_drafter_that_does_not_fit_the_target_fails_at_start_naming_the_field(
        echo_checkpoint: Path, drafters: dict[str, Path], tmp_path: Path) -> None:
    args = engine_args(echo_checkpoint, max_model_len=512)
    eagle, dspark = drafters["eagle"], drafters["dspark"]
    cases = [
        ({"method": "eagle", "model": str(_edited(eagle, tmp_path, vocab_size=256))}, r"vocab_size=256"),
        ({"method": "eagle", "model": str(_edited(eagle, tmp_path, hidden_size=32))}, r"hidden_size=32"),
        ({"method": "dspark", "model": str(eagle)}, r"speculative_config\.method='dspark'.*'eagle' drafter"),
        ({"method": "dspark", "model": str(_edited(dspark, tmp_path, dspark_block_size=2))}, r"dspark_block_size=2"),
        ({"method": "dspark", "model": str(_edited(dspark, tmp_path, dspark_target_layer_ids=[0, 9]))},
         r"dspark_target_layer_ids \[9\]"),
        ({"method": "dspark", "model": str(_edited(dspark, tmp_path, dspark_markov_rank=-1))}, r"dspark_markov_rank"),
        ({"method": "eagle", "model": str(tmp_path)}, r"speculative_config\.model: no config\.json"),
        ({"method": "eagle", "model": str(_edited(eagle, tmp_path, draft_method="medusa"))}, r"draft_method"),
    ]
    for spec, message in cases:
        with pytest.raises(ConfigError, match=message):
            LLM(**args, speculative_config={**spec, "num_speculative_tokens": 4})
    small = drafters["draft_model"]
    with pytest.raises(ConfigError, match=r"'draft_model' drafter \(its config\.json has no draft_method\)"):
        LLM(**args, speculative_config={"method": "eagle", "model": str(small), "num_speculative_tokens": 4})
    raw = json.loads((small / "config.json").read_text())
    other = _edited(small, tmp_path, text_config={**raw["text_config"], "vocab_size": 1024})
    with pytest.raises(ConfigError, match=r"vocab_size=1024 does not fit the target's vocab_size=512"):
        LLM(**args, speculative_config={"method": "draft_model", "model": str(other), "num_speculative_tokens": 4})


def test_the_target_as_its_own_draft_model_has_its_drafts_accepted(echo_checkpoint: Path) -> None:
    """Its drafts are the target's own greedy tokens when the drafter's state is exact, through prefix-cache hits
    and preemption (both make it recompute from token 0); a near-tie between batch shapes may reject one."""
    gen = torch.Generator().manual_seed(4)
    shared = random_prompt(gen, 140)
    prompts = [shared + random_prompt(gen, n) for n in (3, 20)] + [random_prompt(gen, n) for n in (90, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want = token_runs(LLM(**engine_args(echo_checkpoint, max_model_len=512)).generate(prompts, params))
    llm = LLM(**engine_args(echo_checkpoint, max_model_len=512, num_gpu_blocks_override=8, max_num_batched_tokens=64),
              speculative_config={"method": "draft_model", "model": str(echo_checkpoint), "num_speculative_tokens": 4})
    assert token_runs(llm.generate(prompts[:1], params)) == want[:1]
    got = llm.generate(prompts, params)
    assert token_runs(got) == want
    assert any(out.num_cached_tokens for out in got[1:2]) and llm.engine.num_preemptions > 0
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens > 0, (stats.num_accepted_tokens,
                                                                             stats.num_draft_tokens)
    assert llm.engine.runner.drafter.num_tracked == 0
    assert_engine_empty(llm.engine)


def test_rejection_with_draft_probabilities_emits_the_target_law() -> None:
    """Two drafts from q (support outside p's included), target rows p1, p2 and bonus p3: the first emitted token
    has law p1, the second (when the first draft passed) law p2."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6], [0.2] * 5])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.6, 0.0], [0.6, 0.1, 0.1, 0.1, 0.1]])
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    firsts, seconds, trials = Counter(), Counter(), 6000
    for _ in range(trials):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        run = rejection_sample(p.log(), drafts, params, 0, q).token_ids
        firsts[run[0]] += 1
        if len(run) > 1:
            seconds[run[1]] += 1
    for counts, row in ((firsts, p[0]), (seconds, p[1])):
        n = sum(counts.values())
        assert all(counts[x] == 0 for x in range(5) if row[x] == 0), "a token the target gives 0 was emitted"
        chi2 = sum((counts[x] - n * float(row[x])) ** 2 / (n * float(row[x])) for x in range(5) if row[x] > 0)
        assert chi2 < _chi2_critical(int((row > 0).sum()) - 1), f"chi2 {chi2:.1f}: {counts} vs {row.tolist()}"
    with pytest.raises(ValueError, match="draft_probs must be"):
        rejection_sample(p.log(), [0, 1], params, 0, q[:1])


def test_probabilistic_drafting_keeps_the_joint_law_of_the_first_tokens(echo_checkpoint: Path,
                                                                        drafters: dict[str, Path]) -> None:
    """Unseeded requests at temperature 1, top_k 3, three tokens each (the first from the prefill, the others from
    verify rows of EAGLE drafts sampled from its q): a two-sample chi-square test over the joint cells against the
    same requests without speculation must not reject at p = 1e-3."""
    prompt = random_prompt(torch.Generator().manual_seed(8), 12)
    sampled = SamplingParams(temperature=1.0, top_k=3, max_tokens=3)
    args = engine_args(echo_checkpoint, max_model_len=256, max_num_seqs=128, max_num_batched_tokens=2048)
    torch.manual_seed(1)
    want = Counter(tuple(r) for r in token_runs(LLM(**args).generate([prompt] * 300, sampled)))
    spec = LLM(**args, speculative_config=_spec(drafters, "eagle", 2, draft_sample_method="probabilistic"))
    got = Counter(tuple(r) for r in token_runs(spec.generate([prompt] * 300, sampled)))
    cells = set(want) | set(got)
    chi2 = sum((want[c] - got[c]) ** 2 / (want[c] + got[c]) for c in cells)
    assert chi2 < _chi2_critical(len(cells) - 1), f"chi2 {chi2:.1f} on {len(cells) - 1} dof"
    stats = spec.engine.spec_stats
    assert stats.num_drafts >= 300 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_engine_empty(spec.engine)


@pytest.mark.parametrize("method", METHODS)
def test_stops_constraints_and_logprobs_inside_accepted_runs_are_the_non_speculative_ones(
        echo_checkpoint: Path, drafters: dict[str, Path], prompts, reference, method: str) -> None:
    from k3serve.engine.sampling_params import StructuredOutputsParams

    plain = LLM(**engine_args(echo_checkpoint, max_model_len=512))
    stop_text = plain.get_tokenizer().decode(reference[1][9:11])
    cases = [SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[reference[0][12]], logprobs=2),
             SamplingParams(temperature=0.0, max_tokens=32, stop=[stop_text]),
             SamplingParams(temperature=0.0, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{4,20}x"))]
    want = plain.generate(prompts, cases)
    llm = LLM(**engine_args(echo_checkpoint, max_model_len=512), speculative_config=_spec(drafters, method, 8))
    got = llm.generate(prompts, cases)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert (g.outputs[0].text, g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (
            w.outputs[0].text, w.outputs[0].finish_reason, w.outputs[0].stop_reason)
    for a, b in zip(got[0].outputs[0].logprobs, want[0].outputs[0].logprobs):
        assert a.keys() == b.keys()
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    assert llm.engine.structured_outputs.num_matchers == 0
    _check_speculated(llm, method)
    assert_engine_empty(plain.engine)
