"""logit_bias while a batch's rows change from step to step: each request's own bias on its own row, every step.

The reference is the per-row form the sampler had before it kept the biases on the device: for each row, one
indexed add of that row's token ids and fp32 biases. `LogitBiasBatch` must give exactly its logits, for any
sequence of batches (requests with and without bias joining, leaving, reordered, one params object shared by
two rows), and copy a buffer to the device only when a biased batch's rows change. In the engine, requests join
and leave a running batch (chunked prefills beside decodes; on CUDA the decode steps replay padded CUDA graphs):
each biased request boosts a token of its own by +100 and must emit nothing else; each unbiased one must emit
its raw argmax (rank 1 in its raw logprobs) at every step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from k3serve.engine.llm import LLM
from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.logit_bias import LogitBiasBatch
from k3serve.engine.sampler import Sampler, apply_penalties
from k3serve.engine.sampling_params import SamplingParams

from _llm_harness import make_llm, random_prompt  # noqa: F401  (make_llm: fixture)

V = 37  # awkward vocabulary size
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def per_row_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The reference: a copy of `logits` with each row's bias added by that row's own indexed add."""
    out = logits.clone()
    for row, p in zip(out, params):
        if p.logit_bias is not None:
            token_ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            row.index_add_(0, token_ids, torch.tensor(list(p.logit_bias.values()), dtype=torch.float32))
    return out


BIASES = (1 / 3, -0.1, 2.7, -7 / 3, 4.1, -100.0, 100.0)  # fp32 rounds the first five; +-100 are OpenAI's bounds


def biased(gen: torch.Generator, num_entries: int) -> SamplingParams:
    """A greedy request biasing `num_entries` distinct random tokens by BIASES in turn."""
    token_ids = torch.randperm(V, generator=gen)[:num_entries].tolist()
    values = [BIASES[i % len(BIASES)] for i in range(num_entries)]
    return SamplingParams(temperature=0.0, logit_bias=dict(zip(token_ids, values)))


def changing_batches() -> tuple[list[list[SamplingParams]], list[int]]:
    """Batches of successive steps and how many uploads `LogitBiasBatch` has made after each."""
    gen = seeded(0)
    a, c, d, f = biased(gen, 5), biased(gen, 11), biased(gen, 1), biased(gen, V)  # f biases every token
    b, e = SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)
    steps = [
        ([a, b, c], 1),
        ([a, b, c], 1),  # the same rows: the buffer on the device serves again
        ([a, c], 2),  # an unbiased request left: c moved up a row
        ([c, a], 3),  # reordered
        ([c, a, d, e], 4),  # a biased and an unbiased request joined
        ([b, e], 4),  # no biased row: nothing to upload, nothing added
        ([a, a, f, b], 5),  # one params object in two rows (LLM.generate shares one)
        ([a, a, f, b], 5),
        ([a, c, f, b], 6),  # a request with the same row count but other params replaced the second a
    ]
    return [batch for batch, _ in steps], [n for _, n in steps]


@pytest.mark.parametrize("device", DEVICES)
def test_each_row_gets_its_own_bias_as_rows_join_leave_and_move(device: str) -> None:
    bias = LogitBiasBatch()
    gen = seeded(1)
    for step, (params, num_uploads) in enumerate(zip(*changing_batches())):
        logits = torch.randn(len(params), V, generator=gen)
        logits[0, :3] = float("-inf")  # a min_tokens ban stays a ban: -inf + 100 is -inf
        got = logits.to(device, copy=True)
        bias.apply(got, params)
        assert torch.equal(got.cpu(), per_row_bias(logits, params)), f"step {step}"
        assert bias.num_uploads == num_uploads, f"step {step}"


def test_a_token_id_outside_the_vocabulary_is_an_error_not_the_next_rows_token() -> None:
    params = [SamplingParams(logit_bias={V: 5.0}), SamplingParams()]  # V is token 0 of the next row, flat
    with pytest.raises(ValueError, match=rf"row 0: logit_bias token id {V} is outside the vocabulary \[0, {V}\)"):
        LogitBiasBatch().apply(torch.zeros(2, V), params)


def test_batches_without_bias_upload_nothing() -> None:
    sampler = Sampler()
    plain = [SamplingParams(temperature=0.0), SamplingParams(seed=3, top_k=5)]
    for _ in range(3):
        sampler.sample(torch.randn(2, V), plain, [[], []], [[], []], [None, seeded(3)])
    assert sampler.logit_bias.num_uploads == 0


def reference_tokens(logits, params, outputs, prompts, eos):
    """Greedy tokens of the per-row order: the min_tokens ban on EOS, the row's bias, the penalties, the argmax."""
    tokens = []
    for row, p, output, prompt in zip(logits.clone(), params, outputs, prompts):
        if len(output) < p.min_tokens:
            row[eos] = float("-inf")
        row = per_row_bias(row[None], [p])[0]
        apply_penalties(row, p, prompt, output)
        tokens.append(int(row.argmax()))
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_sampler_takes_the_argmax_after_min_tokens_bias_then_penalties_as_rows_change(device: str) -> None:
    """Greedy tokens over the changing batches, every request with a min_tokens ban on EOS for its first two
    tokens and a repetition penalty over its prompt, equal the per-row order's; the logits are of the biases'
    size, so a bias on the wrong row or of the wrong size moves the argmax."""
    eos, prompt = 4, [0, 5, 9]
    sampler, gen, variants = Sampler(eos_token_id=eos), seeded(2), {}
    for step, batch in enumerate(changing_batches()[0]):
        params = [variants.setdefault(id(p), dataclasses.replace(p, repetition_penalty=1.5, min_tokens=2))
                  for p in batch]  # one variant a request: the rows' identities stay those of the batch
        outputs = [[1] * (step % 3)] * len(params)  # the ban holds at steps 0, 1, 3, 4, 6, 7
        prompts = [prompt] * len(params)
        logits = torch.randn(len(params), V, generator=gen) * 3
        out = sampler.sample(logits.to(device), params, outputs, prompts, [None] * len(params))
        assert out.sampled_token_ids == reference_tokens(logits, params, outputs, prompts, eos), f"step {step}"


# ---- in the engine ----------------------------------------------------------------------------
CHUNKED = dict(max_num_batched_tokens=64, max_adaptive_batched_tokens=64, long_prefill_token_threshold=48)
BOOST = 100.0


def run_joining_and_leaving(engine: LLMEngine) -> None:
    """Seven greedy requests join a running batch at steps 0, 3, 6 and 7 and leave after 3 to 7 tokens; four
    carry a bias (two of them share one params object), each with +100 on a token of its own and 19 small
    biases beside it. A biased request emits only its boosted token; an unbiased one its raw argmax."""
    vocab = engine.config.vocab_size
    gen = seeded(3)
    boosted = torch.randperm(vocab, generator=gen)[:3].tolist()

    def params(max_tokens: int, boost: int | None = None) -> SamplingParams:
        bias = None
        if boost is not None:
            others = [t for t in torch.randperm(vocab, generator=gen)[:20].tolist() if t != boost][:19]
            bias = {**{t: BIASES[i % 5] for i, t in enumerate(others)}, boost: BOOST}
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, logit_bias=bias)

    shared = params(5, boosted[0])
    joins = {  # step -> (request id, prompt length, params, its boosted token or None)
        0: [("a", 20, shared, boosted[0]), ("b", 30, params(7), None), ("c", 150, params(4, boosted[1]), boosted[1])],
        3: [("d", 10, params(3), None), ("e", 12, shared, boosted[0])],
        6: [("f", 40, params(6, boosted[2]), boosted[2])],  # as d leaves: 4 rows again, other ones
        7: [("g", 5, params(4), None)],
    }
    tokens: dict[str, list[int]] = {}
    ranks: dict[str, list[int]] = {}
    step = 0
    while step <= max(joins) or engine.has_unfinished():
        for request_id, prompt_len, p, _ in joins.get(step, []):
            engine.add_request(random_prompt(gen, prompt_len), p, request_id=request_id)
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            ranks.setdefault(delta.request_id, []).extend(entry.ranks[0] for entry in delta.logprobs)
        step += 1

    for request_id, _, p, boost in (join for step_joins in joins.values() for join in step_joins):
        assert len(tokens[request_id]) == p.max_tokens, request_id
        if boost is not None:
            assert tokens[request_id] == [boost] * p.max_tokens, f"{request_id}: not its own bias"
        else:
            assert ranks[request_id] == [1] * p.max_tokens, f"{request_id}: a bias reached an unbiased row"


def test_engine_applies_each_requests_own_bias_as_requests_join_and_leave(make_llm) -> None:
    llm = make_llm(max_num_seqs=8, **CHUNKED)
    run_joining_and_leaving(llm.engine)
    assert llm.engine.sampler.logit_bias.num_uploads > 1


@pytest.mark.gpu
def test_engine_on_cuda_replaying_padded_decode_graphs_applies_each_requests_own_bias(
    k3_tiny_gpu_checkpoint: Path,
) -> None:
    llm = LLM(model=str(k3_tiny_gpu_checkpoint), device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=8,
              cache_memory_bytes=256 * 2**20, seed=0, **CHUNKED)
    graphs = llm.engine.runner.graphs
    assert graphs is not None, "bf16 on CUDA captures decode graphs"
    run_joining_and_leaving(llm.engine)
    assert graphs.num_replays > 0 and graphs.num_padding_rows > 0  # padded graph replays served decode steps
