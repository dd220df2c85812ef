"""Sampler: each filter and penalty against hand-computed examples, seeds that survive batching,
and raw logprobs equal to log_softmax of the model's logits."""

import math

import pytest
import torch

from k3serve.engine.sampler import RANK_ROWS, Sampler, apply_penalties, filtered_probs, prompt_logprobs
from k3serve.engine.sampling_params import SamplingParams

V = 37  # awkward vocabulary size
PROBS_4 = torch.tensor([0.5, 0.3, 0.15, 0.05])  # hand-checkable distribution


def sample(logits, params, outputs=None, prompts=None, generators=None, sampler=None):
    n = logits.shape[0]
    return (sampler or Sampler()).sample(
        logits,
        params,
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
    )


def seeded(seed):
    return torch.Generator().manual_seed(seed)


# ---- greedy and filters -------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(5, V, generator=seeded(0))
    out = sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_top_k_1_equals_greedy():
    logits = torch.randn(4, V, generator=seeded(1))
    for seed in range(20):
        out = sample(logits, [SamplingParams(top_k=1)] * 4, generators=[seeded(seed * 4 + i) for i in range(4)])
        assert out.sampled_token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_only_the_max():
    logits = torch.randn(3, V, generator=seeded(2))
    probs = filtered_probs(logits, [SamplingParams(top_p=1e-6)] * 3)
    expected = torch.zeros(3, V)
    expected[torch.arange(3), logits.argmax(-1)] = 1.0
    torch.testing.assert_close(probs, expected)


def test_top_p_keeps_smallest_set_reaching_p():
    # mass before each token: 0, 0.5, 0.8, 0.95 -> with top_p=0.7 tokens 0 and 1 survive
    probs = filtered_probs(PROBS_4.log()[None], [SamplingParams(top_p=0.7)])
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_top_k_keeps_k_most_likely():
    probs = filtered_probs(PROBS_4.log()[None], [SamplingParams(top_k=2)])
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_top_p_applies_to_top_k_survivors():
    # after top_k=3 the probs are 0.5/0.95, 0.3/0.95, 0.15/0.95; mass before token 2 = 0.842 >= 0.8
    probs = filtered_probs(PROBS_4.log()[None], [SamplingParams(top_k=3, top_p=0.8)])
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_min_p_drops_tokens_below_fraction_of_max():
    # threshold = 0.5 * 0.5 = 0.25: only 0.5 and 0.3 survive
    probs = filtered_probs(PROBS_4.log()[None], [SamplingParams(min_p=0.5)])
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    out = sample(PROBS_4.log()[None].repeat(64, 1), [SamplingParams(min_p=0.5)] * 64)
    assert set(out.sampled_token_ids) <= {0, 1}


def test_temperature_scales_logits():
    logits = torch.randn(2, V, generator=seeded(3))
    probs = filtered_probs(logits, [SamplingParams(temperature=2.0), SamplingParams(temperature=0.5)])
    torch.testing.assert_close(probs[0], (logits[0] / 2.0).softmax(-1))
    torch.testing.assert_close(probs[1], (logits[1] / 0.5).softmax(-1))


def test_rows_keep_their_own_filters_in_one_batch():
    logits = PROBS_4.log()[None].repeat(3, 1)
    probs = filtered_probs(logits, [SamplingParams(), SamplingParams(top_k=1), SamplingParams(top_p=0.7)])
    torch.testing.assert_close(probs[0], PROBS_4)
    torch.testing.assert_close(probs[1], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(probs[2], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_exponential_race_samples_the_distribution():
    num_draws = 4000
    out = sample(PROBS_4.log()[None].repeat(num_draws, 1), [SamplingParams()] * num_draws,
                 generators=[seeded(10_000 + i) for i in range(num_draws)])
    freq = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=4).float() / num_draws
    torch.testing.assert_close(freq, PROBS_4, atol=0.03, rtol=0)


# ---- penalties and min_tokens -------------------------------------------------------------


def test_penalties_hand_computed():
    # prompt [0], output [1, 3, 3]
    # repetition 2:  2 -> 1 (prompt), -1 -> -2, 0.5 unchanged (unseen), 3 -> 1.5
    # frequency 0.5: token 1 (x1) -0.5, token 3 (x2) -1.0;  presence 0.25: tokens 1, 3 -0.25
    row = torch.tensor([2.0, -1.0, 0.5, 3.0])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(row, p, prompt_token_ids=[0], output_token_ids=[1, 3, 3])
    torch.testing.assert_close(row, torch.tensor([1.0, -2.75, 0.5, 0.25]))


def test_presence_and_frequency_ignore_the_prompt():
    row = torch.tensor([1.0, 1.0, 1.0])
    apply_penalties(row, SamplingParams(presence_penalty=1.0, frequency_penalty=1.0), [0, 0], [2])
    torch.testing.assert_close(row, torch.tensor([1.0, 1.0, -1.0]))


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0)]).sampled_token_ids == [0]
    p = SamplingParams(temperature=0, frequency_penalty=0.4)
    assert sample(logits, [p], outputs=[[0, 0]]).sampled_token_ids == [1]  # 3 - 0.8 < 2.5


def test_min_tokens_bans_eos_and_stop_token_ids():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])  # eos=0, stop token 1
    sampler = Sampler(eos_token_id=0)
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    assert sample(logits, [p], outputs=[[3]], sampler=sampler).sampled_token_ids == [2]
    assert sample(logits, [p], outputs=[[3, 3]], sampler=sampler).sampled_token_ids == [0]
    p_ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sample(logits, [p_ignore], outputs=[[]], sampler=sampler).sampled_token_ids == [0]


# ---- logit_bias ---------------------------------------------------------------------------


def test_logit_bias_moves_the_greedy_argmax_of_its_own_row():
    logits = torch.tensor([[3.0, 2.5, 0.0]])

    def greedy(bias):
        return sample(logits, [SamplingParams(temperature=0, logit_bias=bias)]).sampled_token_ids[0]

    assert greedy(None) == 0
    assert greedy({2: 3.5}) == 2  # 0 + 3.5 > 3
    assert greedy({0: -1.0}) == 1  # 3 - 1 < 2.5
    assert greedy({2: 2.9, 1: -5.0}) == 0  # a bias adds to the logit; it does not force the token
    both = sample(logits.repeat(2, 1), [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={2: 3.5})])
    assert both.sampled_token_ids == [0, 2]  # the unbiased row is untouched


def test_logit_bias_minus_100_keeps_the_likeliest_token_from_being_sampled():
    rows, vocab = 500, 8
    logits = torch.zeros(rows, vocab)
    logits[:, 3] = 4.0  # p(3) = 0.89

    def draws(bias):
        params = [SamplingParams(logit_bias=bias)] * rows
        return sample(logits, params, generators=[seeded(i) for i in range(rows)]).sampled_token_ids

    assert draws(None).count(3) > 0.8 * rows
    banned = draws({3: -100.0})
    assert 3 not in banned and len(set(banned)) == vocab - 1  # the other tokens share the draws


def test_logit_bias_comes_before_penalties_and_cannot_lift_a_min_tokens_ban():
    logits = torch.tensor([[-2.0, 0.5, -9.0]])
    # vLLM's order: token 0 (in the prompt) -2 + 4 = 2, then repetition 2: 1 > 0.5. Penalty first: -4 + 4 = 0 < 0.5.
    p = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={0: 4.0})
    assert sample(logits, [p], prompts=[[0]]).sampled_token_ids == [0]
    p = SamplingParams(temperature=0, min_tokens=1, logit_bias={2: 100.0})  # EOS is 2: -inf + 100 is still -inf
    assert sample(logits, [p], sampler=Sampler(eos_token_id=2)).sampled_token_ids == [1]


def test_logit_bias_leaves_logprobs_raw():
    logits = torch.randn(1, V, generator=seeded(5))
    least = int(logits[0].argmin())
    out = sample(logits, [SamplingParams(temperature=0, logprobs=1, logit_bias={least: 100.0})])
    raw = torch.log_softmax(logits[0], dim=-1)
    entry = out.logprobs[0]
    assert out.sampled_token_ids == [least] and entry.token_ids == [least, int(logits[0].argmax())]
    assert entry.logprobs[0] == pytest.approx(raw[least].item(), abs=1e-6)
    assert entry.ranks == [V, 1]  # the least likely token, as the model scored it


# ---- seeds and batch composition ----------------------------------------------------------


class FakeModel:
    """Next-token logits that depend only on the request's own last token."""

    def __init__(self, vocab_size=1000):
        self.weight = torch.randn(vocab_size, vocab_size, generator=seeded(99)) * 2.0

    def logits(self, histories):
        return torch.stack([self.weight[h[-1]] for h in histories])


def run_batch(model, requests, num_steps=20):
    """requests: list of (params, prompt). Returns generated token ids per request."""
    sampler = Sampler()
    prompts = [prompt for _, prompt in requests]
    params = [p for p, _ in requests]
    generators = [seeded(p.seed) if p.seed is not None else None for p in params]
    outputs = [[] for _ in requests]
    for _ in range(num_steps):
        logits = model.logits([pr + out for pr, out in zip(prompts, outputs)])
        out = sampler.sample(logits, params, outputs, prompts, generators)
        for tokens, tid in zip(outputs, out.sampled_token_ids):
            tokens.append(tid)
    return outputs


TARGET = (SamplingParams(seed=1234, temperature=0.9, top_k=200, top_p=0.95, repetition_penalty=1.1), [5, 6, 7])
OTHERS = [
    (SamplingParams(temperature=0.0), [1, 2]),
    (SamplingParams(), [3]),
    (SamplingParams(seed=7, top_p=0.5), [4, 4, 4]),
    (SamplingParams(seed=1234, temperature=1.3), [5, 6, 7]),  # same seed, own generator
    (SamplingParams(min_p=0.1, frequency_penalty=1.0), [8]),
    (SamplingParams(seed=99, top_k=3), [9, 10]),
    (SamplingParams(temperature=0.0, presence_penalty=0.5), [11]),
]


@pytest.mark.parametrize("batch", ["alone", "front-of-3", "middle-of-8", "last-of-8"])
def test_seeded_request_is_independent_of_batch(batch):
    model = FakeModel()
    alone = run_batch(model, [TARGET])[0]
    requests = {
        "alone": [TARGET],
        "front-of-3": [TARGET] + OTHERS[:2],
        "middle-of-8": OTHERS[:4] + [TARGET] + OTHERS[4:],
        "last-of-8": OTHERS[::-1] + [TARGET],
    }[batch]
    outputs = run_batch(model, requests)
    assert outputs[requests.index(TARGET)] == alone
    assert len(set(alone)) > 1  # really sampled, not a fixed point


def test_different_seeds_differ():
    model = FakeModel()
    a = run_batch(model, [(SamplingParams(seed=1), [0])])[0]
    b = run_batch(model, [(SamplingParams(seed=2), [0])])[0]
    assert a != b


def test_unseeded_rows_differ_across_runs():
    model = FakeModel()
    req = (SamplingParams(temperature=5.0), [0])  # nearly uniform over 1000 tokens
    assert run_batch(model, [req, req])[0] != run_batch(model, [req, req])[0]


# ---- logprobs -----------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_chosen_token_first():
    logits = torch.randn(3, V, generator=seeded(4))
    params = [
        SamplingParams(logprobs=5, temperature=0.7, frequency_penalty=1.0, seed=0),
        SamplingParams(),
        SamplingParams(logprobs=0, temperature=0),
    ]
    out = sample(logits, params, outputs=[[1, 2, 3]] * 3, generators=[seeded(0), None, None])
    ref = torch.log_softmax(logits, dim=-1)  # raw: before penalties and temperature

    first = out.logprobs[0]
    tid = out.sampled_token_ids[0]
    assert len(first.token_ids) == len(first.logprobs) == len(first.ranks) == 1 + 5
    assert first.token_ids[0] == tid
    assert first.logprobs[0] == pytest.approx(ref[0, tid].item(), abs=1e-6)
    assert first.ranks[0] == int((ref[0] > ref[0, tid]).sum()) + 1
    top_lp, top_ids = ref[0].topk(5)
    assert first.token_ids[1:] == top_ids.tolist()
    assert first.logprobs[1:] == pytest.approx(top_lp.tolist(), abs=1e-6)
    assert first.ranks[1:] == [1, 2, 3, 4, 5]
    assert math.isclose(sum(math.exp(lp) for lp in ref[0].tolist()), 1.0, rel_tol=1e-5)

    assert out.logprobs[1] is None
    last = out.logprobs[2]
    assert last.token_ids == [int(logits[2].argmax())] and last.ranks == [1]
    assert last.logprobs[0] == pytest.approx(ref[2].max().item(), abs=1e-6)


def test_logprobs_to_dict_merges_the_chosen_token():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    entry = sample(logits, [SamplingParams(temperature=0, logprobs=2)]).logprobs[0]
    assert entry.token_ids == [0, 0, 1]
    as_dict = entry.to_dict()
    assert list(as_dict) == [0, 1] and as_dict[0].rank == 1 and as_dict[1].rank == 2


def test_prompt_logprobs_score_each_rows_next_prompt_token():
    prompt = [3, 17, 0, 36, 5]
    logits = torch.randn(len(prompt) - 1, V, generator=seeded(5))  # row t: the output at position t
    result = prompt_logprobs(logits, prompt[1:], 3)
    ref = torch.log_softmax(logits, dim=-1)
    assert len(result) == len(prompt) - 1
    for t, entry in enumerate(result):
        target = prompt[t + 1]
        assert entry.token_ids[0] == target
        assert entry.logprobs[0] == pytest.approx(ref[t, target].item(), abs=1e-6)
        assert entry.ranks[0] == int((ref[t] > ref[t, target]).sum()) + 1
        assert entry.token_ids[1:] == ref[t].topk(3).indices.tolist()
        assert entry.logprobs[1:] == ref[t].topk(3).values.tolist() and entry.ranks[1:] == [1, 2, 3]
    with pytest.raises(ValueError, match="one row per target token"):
        prompt_logprobs(logits[:2], prompt[1:], 3)


def test_ranks_of_more_rows_than_one_count_block_are_each_rows_own():
    rows = 2 * RANK_ROWS + 5  # two whole blocks of the rank count and a ragged one
    logits = torch.randn(rows, V, generator=seeded(6))
    targets = torch.randint(0, V, (rows,), generator=seeded(7)).tolist()
    ref = torch.log_softmax(logits, dim=-1)
    ranks = [entry.ranks[0] for entry in prompt_logprobs(logits, targets, 0)]
    assert ranks == [int((ref[t] > ref[t, target]).sum()) + 1 for t, target in enumerate(targets)]


def test_prompt_logprobs_of_slices_equal_those_of_all_rows_at_once():
    """Row-wise: the runner may score a prompt a slice at a time (here 2 + 2 + a ragged 1)."""
    targets = [4, 0, 36, 36, 9]
    logits = torch.randn(len(targets), V, generator=seeded(6))
    whole = prompt_logprobs(logits, targets, 4)
    sliced = [e for lo in range(0, len(targets), 2) for e in prompt_logprobs(logits[lo : lo + 2], targets[lo : lo + 2], 4)]
    assert sliced == whole


def test_seeded_row_without_generator_is_rejected():
    with pytest.raises(ValueError, match="seed=3 but no generator"):
        sample(torch.zeros(1, V), [SamplingParams(seed=3)])
