"""What one forward pass needs: the packed token batch and the per-rank cache tensors.

The engine builds a `ForwardBatch` once per step from plain lists; layers read what they need
from it and never recompute positions or slot mappings. Sequences are packed back to back:

    token_ids    | seq0 (decode, 1) | seq1 (decode, 1) | seq2 (prefill chunk ...........) |
    cu_seqlens   0                  1                  2                                  T
    positions    n0                 n1                 n2, n2+1, ...      (n = num_computed)

Single-token sequences come first (`num_decode`), then a speculative step's verify rows (`num_spec`
sequences of 1 + k tokens: the last token and its drafts), then prefill chunks: [decodes | spec rows |
prefills]. The decode path (absorbed MLA, recurrent KDA step), the verify path (multi-row absorbed MLA,
KDA read-only with records for the RecoverSSM commit) and the prefill path (MHA form, chunked KDA) each get a
contiguous slice. Without spec rows a KDA layer runs decodes and prefills together as before.

`StaticDecodeInputs` is the fixed-shape form of a decode-only batch (CUDA graphs): tensors at fixed
addresses, the batch padded to a bucket size with rows that write nowhere a request owns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3serve.kernels.kda import ChunkPlan, KdaRecords, plan_chunks


@dataclass
class ModelCache:
    """The per-rank cache tensors. Pools are indexed by block id (MLA) and slot id (KDA)."""

    mla_kv: list[torch.Tensor]  # per MLA layer [num_blocks, block_size, kv_lora_rank + rope_dim]
    kda_recurrent: list[torch.Tensor]  # per KDA layer [num_slots, H_local, K, V] fp32
    kda_conv: list[torch.Tensor]  # per KDA layer [num_slots, 3 * H_local * K, kernel - 1]
    block_size: int  # tokens a rank's block holds (the MLA tensors' second dimension)
    pad_slot: int | None = None  # a KDA slot no request owns: padding rows of fixed-shape batches use it
    dcp_size: int = 1  # DCP ranks a block id spans: rank r of a group holds page r (`kernels/mla/dcp.py`)

    @property
    def tokens_per_block(self) -> int:
        """Tokens one block id of the scheduler's tables holds, over the DCP group's ranks."""
        return self.block_size * self.dcp_size

    @classmethod
    def allocate(
        cls,
        config,  # ModelConfig
        num_blocks: int,
        num_slots: int,
        block_size: int,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        reserve_pad_slot: bool = False,
        dcp_size: int = 1,
    ) -> "ModelCache":
        """`reserve_pad_slot` adds one KDA slot after the `num_slots` the state pool hands out, for the
        padding rows of fixed-shape decode batches (`StaticDecodeInputs`)."""
        h_local = config.kda.num_heads // tp_size
        d = config.kda.head_dim
        pad_slot = num_slots if reserve_pad_slot else None
        num_slots += int(reserve_pad_slot)
        return cls(
            mla_kv=[
                torch.zeros(num_blocks, block_size, config.mla_kv_dim, dtype=dtype, device=device)
                for _ in config.mla_layers
            ],
            kda_recurrent=[
                torch.zeros(num_slots, h_local, d, d, dtype=torch.float32, device=device)
                for _ in config.kda_layers
            ],
            kda_conv=[
                torch.zeros(num_slots, 3 * h_local * d, config.kda.conv_kernel_size - 1, dtype=dtype, device=device)
                for _ in config.kda_layers
            ],
            block_size=block_size,
            pad_slot=pad_slot,
            dcp_size=dcp_size,
        )

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one request's whole KDA state (every layer, recurrent + conv) to another slot."""
        for pool in self.kda_recurrent + self.kda_conv:
            pool[dst].copy_(pool[src])

    def zero_slots(self, slots: list[int]) -> None:
        """Zero whole KDA states (every layer, recurrent + conv) of `slots`: one multi-tensor op over
        all of them (a few fused launches on CUDA), not one per layer or per slot."""
        if slots:
            torch._foreach_zero_([pool[slot] for pool in self.kda_recurrent + self.kda_conv for slot in slots])


@dataclass(frozen=True)
class VerifyRecords:
    """One KDA layer's records of a step's verify rows, for the commit after rejection (one step's life). Each
    tensor owns its storage: a view would keep the layer's whole projection output alive until the commit."""

    kda: KdaRecords
    conv_inputs: torch.Tensor  # [T_spec, 3P] the pre-conv q, k, v inputs


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    cu_seqlens: torch.Tensor  # [N+1] int64, offsets of each sequence's new tokens
    num_computed: torch.Tensor  # [N] int64, tokens already in the cache before this step
    seq_lens: torch.Tensor  # [N] int64, num_computed + new tokens
    block_tables: torch.Tensor  # [N, max_blocks] int32; entries past a sequence's blocks are never read (-1 here)
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset for each new token
    slot_ids: torch.Tensor  # [N] int64, KDA state slot of each sequence
    checkpoint_offsets: torch.Tensor | None  # [N] int64, new tokens after which to checkpoint KDA, -1 none
    checkpoint_slot_ids: torch.Tensor | None  # [N] int64, slot receiving that checkpoint, -1 none
    num_decode: int  # leading sequences with exactly one new token
    pad_slot: int | None = None  # slot of padding rows (may repeat in slot_ids; their outputs are ignored)
    # Host (CPU) copies of the index tensors, for the prefill work that reads indices on the host (the
    # KDA chunk plan, which the short conv's token blocks follow too; the conv window at a checkpoint):
    # reading the device tensors there would sync once per layer. `build` sets them; a decode-only batch needs none.
    cu_seqlens_host: torch.Tensor | None = None  # [N+1] int64
    seq_lens_host: torch.Tensor | None = None  # [N] int64 (MLA prefill gathers the cached prefix by it)
    slot_ids_host: torch.Tensor | None = None  # [N] int64
    checkpoint_offsets_host: torch.Tensor | None = None  # [N] int64
    checkpoint_slot_ids_host: torch.Tensor | None = None  # [N] int64
    checkpoint_rows: torch.Tensor | None = None  # [W] int64 on the device: the sequences with an offset >= 0
    num_spec: int = 0  # verify sequences right after the decodes (1 + k tokens each; host copies set)
    num_spec_tokens: int = 0  # their rows
    verify_records: list[VerifyRecords] = field(default_factory=list)  # one a KDA layer, in order: the verify pass
    # A model-based drafter's conditioning: the outputs of these layers (0-based), kept by the forward
    aux_layer_ids: tuple[int, ...] = ()
    aux_hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, hidden]
    _kda_plan: ChunkPlan | None = field(default=None, init=False, repr=False, compare=False)
    _parts: dict[tuple[int, int], "ForwardBatch"] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        decode_only = self.num_decode == self.num_seqs and self.checkpoint_offsets is None
        if not decode_only and any(t is None for t in (self.cu_seqlens_host, self.seq_lens_host, self.slot_ids_host)):
            raise ValueError("a batch with prefill rows or checkpoints needs the host copies of its indices "
                             "(ForwardBatch.build makes them)")
        if (self.checkpoint_offsets is not None) != (self.checkpoint_offsets_host is not None
                                                    and self.checkpoint_slot_ids_host is not None
                                                    and self.checkpoint_rows is not None):
            raise ValueError("checkpoint_offsets come with their host copies and checkpoint_rows "
                             "(ForwardBatch.build makes them)")

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def num_decode_tokens(self) -> int:
        """Rows of the decode sequences, first in the batch: one token each."""
        return self.num_decode

    @property
    def prefill_start(self) -> int:
        """The first prefill sequence (after the decodes and the verify rows)."""
        return self.num_decode + self.num_spec

    @property
    def prefill_token_start(self) -> int:
        return self.num_decode + self.num_spec_tokens

    def spec_spans(self) -> tuple[list[int], list[int]]:
        """The verify sequences' (cu_seqlens from 0 [num_spec + 1], KDA slots [num_spec]) as host lists."""
        a, b = self.num_decode, self.prefill_start
        cu = (self.cu_seqlens_host[a : b + 1] - self.num_decode).tolist()
        return cu, self.slot_ids_host[a:b].tolist()

    def part(self, lo: int, hi: int) -> "ForwardBatch":
        """Sequences lo..hi-1 (all decodes, or all prefills) as a batch of their own, of views where it can be
        (its cu_seqlens rebased), made once a forward: every layer that asks gets the same one (and its plan)."""
        key = (lo, hi)
        if key not in self._parts:
            t0, t1 = int(self.cu_seqlens_host[lo]), int(self.cu_seqlens_host[hi])
            num_decode = min(self.num_decode, hi) - min(self.num_decode, lo)
            if num_decode not in (0, hi - lo) or (lo < self.prefill_start and hi > self.num_decode):
                raise ValueError(f"part({lo}, {hi}) must be decodes alone or prefills alone")
            ck = self.checkpoint_offsets_host
            host_offsets = None if ck is None else ck[lo:hi]
            has_ck = host_offsets is not None and bool((host_offsets >= 0).any())
            self._parts[key] = ForwardBatch(
                token_ids=self.token_ids[t0:t1], positions=self.positions[t0:t1],
                cu_seqlens=self.cu_seqlens[lo : hi + 1] - t0, num_computed=self.num_computed[lo:hi],
                seq_lens=self.seq_lens[lo:hi], block_tables=self.block_tables[lo:hi],
                slot_mapping=self.slot_mapping[t0:t1], slot_ids=self.slot_ids[lo:hi],
                checkpoint_offsets=self.checkpoint_offsets[lo:hi] if has_ck else None,
                checkpoint_slot_ids=self.checkpoint_slot_ids[lo:hi] if has_ck else None,
                num_decode=num_decode, pad_slot=self.pad_slot,
                cu_seqlens_host=self.cu_seqlens_host[lo : hi + 1] - t0, seq_lens_host=self.seq_lens_host[lo:hi],
                slot_ids_host=self.slot_ids_host[lo:hi],
                checkpoint_offsets_host=host_offsets if has_ck else None,
                checkpoint_slot_ids_host=self.checkpoint_slot_ids_host[lo:hi] if has_ck else None,
                checkpoint_rows=torch.nonzero(host_offsets >= 0).flatten().to(self.cu_seqlens.device)
                if has_ck else None,
            )
        return self._parts[key]

    def kda_chunk_plan(self, chunk_size: int) -> ChunkPlan:
        """The chunk plan of this batch's chunked KDA, on the batch's device: it depends on the batch
        alone, so the first KDA layer builds it (from host lists, one asynchronous copy) and every
        later layer of the forward reuses it."""
        if self._kda_plan is None or self._kda_plan.chunk_size != chunk_size:
            cu = self.cu_seqlens_host.tolist()
            offsets = None if self.checkpoint_offsets_host is None else self.checkpoint_offsets_host.tolist()
            self._kda_plan = plan_chunks([b - a for a, b in zip(cu[:-1], cu[1:])], True, offsets, chunk_size,
                                         self.cu_seqlens.device)
        return self._kda_plan

    @classmethod
    def build(
        cls,
        token_ids: list[list[int]],
        num_computed: list[int],
        block_tables: list[list[int]],
        slot_ids: list[int],
        block_size: int,
        checkpoint_offsets: list[int] | None = None,
        checkpoint_slot_ids: list[int] | None = None,
        device: torch.device | str = "cpu",
        num_spec: int = 0,
    ) -> "ForwardBatch":
        """Pack per-sequence lists into one batch. Single-token sequences must come first, then `num_spec`
        verify sequences (2 or more tokens each, no checkpoint), then the prefill chunks.

        The KDA slot of a sequence starting at num_computed 0 must hold zeros: the caller zeroes it
        (the runner does, for every fresh sequence of a step at once)."""
        n = len(token_ids)
        if not (len(num_computed) == len(block_tables) == len(slot_ids) == n):
            raise ValueError("token_ids, num_computed, block_tables and slot_ids must have one entry per sequence")
        lens = [len(t) for t in token_ids]
        if any(q == 0 for q in lens):
            raise ValueError("every sequence in a batch needs at least one new token")
        num_decode = 0
        while num_decode < n and lens[num_decode] == 1:
            num_decode += 1
        if any(q == 1 for q in lens[num_decode:]):
            raise ValueError("single-token sequences must be packed before multi-token ones")
        spec = range(num_decode, num_decode + num_spec)
        if num_decode + num_spec > n or (checkpoint_offsets is not None and any(checkpoint_offsets[i] >= 0 for i in spec)):
            raise ValueError(f"{num_spec} verify sequences after {num_decode} decodes of {n}: too many, or one "
                             "with a checkpoint")
        cu = [0]
        for q in lens:
            cu.append(cu[-1] + q)
        positions, slot_mapping = [], []
        for tokens, start, table in zip(token_ids, num_computed, block_tables):
            for pos in range(start, start + len(tokens)):
                if pos // block_size >= len(table):
                    raise ValueError(f"block table of {len(table)} blocks cannot hold position {pos}")
                positions.append(pos)
                slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        tables = torch.full((n, max(max_blocks, 1)), -1, dtype=torch.int32)
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)

        def tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        seq_lens = [c + q for c, q in zip(num_computed, lens)]
        host = {"cu_seqlens_host": torch.tensor(cu), "seq_lens_host": torch.tensor(seq_lens),
                "slot_ids_host": torch.tensor(slot_ids, dtype=torch.int64)}
        if checkpoint_offsets is not None:
            if checkpoint_slot_ids is None or len(checkpoint_offsets) != n or len(checkpoint_slot_ids) != n:
                raise ValueError("checkpoint_offsets and checkpoint_slot_ids need one entry per sequence")
            host["checkpoint_offsets_host"] = torch.tensor(checkpoint_offsets, dtype=torch.int64)
            host["checkpoint_slot_ids_host"] = torch.tensor(checkpoint_slot_ids, dtype=torch.int64)
            host["checkpoint_rows"] = tensor([i for i, off in enumerate(checkpoint_offsets) if off >= 0])
        return cls(
            token_ids=tensor([t for seq in token_ids for t in seq]),
            positions=tensor(positions),
            cu_seqlens=tensor(cu),
            num_computed=tensor(num_computed),
            seq_lens=tensor(seq_lens),
            block_tables=tables.to(device),
            slot_mapping=tensor(slot_mapping),
            slot_ids=tensor(slot_ids),
            checkpoint_offsets=None if checkpoint_offsets is None else tensor(checkpoint_offsets),
            checkpoint_slot_ids=None if checkpoint_slot_ids is None else tensor(checkpoint_slot_ids),
            num_decode=num_decode,
            num_spec=num_spec,
            num_spec_tokens=sum(lens[i] for i in spec),
            **host,
        )


class StaticDecodeInputs:
    """A decode-only batch at fixed addresses, for up to `max_seqs` rows: what a captured CUDA graph reads.

    Every real row is one new token continuing a cached context (num_computed > 0, no checkpoint).
    `load` pads the batch to `num_rows` with rows that read no cache (seq_len 0), write no MLA row
    (slot_mapping -1) and run their KDA step on the cache's `pad_slot`, a slot no request owns: their
    outputs are garbage to be ignored, and no request's blocks or slots are touched by them.

    Block tables are [max_seqs, max_blocks] with max_blocks = ceil(max_model_len / block_size): the MLA
    decode kernel sizes its grid from that width, not from the batch's longest context, so every shape
    depends on `num_rows` alone. Entries past a row's used blocks are stale (never read).

    A step uploads only what changed, in ONE host-to-device copy (vLLM v1 keeps a host mirror of its block
    table too): the per-row values, which change every step, and the block-table entries the device does
    not hold yet. `_on_device[i]` mirrors the leading entries of device row i; a row that continues the
    same sequence costs nothing, or one entry when its context opens a block, and any other table (a
    sequence joined, left, was swapped in or preempted and re-admitted) rewrites its row. The host side is
    one buffer (pinned on CUDA, so the copy is asynchronous) laid out as the device buffer:

        | ... free ... | changed flat indices [k] | their block ids [k] | rows [max_seqs, 5] |

    and the copy spans the changed entries and the first `num_rows` rows; the block ids are then scattered
    into the table on the device. The rows part of the device buffer is what the graph reads.
    """

    _FIELDS = 5  # token_id, num_computed, seq_len, slot_mapping, slot_id

    def __init__(self, max_seqs: int, max_blocks: int, block_size: int, pad_slot: int,
                 device: torch.device | str) -> None:
        self.max_seqs, self.max_blocks, self.block_size, self.pad_slot = max_seqs, max_blocks, block_size, pad_slot
        self.device = torch.device(device)
        self._pad_row = (0, 0, 0, -1, pad_slot)
        self._rows_at = 2 * max_seqs * max_blocks  # room for every row rewritten in one step
        size = self._rows_at + max_seqs * self._FIELDS
        pinned = self.device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self._host_view = self._host.numpy()
        self._device_buffer = torch.zeros(size, dtype=torch.int64, device=self.device)
        self._rows = self._device_buffer[self._rows_at:].view(max_seqs, self._FIELDS)
        self._rows.copy_(torch.tensor([self._pad_row] * max_seqs, dtype=torch.int64))
        self.block_tables = torch.full((max_seqs, max_blocks), -1, dtype=torch.int32, device=self.device)
        self._on_device: list[list[int]] = [[] for _ in range(max_seqs)]
        self._cu_seqlens = torch.arange(max_seqs + 1, dtype=torch.int64, device=self.device)
        # The pinned buffer is rewritten each step: the previous copy out of it must have finished first.
        self._uploaded = torch.cuda.Event() if pinned else None
        self.table_entries_uploaded = 0  # by the last `load`: the block-table part of its copy

    @property
    def device_bytes(self) -> int:
        """What these inputs hold on their device (the memory plan counts it; built on "meta" it allocates
        nothing there)."""
        return sum(t.nbytes for t in (self._device_buffer, self.block_tables, self._cu_seqlens))

    def load(self, token_ids: list[int], num_computed: list[int], block_tables: list[list[int]],
             slot_ids: list[int], num_rows: int) -> None:
        """Rows 0..n-1 from the lists (one token per sequence), rows n..num_rows-1 padding."""
        n = len(token_ids)
        if not (len(num_computed) == len(block_tables) == len(slot_ids) == n):
            raise ValueError("token_ids, num_computed, block_tables and slot_ids must have one entry per sequence")
        if not n <= num_rows <= self.max_seqs:
            raise ValueError(f"{n} sequences padded to {num_rows} rows: need n <= num_rows <= {self.max_seqs}")
        bs = self.block_size
        for start, table in zip(num_computed, block_tables):  # all rows first: a refused step changes no mirror
            if start < 1 or start // bs >= len(table) or len(table) > self.max_blocks:
                raise ValueError(f"a static decode row continues a cached context within {self.max_blocks} blocks; "
                                 f"got num_computed={start} with a table of {len(table)} blocks")
        rows: list[int] = []
        indices: list[int] = []
        block_ids: list[int] = []
        for i, (token, start, table, slot) in enumerate(zip(token_ids, num_computed, block_tables, slot_ids)):
            rows += (token, start, start + 1, table[start // bs] * bs + start % bs, slot)
            held = self._on_device[i]
            if table == held:
                continue
            if len(table) == len(held) + 1 and table[:-1] == held:  # the same sequence opened a block
                first = len(held)
                held.append(table[-1])
            else:
                first = 0
                self._on_device[i] = list(table)  # a copy: the caller's list may grow in place
            indices += range(i * self.max_blocks + first, i * self.max_blocks + len(table))
            block_ids += table[first:]
        rows += self._pad_row * (num_rows - n)

        if self._uploaded is not None:
            self._uploaded.synchronize()  # done already unless the caller queued steps without reading results
        k = len(indices)
        first_word, end_word = self._rows_at - 2 * k, self._rows_at + num_rows * self._FIELDS
        self._host_view[first_word:end_word] = indices + block_ids + rows
        self._device_buffer[first_word:end_word].copy_(self._host[first_word:end_word], non_blocking=True)
        if k:
            uploaded = self._device_buffer[first_word:self._rows_at]
            self.block_tables.view(-1).index_copy_(0, uploaded[:k], uploaded[k:].to(torch.int32))
        if self._uploaded is not None:
            self._uploaded.record(torch.cuda.current_stream(self.device))  # the copy's stream: the device's own
        self.table_entries_uploaded = k

    def batch(self, num_rows: int) -> ForwardBatch:
        """The first `num_rows` rows as a decode batch; device work only (it runs inside the graph)."""
        token_ids, num_computed, seq_lens, slot_mapping, slot_ids = self._rows[:num_rows].t().contiguous().unbind()
        return ForwardBatch(
            token_ids=token_ids,
            positions=num_computed,  # one token per row: its position is the cached length
            cu_seqlens=self._cu_seqlens[: num_rows + 1],
            num_computed=num_computed,
            seq_lens=seq_lens,
            block_tables=self.block_tables[:num_rows],
            slot_mapping=slot_mapping,
            slot_ids=slot_ids,
            checkpoint_offsets=None,
            checkpoint_slot_ids=None,
            num_decode=num_rows,
            pad_slot=self.pad_slot,
        )
