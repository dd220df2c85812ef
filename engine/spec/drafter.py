"""The model-based drafters' step (rank 0): after a step's tokens are known, the drafter reads the target's
hidden states of the positions that step computed and proposes K drafts for each request that will speculate.

    DraftRow   one request of the step: its computed positions n .. N - 1 (rows of the step's hidden states),
               the token after each (t_{n+1} .. t_N, t_N its last, not yet computed), its blocks, and whether
               it drafts (None params: context only, e.g. a prefill chunk that is not the prompt's last)
    DraftRunner.run(rows, hidden, aux) -> {request_id: Drafts}

Every position the target computes passes through the drafter once, in the step that computed it (its context
rows), so the drafter's latent cache holds positions 0 .. N - 1 when it drafts. That cache is one MLA pool
indexed by the target's block ids (prefix-cache hits, preemption and block reuse need nothing of their own);
positions past a request's blocks (drafts beyond what the scheduler allocated) go to scratch blocks of its KDA
slot, after the target's blocks. Draft rows past N are overwritten by the next step's context rows.

Drafts are chosen greedily (argmax), or with `draft_sample_method: probabilistic` drawn from q, the drafter's
`filtered_probs` under the request's sampling parameters (a greedy request always takes the argmax); the q rows
go with the drafts to the rejection sampler. Engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.engine.sampler import filtered_probs
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.spec.rejection import sample_draft
from k3serve.model.batch import ForwardBatch, ModelCache
from k3serve.model.draft.base import Drafter
from k3serve.model.draft.dspark import DSparkDrafter
from k3serve.model.draft.eagle import EagleDrafter


def scratch_blocks(num_speculative_tokens: int, block_size: int) -> int:
    """A KDA slot's scratch blocks in the drafter's cache: room for K draft rows past the request's blocks."""
    return num_speculative_tokens // block_size + 2


@dataclass(frozen=True)
class DraftRow:
    request_id: str
    num_computed: int  # n: the first position the step computed
    hidden_start: int  # its row in the step's hidden states; rows hidden_start .. + len(next_token_ids)
    next_token_ids: list[int]  # the token after each computed position: t_{n+1} .. t_N
    block_ids: list[int]
    slot_id: int
    params: SamplingParams | None  # None: context only, no drafts
    num_output_tokens: int  # the first draft's output position (keys a seeded request's draws)

    @property
    def end(self) -> int:
        """N: the request's computed tokens after the step."""
        return self.num_computed + len(self.next_token_ids)


@dataclass(frozen=True)
class Drafts:
    token_ids: list[int]  # K drafts continuing the request's num_tokens tokens
    num_tokens: int  # the request's tokens (prompt + outputs) they continue
    probs: torch.Tensor | None = None  # [K, V] q of each draft (probabilistic drafting), None: deterministic


class DraftRunner:
    """One drafter, its latent cache and the drafting of a step; `aux_layer_ids`: the target layers whose outputs
    the step must keep for it (() for EAGLE: the final hidden state)."""

    def __init__(self, drafter: Drafter, num_blocks: int, num_slots: int, block_size: int,
                 num_speculative_tokens: int, probabilistic: bool, device: torch.device | str) -> None:
        self.drafter = drafter
        self.k = num_speculative_tokens
        self.probabilistic = probabilistic
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_blocks = scratch_blocks(num_speculative_tokens, block_size)
        self.cache = ModelCache.allocate(drafter.config, num_blocks + num_slots * self.scratch_blocks, 0,
                                         block_size, 1, drafter.dtype, device)
        self.device = torch.device(device)
        self.aux_layer_ids = drafter.drafter_config.target_layer_ids

    def forget(self, block_ids: list[int]) -> None:
        """Zero the drafter's rows of blocks whose target KV came from elsewhere (a disaggregated handoff): the
        drafter never saw those positions, and zeros are the same on every run, unlike a block's old rows."""
        if block_ids:
            self.cache.mla_kv[0][torch.tensor(block_ids, device=self.device)] = 0

    @torch.inference_mode()
    def run(self, rows: list[DraftRow], hidden: torch.Tensor, aux: torch.Tensor | None) -> dict[str, Drafts]:
        """Context rows of every row; K drafts for those with params. `hidden` [T, H]: the step's final hidden
        states; `aux` [T, L H]: its `aux_layer_ids` outputs, concatenated (dspark)."""
        rows = sorted(rows, key=lambda r: len(r.next_token_ids) + (self.k if self._blocks(r) else 0) > 1)
        if not rows:
            return {}
        if isinstance(self.drafter, DSparkDrafter):
            tokens = self._dspark(rows, aux)
        elif isinstance(self.drafter, EagleDrafter):
            tokens = self._eagle(rows, hidden)
        else:
            raise TypeError(f"no drafting for {type(self.drafter).__name__}")
        drafting = [r for r in rows if r.params is not None]
        out = {}
        for i, r in enumerate(drafting):
            ids = [int(step[0][i]) for step in tokens]
            probs = None if tokens[0][1] is None or tokens[0][1][i] is None else torch.stack(
                [step[1][i] for step in tokens])
            out[r.request_id] = Drafts(ids, r.end + 1, probs)
        return out

    # ---- methods -----------------------------------------------------------------------------
    def _eagle(self, rows: list[DraftRow], hidden: torch.Tensor) -> list[tuple[list[int], list | None]]:
        d = self.drafter
        flat = [t for r in rows for t in r.next_token_ids]
        index = [r.hidden_start + j for r in rows for j in range(len(r.next_token_ids))]
        x = d.inputs(self._ids(flat), hidden[self._ids(index)])
        batch = self._batch([r.next_token_ids for r in rows], [r.num_computed for r in rows], rows)
        out = d.layer(x, batch, self.cache)
        drafting = [r for r in rows if r.params is not None]
        last = [int(batch.cu_seqlens_host[i + 1]) - 1 for i, r in enumerate(rows) if r.params is not None]
        if not drafting:
            return []
        g = out[self._ids(last)]
        steps = [self._choose(d.logits(g), drafting, 0)]
        for j in range(1, self.k):
            tokens = steps[-1][0]
            x = d.inputs(self._ids(tokens), g)
            batch = self._batch([[t] for t in tokens], [r.end - 1 + j for r in drafting], drafting)
            g = d.layer(x, batch, self.cache)
            steps.append(self._choose(d.logits(g), drafting, j))
        return steps

    def _dspark(self, rows: list[DraftRow], aux: torch.Tensor) -> list[tuple[list[int], list | None]]:
        d, noise = self.drafter, self.drafter.drafter_config.noise_token_id
        seqs, ctx_at, block_at, index = [], [], [], []
        for r in rows:
            m = len(r.next_token_ids)
            start = sum(len(s) for s in seqs)
            ctx_at += range(start, start + m)
            index += range(r.hidden_start, r.hidden_start + m)
            block = [r.next_token_ids[-1]] + [noise] * (self.k - 1) if r.params is not None else []
            block_at += range(start + m, start + m + len(block))
            seqs.append(r.next_token_ids + block)
        batch = self._batch(seqs, [r.num_computed for r in rows], rows)
        x = torch.empty(batch.token_ids.shape[0], d.config.hidden_size, dtype=d.dtype, device=self.device)
        x[self._ids(ctx_at)] = d.context_inputs(aux[self._ids(index)]).to(d.dtype)
        drafting = [r for r in rows if r.params is not None]
        if not drafting:
            d.layer(x, batch, self.cache)
            return []
        x[self._ids(block_at)] = d.block_inputs(batch.token_ids[self._ids(block_at)]).to(d.dtype)
        out = d.layer(x, batch, self.cache)
        logits = d.logits(out[self._ids(block_at)]).view(len(drafting), self.k, -1)
        return [self._choose(logits[:, j], drafting, j) for j in range(self.k)]

    # ---- pieces ------------------------------------------------------------------------------
    def _blocks(self, row: DraftRow) -> bool:
        return row.params is not None and isinstance(self.drafter, DSparkDrafter)

    def _ids(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _batch(self, token_ids: list[list[int]], num_computed: list[int], rows: list[DraftRow]) -> ForwardBatch:
        """The drafter's batch: each request's blocks, then its slot's scratch blocks."""
        tables = [r.block_ids + [self.num_blocks + r.slot_id * self.scratch_blocks + j
                                 for j in range(self.scratch_blocks)] for r in rows]
        return ForwardBatch.build(token_ids=token_ids, num_computed=num_computed, block_tables=tables,
                                  slot_ids=[r.slot_id for r in rows], block_size=self.block_size, device=self.device)

    def _choose(self, logits: torch.Tensor, rows: list[DraftRow], j: int) -> tuple[list[int], list | None]:
        """Draft j of each row from its logits [R, V]: the argmax, or drawn from q (probabilistic, not greedy)."""
        greedy = logits.argmax(dim=-1).tolist()
        if not self.probabilistic:
            return greedy, None
        tokens, probs = [], []
        for i, r in enumerate(rows):
            if r.params.is_greedy:
                tokens.append(greedy[i])
                probs.append(None)
                continue
            q = filtered_probs(logits[i : i + 1].float(), [r.params])
            tokens.append(sample_draft(q, r.params.seed, r.num_output_tokens + j))
            probs.append(q[0])
        return tokens, probs
