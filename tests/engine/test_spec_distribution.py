"""Specification: through the real engine, sampled output with speculation has the law of sampled output without
it. One prompt, many unseeded requests at temperature 1 and top_k 3, three tokens each (the first from the prefill,
the other two from a verify row of one draft or its rejection and the next); drafts are the greedy continuation
(often accepted: it is the likeliest token). A two-sample chi-square test over the joint cells of the three tokens
must not reject at p = 1e-3; verify rows must have run, accepting some drafts and rejecting others."""

from __future__ import annotations

import math
from collections import Counter

import torch

from k3serve.engine.sampling_params import SamplingParams

from _llm_harness import make_llm, random_prompt  # noqa: F401  (fixture)
from _spec_harness import ScriptedProposer, token_runs

NUM_REQUESTS = 400
P_THRESHOLD_Z = 3.0902  # the standard normal's upper 1e-3 quantile


def _chi2_critical(df: int) -> float:
    c = 2.0 / (9.0 * df)  # Wilson-Hilferty
    return df * (1.0 - c + P_THRESHOLD_Z * math.sqrt(c)) ** 3


def test_speculative_sampling_keeps_the_joint_law_of_the_first_tokens(make_llm) -> None:
    prompt = random_prompt(torch.Generator().manual_seed(8), 12)
    sampled = SamplingParams(temperature=1.0, top_k=3, max_tokens=3)
    plain = make_llm(max_model_len=256, max_num_seqs=128, max_num_batched_tokens=2048)
    greedy = token_runs(plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4)))[0]
    torch.manual_seed(1)
    want = Counter(tuple(run) for run in token_runs(plain.generate([prompt] * NUM_REQUESTS, sampled)))
    spec = make_llm(max_model_len=256, max_num_seqs=128, max_num_batched_tokens=2048,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 1})
    spec.engine.speculator.proposer = ScriptedProposer({tuple(prompt): greedy}, 0)  # always the greedy token
    spec.engine.speculator.proposer.propose = lambda rid, tokens, k: greedy[len(tokens) - len(prompt):][:k]
    got = Counter(tuple(run) for run in token_runs(spec.generate([prompt] * NUM_REQUESTS, sampled)))
    cells = set(want) | set(got)
    chi2 = sum((want[c] - got[c]) ** 2 / (want[c] + got[c]) for c in cells)
    assert chi2 < _chi2_critical(len(cells) - 1), f"chi2 {chi2:.1f} on {len(cells) - 1} dof: {want} vs {got}"
    stats = spec.engine.spec_stats
    assert stats.num_drafts >= NUM_REQUESTS and 0 < stats.num_accepted_tokens < stats.num_drafts
