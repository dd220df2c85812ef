"""Turns a batch of last-position logits into next tokens, one `SamplingParams` per row.

Per row, in this order (vLLM v1's): the structured-output mask (-inf for what the row's constraint does not
allow), min_tokens (EOS and stop_token_ids -inf), logit_bias, penalties (repetition, then frequency and
presence); greedy rows take the argmax; the others temperature, top-k, top-p, min-p, then an exponential race,
argmax(p / q) with q ~ Exp(1) drawn from the row's own `torch.Generator` when it has one (a seeded row draws V
values a step and no other row touches its generator: the same seed gives the same tokens in any batch).
Logprobs are raw: log_softmax of the logits as the model produced them. The steps' order and what follows from
it: docs/design/sampler.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.engine.logit_bias import LogitBiasBatch
from k3serve.engine.outputs import TokenLogprobs
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.structured_output import TokenMask


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]  # [N]
    logprobs: list[TokenLogprobs | None]  # [N]; None for rows whose params.logprobs is None


class Sampler:
    """Per-request generators are owned by the caller. The sampler keeps the last batch's logit biases on the
    device (`engine/logit_bias.py`): one engine's steps go through one Sampler."""

    def __init__(self, eos_token_id: int | None = None):
        self.eos_token_id = eos_token_id
        self.logit_bias = LogitBiasBatch()

    def sample(
        self,
        logits: torch.Tensor,  # [N, V] fp32
        params: list[SamplingParams],  # [N]
        output_token_ids: list[list[int]],  # [N][num_output_tokens]
        prompt_token_ids: list[list[int]],  # [N][num_prompt_tokens]
        generators: list[torch.Generator | None],  # [N]; seeded rows: Generator().manual_seed(seed)
        token_mask: TokenMask | None = None,  # the constrained rows' allowed tokens; None: no row is constrained
    ) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
        num_rows = logits.shape[0]
        if not (len(params) == len(output_token_ids) == len(prompt_token_ids) == len(generators) == num_rows):
            raise ValueError(
                f"batch mismatch: logits has {num_rows} rows, got {len(params)} params, "
                f"{len(output_token_ids)} output_token_ids, {len(prompt_token_ids)} prompt_token_ids, "
                f"{len(generators)} generators"
            )
        if logits.dtype != torch.float32:
            raise ValueError(f"logits must be float32, got {logits.dtype}")
        for i, (p, g) in enumerate(zip(params, generators)):
            if p.seed is not None and g is None:
                raise ValueError(f"row {i} has seed={p.seed!r} but no generator; pass Generator().manual_seed(seed)")

        raw_logits = logits
        logits = logits.clone(memory_format=torch.contiguous_format)
        # Each step below changes its own row alone, so running a step over every row before the next one
        # gives each row what the per-row order above gives it.
        if token_mask is not None:
            token_mask.apply(logits)
        for i, p in enumerate(params):
            self._apply_min_tokens(logits[i], p, len(output_token_ids[i]))
        self.logit_bias.apply(logits, params)
        for i, p in enumerate(params):
            if p.has_penalties:
                apply_penalties(logits[i], p, prompt_token_ids[i], output_token_ids[i])

        token_ids = torch.empty(num_rows, dtype=torch.long, device=logits.device)
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=logits.device)
            token_ids[rows] = logits[rows].argmax(dim=-1)
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            probs = filtered_probs(logits[rows], [params[i] for i in random_rows])
            noise = exponential_noise(probs.shape, [generators[i] for i in random_rows], probs.device)
            token_ids[rows] = (probs / noise).argmax(dim=-1)

        sampled = token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * num_rows
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if lp_rows:
            rows = torch.tensor(lp_rows, device=logits.device)
            row_logprobs = torch.log_softmax(raw_logits[rows], dim=-1)
            gathered = gather_logprobs(
                row_logprobs, [sampled[i] for i in lp_rows], max(params[i].logprobs for i in lp_rows)
            )
            for i, entry in zip(lp_rows, gathered):
                logprobs[i] = _truncate(entry, params[i].logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _apply_min_tokens(self, row: torch.Tensor, p: SamplingParams, num_output_tokens: int) -> None:
        if num_output_tokens >= p.min_tokens:
            return
        banned = list(p.stop_token_ids)
        if self.eos_token_id is not None and not p.ignore_eos:
            banned.append(self.eos_token_id)
        if banned:
            row[torch.tensor(banned, device=row.device)] = float("-inf")


def apply_penalties(
    row: torch.Tensor,  # [V], modified in place
    p: SamplingParams,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
) -> None:
    """vLLM's definitions: for tokens seen in prompt or output, logit / r if logit > 0 else
    logit * r; then logit -= frequency * count_in_output + presence * (count_in_output > 0)."""
    vocab_size = row.shape[0]
    output_counts = torch.bincount(
        torch.tensor(output_token_ids, dtype=torch.long, device=row.device), minlength=vocab_size
    ).to(row.dtype)
    if p.repetition_penalty != 1.0:
        seen = output_counts > 0
        if prompt_token_ids:
            seen[torch.tensor(prompt_token_ids, dtype=torch.long, device=row.device)] = True
        penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, penalized, row))
    row -= p.frequency_penalty * output_counts + p.presence_penalty * (output_counts > 0).to(row.dtype)


SAMPLER_LOGITS_COPIES = 16
"""fp32 [rows, vocab] tensors alive at once, at most, while `Sampler.sample` runs: the caller's logits, the clone,
the temperature-scaled copy, the top-k/top-p sort (values and int64 indices), softmax, cumsum, masks, the scatter
back, the probabilities, the noise and their quotient (and the caller's gathered rows and their stack)."""


def sampling_workspace_bytes(num_rows: int, vocab_size: int) -> int:
    """Most bytes one `Sampler.sample` of [num_rows, vocab_size] fp32 logits holds at once, the logits included:
    `SAMPLER_LOGITS_COPIES` fp32 copies of them, whatever the rows' sampling params."""
    return SAMPLER_LOGITS_COPIES * num_rows * vocab_size * 4


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[M, V] logits -> [M, V] probabilities after temperature, top-k, top-p and min-p."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    logits = logits / temperature[:, None]
    vocab_size = logits.shape[-1]

    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        top_k = torch.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], device=device)
        kth_value = sorted_logits.gather(1, (top_k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # exclusive: the first token is always kept
        drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)

    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=device)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def exponential_noise(
    shape: torch.Size, generators: list[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """[M, V] i.i.d. Exp(1) noise q for the exponential race argmax(p / q), a categorical draw.

    Row j comes from generators[j] alone when it has one: drawn on the generator's device (a
    CPU generator serves CUDA logits too), always V values, so a seeded generator advances the
    same way in every batch. Rows without a generator share one draw from torch's global RNG.
    """
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty((len(unseeded), shape[-1]), device=device).exponential_()
    for j, g in enumerate(generators):
        if g is not None:
            noise[j] = torch.empty(shape[-1], device=g.device).exponential_(generator=g).to(device)
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)  # q = 0 would make p / q undefined


def gather_logprobs(logprobs: torch.Tensor, chosen_token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """[M, V] logprobs -> per row: the chosen token's logprob and rank, then the top `num_top`."""
    chosen = torch.tensor(chosen_token_ids, dtype=torch.long, device=logprobs.device)
    chosen_lp = logprobs.gather(1, chosen[:, None])  # [M, 1]
    chosen_rank = _count_above(logprobs, chosen_lp) + 1  # [M]
    num_top = min(num_top, logprobs.shape[-1])
    top_lp, top_ids = logprobs.topk(num_top, dim=-1)  # [M, num_top], sorted
    ranks = list(range(1, num_top + 1))
    # One device-to-host copy a tensor, not one a row.
    rows = zip(chosen_token_ids, chosen_lp[:, 0].tolist(), chosen_rank.tolist(), top_ids.tolist(), top_lp.tolist())
    return [
        TokenLogprobs(token_ids=[tid] + ids, logprobs=[lp] + lps, ranks=[rank] + ranks)
        for tid, lp, rank, ids, lps in rows
    ]


RANK_ROWS = 32
"""Rows whose ranks `_count_above` counts at once. Summing a bool mask first copies it to int64 (torch reduces in
the output's dtype): 9 bytes a logit, 0.7 GB for a 256-row slice at K3's vocab where the log-softmax itself is 160
MiB. 32 rows bound that to 47 MiB."""


def _count_above(logprobs: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """[M] int64: how many entries of each row of `logprobs` [M, V] exceed that row's `thresholds` [M, 1],
    `RANK_ROWS` rows at a time (the mask and its int64 copy are the temporaries)."""
    counts = torch.empty(logprobs.shape[0], dtype=torch.long, device=logprobs.device)
    for lo in range(0, logprobs.shape[0], RANK_ROWS):
        hi = lo + RANK_ROWS
        torch.sum(logprobs[lo:hi] > thresholds[lo:hi], dim=-1, out=counts[lo:hi])
    return counts


PROMPT_LOGPROBS_ROWS = 256
"""Prompt positions scored at once (`engine/runner.py` runs the lm_head a slice at a time). A whole 32K-token
chunk at K3's vocab (163840) would be 21 GB of fp32 logits on rank 0; a slice of 256 rows is 160 MiB of them, and
with everything else the slice makes (`engine/memory.py` `prompt_logprobs_slice_bytes`: the bf16 shards and their
gather, the log-softmax, the rank mask) about 0.5 GiB at K3 TP8. 256 rows still fill the lm_head GEMM's tiles
(a 32K chunk is 128 GEMMs and gathers, where a prompt asks for prompt logprobs at all)."""


@dataclass(frozen=True)
class PromptScoring:
    """What one prefill chunk's prompt logprobs need (engine -> runner, and on to the TP followers): its first
    len(target_token_ids) rows score these prompt tokens, row i the token after row i's position."""

    target_token_ids: list[int]  # [rows scored]: prompt[p + 1 : p + num_scheduled_tokens + 1] of a chunk at p
    num_top: int  # the request's prompt_logprobs


def prompt_logprobs(logits: torch.Tensor, target_token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """Logprobs of prompt tokens given the tokens before them (vLLM's `prompt_logprobs`), for a slice of a
    prompt's positions: `logits[i]` [rows, V] is the model output at a prompt position, which scores the prompt
    token after it, `target_token_ids[i]`. Per row, as `gather_logprobs`: that token's logprob and rank, then the
    top `num_top`. Raw logprobs, as above. Row-wise: scoring a prompt a slice at a time gives what one call over
    all its rows' logits gives."""
    if logits.dim() != 2 or logits.shape[0] != len(target_token_ids):
        raise ValueError(
            f"logits must be [rows, V] with one row per target token ({len(target_token_ids)}), "
            f"got shape {tuple(logits.shape)}"
        )
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), target_token_ids, num_top)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """Raw logprobs of the tokens emitted from the rows of `logits` [M, V] fp32, row i's token_ids[i], with the top
    `num_top`: what `Sampler.sample` reports for a row (a verify row's tokens each take their own row's)."""
    gathered = gather_logprobs(torch.log_softmax(logits, dim=-1), token_ids, num_top)
    return [_truncate(entry, num_top) for entry in gathered]


def _truncate(entry: TokenLogprobs, num_top: int) -> TokenLogprobs:
    keep = 1 + num_top
    return TokenLogprobs(entry.token_ids[:keep], entry.logprobs[:keep], entry.ranks[:keep])
