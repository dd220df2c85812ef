"""`StaticDecodeInputs` keeps a host mirror of the device block table and uploads only what changed.

A seeded run of decode steps in which sequences join, leave, are preempted and re-admitted with other
blocks, swap rows and open blocks (their table lists grow in place, as the scheduler's do): after every
`load` the device holds what a from-scratch `ForwardBatch.build` of the same step holds (every row value,
each row's block-table entries), and the block-table part of the copy is only the entries that changed.
"""

from __future__ import annotations

import random

import pytest

from k3serve.model.batch import ForwardBatch, StaticDecodeInputs

BLOCK, MAX_BLOCKS, MAX_SEQS, PAD_SLOT = 4, 12, 8, 99
BUCKETS = (1, 2, 4, 8)


class Sequences:
    """Running decode sequences and the free blocks of a small pool, changed the ways a scheduler changes them."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.free = list(range(200))
        rng.shuffle(self.free)
        self.running: dict[str, dict] = {}
        self.names = (f"r{i}" for i in range(10**6))

    def admit(self, name: str) -> None:
        context = self.rng.randrange(1, (MAX_BLOCKS - 2) * BLOCK)
        table = [self.free.pop() for _ in range(context // BLOCK + 1)]
        self.running[name] = {"table": table, "context": context, "slot": self.rng.randrange(64)}

    def release(self, name: str) -> None:
        self.free[:0] = self.running.pop(name)["table"]

    def advance(self) -> None:
        """Each sequence's token is now cached; one opening a block appends to its list in place."""
        for name, seq in list(self.running.items()):
            seq["context"] += 1
            if seq["context"] // BLOCK >= MAX_BLOCKS:
                self.release(name)
            elif seq["context"] // BLOCK >= len(seq["table"]):
                seq["table"].append(self.free.pop())

    def churn(self) -> None:
        r = self.rng.random()
        if r < 0.08 and len(self.running) < MAX_SEQS:
            self.admit(next(self.names))
        elif r < 0.12 and self.running:
            self.release(self.rng.choice(sorted(self.running)))
        elif r < 0.16 and self.running:  # preempted: blocks freed, re-admitted later with other blocks
            name = self.rng.choice(sorted(self.running))
            self.release(name)
            self.free.reverse()
            self.admit(name)


def test_device_inputs_equal_a_from_scratch_build_after_joins_leaves_and_preemptions() -> None:
    rng = random.Random(5)
    seqs = Sequences(rng)
    for _ in range(3):
        seqs.admit(next(seqs.names))
    inputs = StaticDecodeInputs(MAX_SEQS, MAX_BLOCKS, BLOCK, PAD_SLOT, device="cpu")
    full_uploads = partial_uploads = steps_with_rewrites = 0
    for step in range(300):
        seqs.churn()
        if not seqs.running:
            seqs.admit(next(seqs.names))
        names = sorted(seqs.running)
        if step % 7 == 0:
            rng.shuffle(names)  # rows change places: each moved sequence rewrites its row
        live = [seqs.running[n] for n in names]
        tokens = [rng.randrange(1000) for _ in live]
        args = (tokens, [s["context"] for s in live], [s["table"] for s in live], [s["slot"] for s in live])
        rows = next(b for b in BUCKETS if b >= len(live))
        inputs.load(*args, num_rows=rows)

        want = ForwardBatch.build([[t] for t in tokens], *args[1:], BLOCK)
        got = inputs.batch(rows)
        n = len(live)
        for field in ("token_ids", "positions", "seq_lens", "slot_mapping", "slot_ids"):
            assert getattr(got, field)[:n].tolist() == getattr(want, field).tolist(), (step, field)
        for i, seq in enumerate(live):
            assert got.block_tables[i, : len(seq["table"])].tolist() == seq["table"], (step, i)
        assert got.seq_lens[n:].tolist() == [0] * (rows - n) and got.slot_mapping[n:].tolist() == [-1] * (rows - n)
        assert got.slot_ids[n:].tolist() == [PAD_SLOT] * (rows - n)

        full_uploads += sum(len(s["table"]) for s in live)
        partial_uploads += inputs.table_entries_uploaded
        steps_with_rewrites += inputs.table_entries_uploaded > n
        seqs.advance()
    assert steps_with_rewrites > 20  # the run did join, preempt and swap rows
    assert partial_uploads < full_uploads / 3, (partial_uploads, full_uploads)


def test_a_step_uploads_only_the_block_a_sequence_opens() -> None:
    inputs = StaticDecodeInputs(MAX_SEQS, MAX_BLOCKS, BLOCK, PAD_SLOT, device="cpu")
    a, b = [7, 3], [5]
    inputs.load([1, 2], [5, 2], [a, b], [0, 1], num_rows=2)
    assert inputs.table_entries_uploaded == 3  # first sight: both rows written
    inputs.load([1, 2], [6, 3], [a, b], [0, 1], num_rows=2)
    assert inputs.table_entries_uploaded == 0  # the same tables: nothing but the row values moves
    b.append(9)  # the caller's list grows in place: b's context reaches its second block
    inputs.load([1, 2], [7, 4], [a, b], [0, 1], num_rows=2)
    assert inputs.table_entries_uploaded == 1
    assert inputs.block_tables[:2, :2].tolist() == [[7, 3], [5, 9]]
    inputs.load([2], [4], [b], [1], num_rows=1)  # a left: b moves to row 0 and rewrites it
    assert inputs.table_entries_uploaded == 2 and inputs.block_tables[0, :2].tolist() == [5, 9]
    assert inputs.batch(1).slot_mapping.tolist() == [9 * BLOCK + 0]


def test_a_refused_step_leaves_the_mirror_as_the_device_holds_it() -> None:
    inputs = StaticDecodeInputs(MAX_SEQS, MAX_BLOCKS, BLOCK, PAD_SLOT, device="cpu")
    inputs.load([1], [5], [[7, 3]], [0], num_rows=1)
    with pytest.raises(ValueError, match="continues a cached context"):  # row 0 changed, row 1 is no decode row
        inputs.load([1, 2], [6, 0], [[8, 4], [4]], [0, 1], num_rows=2)
    assert inputs.block_tables[0, :2].tolist() == [7, 3]
    inputs.load([1], [6], [[8, 4]], [0], num_rows=1)
    assert inputs.table_entries_uploaded == 2 and inputs.block_tables[0, :2].tolist() == [8, 4]
