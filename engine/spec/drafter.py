"""The model-based drafters' step (rank 0): after a step's tokens are known, the drafter reads what the step
computed and proposes K drafts for each request that will speculate.

    DraftRow   one request of the step: its positions n .. N - 1 computed this step (rows of the step's hidden
               states), its tokens (t_{n+1} .. t_N follow them; t_N, its last, is not computed yet), its blocks,
               and whether it drafts (None params: context only, e.g. a prefill chunk that is not the prompt's last)
    DraftRunner.run(rows, hidden, aux) -> {request_id: Drafts}

EAGLE and DSpark (`model/draft/`) read the target: every position the target computes passes through the drafter
once, in the step that computed it (its context rows), so the drafter's latent cache holds positions 0 .. N - 1
when it drafts. `draft_model`, an independent K3 model, reads only tokens: it runs one position ahead of the
target (t_{n+1} .. t_N at positions n + 1 .. N, its KDA slot then holds the state after N + 1 tokens), and drafts
on a copy of that slot (its scratch slot), so the rejected drafts never touch the state it keeps. A request it has
not followed up to n (a prefix-cache hit, a preempted request's recompute, a disaggregated request's first step)
is fed from token 0 again: recomputed, exactly, from the tokens alone.

The drafters' latent caches are indexed by the target's block ids (prefix-cache hits, preemption and block reuse
need nothing of their own); positions past a request's blocks (drafts beyond what the scheduler allocated) go to
scratch blocks of its KDA slot, after the target's blocks. Draft rows past N are overwritten by the next step's rows.

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
from k3serve.model.model import KimiForCausalLM

_Step = tuple[list[int], list | None]  # one draft position of the drafting rows: tokens, q rows (or None)


def scratch_blocks(num_speculative_tokens: int, block_size: int) -> int:
    """A KDA slot's scratch blocks in the drafter's cache: room for K draft rows past the request's blocks."""
    return num_speculative_tokens // block_size + 2


@dataclass(frozen=True)
class DraftRow:
    request_id: str
    num_computed: int  # n: the first position the step computed
    num_rows: int  # m: positions n .. n + m - 1 computed this step (N = n + m)
    token_ids: list[int]  # the request's tokens, prompt + outputs: t_0 .. t_N
    block_ids: list[int]
    slot_id: int
    params: SamplingParams | None  # None: context only, no drafts
    num_output_tokens: int  # the first draft's output position (keys a seeded request's draws)
    hidden_start: int = 0  # its first row in the step's hidden states (`ModelRunner.draft` fills it in)

    @property
    def end(self) -> int:
        """N: the request's computed tokens after the step."""
        return self.num_computed + self.num_rows

    @property
    def next_token_ids(self) -> list[int]:
        """The token after each computed position: t_{n+1} .. t_N."""
        return self.token_ids[self.num_computed + 1 : self.end + 1]


@dataclass(frozen=True)
class Drafts:
    token_ids: list[int]  # K drafts continuing the request's num_tokens tokens
    num_tokens: int  # the request's tokens (prompt + outputs) they continue
    probs: torch.Tensor | None = None  # [K, V] q of each draft (probabilistic drafting), None: deterministic


class DraftRunner:
    """One drafter, its cache and the drafting of a step; `aux_layer_ids`: the target layers whose outputs the step
    must keep for it (() for EAGLE, which reads the final hidden state, and for draft_model, which reads none)."""

    def __init__(self, drafter: Drafter | KimiForCausalLM, num_blocks: int, num_slots: int, block_size: int,
                 num_speculative_tokens: int, probabilistic: bool, device: torch.device | str) -> None:
        self.drafter = drafter
        self.k = num_speculative_tokens
        self.probabilistic = probabilistic
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.scratch_blocks = scratch_blocks(num_speculative_tokens, block_size)
        independent = isinstance(drafter, KimiForCausalLM)
        self.cache = ModelCache.allocate(drafter.config, num_blocks + num_slots * self.scratch_blocks,
                                         2 * num_slots if independent else 0, block_size, 1, drafter.dtype, device)
        self.device = torch.device(device)
        self.aux_layer_ids = () if independent else drafter.drafter_config.target_layer_ids
        self.num_forwards = 0  # drafter forwards run (a test's proof that drafting happened)
        self._fed: dict[str, int] = {}  # draft_model: tokens a request's slot has taken (N + 1 after a step)

    @property
    def num_tracked(self) -> int:
        """Requests the drafter keeps state for (a leak check: none once every request ended)."""
        return len(self._fed)

    def release(self, request_id: str) -> None:
        self._fed.pop(request_id, None)

    def forget(self, block_ids: list[int]) -> None:
        """Zero the drafter's rows of blocks whose target KV came from elsewhere (a disaggregated handoff): the
        drafter never saw those positions, and zeros are the same on every run, unlike a block's old rows."""
        if block_ids:
            index = torch.tensor(block_ids, device=self.device)
            for pool in self.cache.mla_kv:
                pool[index] = 0

    @torch.inference_mode()
    def run(self, rows: list[DraftRow], hidden: torch.Tensor, aux: torch.Tensor | None) -> dict[str, Drafts]:
        """Every row's context; K drafts for those with params. `hidden` [T, H]: the step's final hidden states;
        `aux` [T, L H]: its `aux_layer_ids` outputs, concatenated (dspark)."""
        if not rows:
            return {}
        if isinstance(self.drafter, DSparkDrafter):
            rows, steps = self._dspark(rows, aux)
        elif isinstance(self.drafter, EagleDrafter):
            rows, steps = self._eagle(rows, hidden)
        else:
            rows, steps = self._draft_model(rows)
        out = {}
        for i, r in enumerate(r for r in rows if r.params is not None):
            probs = None if steps[0][1] is None or steps[0][1][i] is None else torch.stack([s[1][i] for s in steps])
            out[r.request_id] = Drafts([int(s[0][i]) for s in steps], r.end + 1, probs)
        return out

    # ---- methods: each returns the rows in its batch order and the drafting rows' K steps ---------------------
    def _eagle(self, rows: list[DraftRow], hidden: torch.Tensor) -> tuple[list[DraftRow], list[_Step]]:
        d = self.drafter
        rows = sorted(rows, key=lambda r: r.num_rows > 1)  # single-row sequences first
        flat = [t for r in rows for t in r.next_token_ids]
        index = [r.hidden_start + j for r in rows for j in range(r.num_rows)]
        batch = self._batch([r.next_token_ids for r in rows], [r.num_computed for r in rows], rows)
        out = self._layer(d.inputs(self._ids(flat), hidden[self._ids(index)]), batch)
        drafting = [r for r in rows if r.params is not None]
        if not drafting:
            return rows, []
        g = out[self._ids([int(batch.cu_seqlens_host[i + 1]) - 1 for i, r in enumerate(rows) if r.params])]
        steps = [self._choose(d.logits(g), drafting, 0)]
        for j in range(1, self.k):  # position N - 1 + j: embed(d_j) and the previous row's output
            tokens = steps[-1][0]
            batch = self._batch([[t] for t in tokens], [r.end - 1 + j for r in drafting], drafting)
            g = self._layer(d.inputs(self._ids(tokens), g), batch)
            steps.append(self._choose(d.logits(g), drafting, j))
        return rows, steps

    def _dspark(self, rows: list[DraftRow], aux: torch.Tensor) -> tuple[list[DraftRow], list[_Step]]:
        d, noise = self.drafter, self.drafter.drafter_config.noise_token_id
        rows = sorted(rows, key=lambda r: r.num_rows + (self.k if r.params is not None else 0) > 1)
        seqs, ctx_at, block_at, index = [], [], [], []
        for r in rows:
            start = sum(len(s) for s in seqs)
            ctx_at += range(start, start + r.num_rows)
            index += range(r.hidden_start, r.hidden_start + r.num_rows)
            block = [r.token_ids[r.end]] + [noise] * (self.k - 1) if r.params is not None else []
            block_at += range(start + r.num_rows, start + r.num_rows + len(block))
            seqs.append(r.next_token_ids + block)
        batch = self._batch(seqs, [r.num_computed for r in rows], rows)
        x = torch.empty(batch.token_ids.shape[0], d.config.hidden_size, dtype=d.dtype, device=self.device)
        x[self._ids(ctx_at)] = d.context_inputs(aux[self._ids(index)]).to(d.dtype)
        drafting = [r for r in rows if r.params is not None]
        if drafting:
            x[self._ids(block_at)] = d.block_inputs(batch.token_ids[self._ids(block_at)]).to(d.dtype)
        out = self._layer(x, batch)
        if not drafting:
            return rows, []
        logits = d.logits(out[self._ids(block_at)]).view(len(drafting), self.k, -1)
        steps, prev = [], self._ids([r.token_ids[r.end] for r in drafting])
        for j in range(self.k):  # left to right: each row's logits, plus the Markov bias after the previous draft
            bias = d.markov_bias(prev)
            steps.append(self._choose(logits[:, j] if bias is None else logits[:, j] + bias, drafting, j))
            prev = self._ids(steps[-1][0])
        return rows, steps

    def _draft_model(self, rows: list[DraftRow]) -> tuple[list[DraftRow], list[_Step]]:
        model = self.drafter
        feeds = []  # (first position, tokens) into each row's slot
        for r in rows:
            if r.num_computed > 0 and self._fed.get(r.request_id) == r.num_computed + 1:
                feeds.append((r.num_computed + 1, r.next_token_ids))
            else:  # not followed up to here: from token 0, on a zeroed slot
                self.cache.zero_slots([r.slot_id])
                feeds.append((0, r.token_ids[: r.end + 1]))
            self._fed[r.request_id] = r.end + 1
        order = sorted(range(len(rows)), key=lambda i: len(feeds[i][1]) > 1)
        rows, feeds = [rows[i] for i in order], [feeds[i] for i in order]
        batch = self._batch([f[1] for f in feeds], [f[0] for f in feeds], rows)
        hidden = self._forward(batch, self.cache)
        drafting = [r for r in rows if r.params is not None]
        if not drafting:
            return rows, []
        last = [int(batch.cu_seqlens_host[i + 1]) - 1 for i, r in enumerate(rows) if r.params is not None]
        steps = [self._choose(model.compute_logits(hidden[self._ids(last)]), drafting, 0)]
        scratch = [self.num_slots + r.slot_id for r in drafting]
        for r, s in zip(drafting, scratch):
            self.cache.copy_slot(r.slot_id, s)
        for j in range(1, self.k):  # d_j at position N + j, on the scratch slots
            batch = self._batch([[t] for t in steps[-1][0]], [r.end + j for r in drafting], drafting, scratch)
            hidden = self._forward(batch, self.cache)
            steps.append(self._choose(model.compute_logits(hidden), drafting, j))
        return rows, steps

    # ---- pieces ------------------------------------------------------------------------------
    def _layer(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        self.num_forwards += 1
        return self.drafter.layer(x, batch, self.cache)

    def _forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        self.num_forwards += 1
        return self.drafter(batch, cache)

    def _ids(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _batch(self, token_ids: list[list[int]], num_computed: list[int], rows: list[DraftRow],
               slot_ids: list[int] | None = None) -> ForwardBatch:
        """The drafter's batch: each request's blocks, then its slot's scratch blocks."""
        tables = [r.block_ids + [self.num_blocks + r.slot_id * self.scratch_blocks + j
                                 for j in range(self.scratch_blocks)] for r in rows]
        return ForwardBatch.build(token_ids=token_ids, num_computed=num_computed, block_tables=tables,
                                  slot_ids=slot_ids or [r.slot_id for r in rows], block_size=self.block_size,
                                  device=self.device)

    def _choose(self, logits: torch.Tensor, rows: list[DraftRow], j: int) -> _Step:
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
