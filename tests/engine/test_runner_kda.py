"""The runner's KDA bookkeeping around one forward pass (k3-tiny, CPU fp32):

* a step's chunk plan is built once, however many KDA layers read it, and the batch keeps host copies
  of the indices that prefill reads on the host;
* a fresh sequence (`zero_state`) starts from zero state in a slot whose last owner left garbage
  there: the runner zeroes it, once, before the forward (the model itself reads whatever a slot holds);
* a mixed step (decodes, a fresh prefill, a continued one, in-pass checkpoints) gives the same logits
  and checkpoint slots as each sequence run alone from its slot (the checkpoint one as a split run).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3serve.engine.runner import ModelRunner
from k3serve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from k3serve.model import batch as batch_module
from k3serve.model.batch import ForwardBatch, ModelCache
from k3serve.model.loader import load_model
from k3serve.model.model import KimiForCausalLM

BLOCK = 8
NUM_BLOCKS, NUM_SLOTS = 32, 8


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path) -> KimiForCausalLM:
    return load_model(tiny_checkpoint)


def _runner(model: KimiForCausalLM, poison: float | None = None) -> ModelRunner:
    cache = ModelCache.allocate(model.config, NUM_BLOCKS, NUM_SLOTS, BLOCK)
    if poison is not None:
        for pool in cache.kda_recurrent + cache.kda_conv:
            pool.fill_(poison)
    return ModelRunner(model, cache)


def _seq(rid: str, tokens: list[int], computed: int, slot: int, first_block: int, **kw) -> ScheduledSeq:
    blocks = list(range(first_block, first_block + -(-(computed + len(tokens)) // BLOCK)))
    return ScheduledSeq(rid, tokens, computed, blocks, slot, is_prefill=len(tokens) > 1 or computed == 0,
                        needs_sample=True, **kw)


def _tokens(model: KimiForCausalLM, n: int) -> list[int]:
    return torch.randint(0, model.config.vocab_size, (n,)).tolist()


def _kda_state(cache: ModelCache, slot: int) -> list[torch.Tensor]:
    return [pool[slot].clone() for pool in cache.kda_recurrent + cache.kda_conv]


def test_chunk_plan_is_built_once_per_step_for_all_kda_layers(model: KimiForCausalLM, monkeypatch) -> None:
    assert len(model.config.kda_layers) >= 2
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return plan_chunks(*args, **kwargs)

    plan_chunks = batch_module.plan_chunks
    monkeypatch.setattr(batch_module, "plan_chunks", counted)
    runner = _runner(model)
    runner.execute(SchedulerOutput([_seq("a", _tokens(model, 20), 0, 0, 0, zero_state=True, checkpoint_offset=16,
                                         checkpoint_slot=1)]))
    assert len(calls) == 1 and calls[0][0] == [20] and calls[0][2] == [16]
    runner.execute(SchedulerOutput([_seq("a", _tokens(model, 1), 20, 0, 0),
                                    _seq("b", _tokens(model, 9), 0, 2, 8, zero_state=True)]))
    assert len(calls) == 2 and calls[1][0] == [1, 9] and calls[1][2] is None


@pytest.mark.parametrize("poison", [1e30, float("nan")], ids=["1e30", "nan"])
def test_fresh_sequence_in_a_reused_slot_starts_from_zero(model: KimiForCausalLM, poison: float) -> None:
    """Every KDA slot holds garbage (as a slot freed by another request does); a fresh prefill and its
    decode step match a clean cache's exactly, and its slot holds exactly the clean state."""
    prompt, nxt = _tokens(model, 11), _tokens(model, 1)
    logits, states = [], []
    for runner in (_runner(model), _runner(model, poison)):
        first = runner.execute(SchedulerOutput([_seq("a", prompt, 0, 5, 0, zero_state=True)])).sample_logits["a"]
        second = runner.execute(SchedulerOutput([_seq("a", nxt, 11, 5, 0)])).sample_logits["a"]
        logits.append(torch.stack([first, second]))
        states.append(_kda_state(runner.cache, 5))
    assert torch.equal(logits[0], logits[1])
    assert all(torch.equal(clean, reused) for clean, reused in zip(*states))


def test_mixed_step_with_checkpoints_matches_sequences_alone(model: KimiForCausalLM) -> None:
    """One step: two decodes, a fresh 20-token prefill checkpointed mid-chunk (offset 16) and a 9-token
    chunk continuing 5 cached tokens checkpointed at offset 2 (its conv window reaches back into the
    cached part). Each sequence alone gives the same logits; each checkpoint slot equals the state of a
    run split at the offset."""
    a, b, c, d = (_tokens(model, n) for n in (7, 4, 20, 14))
    mixed = _runner(model, poison=float("nan"))
    history = [_seq("a", a[:6], 0, 0, 0, zero_state=True), _seq("b", b[:3], 0, 1, 4, zero_state=True),
               _seq("d", d[:5], 0, 3, 12, zero_state=True)]
    mixed.execute(SchedulerOutput(history))
    step = [_seq("a", a[6:], 6, 0, 0), _seq("b", b[3:], 3, 1, 4),
            _seq("c", c, 0, 2, 8, zero_state=True, checkpoint_offset=16, checkpoint_slot=6),
            _seq("d", d[5:], 5, 3, 12, checkpoint_offset=2, checkpoint_slot=7)]
    got = mixed.execute(SchedulerOutput(step)).sample_logits

    for rid, tokens, slot, first_block, cut in (("a", a, 0, 0, None), ("b", b, 1, 4, None), ("c", c, 2, 8, 16),
                                                ("d", d, 3, 12, 7)):
        alone = _runner(model)
        prefix = len(tokens) - 1 if rid in "ab" else {"c": 0, "d": 5}[rid]
        if prefix:
            alone.execute(SchedulerOutput([_seq(rid, tokens[:prefix], 0, slot, first_block, zero_state=True)]))
        want = alone.execute(SchedulerOutput([_seq(rid, tokens[prefix:], prefix, slot, first_block,
                                                   zero_state=prefix == 0)])).sample_logits[rid]
        torch.testing.assert_close(got[rid], want, rtol=1e-4, atol=1e-4, msg=rid)
        if cut is None:
            continue
        split = _runner(model)
        split.execute(SchedulerOutput([_seq(rid, tokens[:cut], 0, slot, first_block, zero_state=True)]))
        checkpoint_slot = {"c": 6, "d": 7}[rid]
        for want_state, got_state in zip(_kda_state(split.cache, slot), _kda_state(mixed.cache, checkpoint_slot)):
            torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5, msg=f"{rid} checkpoint")


def test_batch_keeps_host_copies_of_what_prefill_reads_on_the_host() -> None:
    batch = ForwardBatch.build([[1], [2, 3, 4], [5, 6]], [4, 0, 2], [[0], [1], [2]], [3, 0, 5], BLOCK,
                               checkpoint_offsets=[-1, 2, 1], checkpoint_slot_ids=[-1, 6, 7])
    assert batch.cu_seqlens_host.tolist() == batch.cu_seqlens.tolist() == [0, 1, 4, 6]
    assert (batch.num_seqs, batch.num_decode, batch.num_decode_tokens) == (3, 1, 1)
    assert batch.slot_ids_host.tolist() == [3, 0, 5]
    assert batch.seq_lens_host.tolist() == batch.seq_lens.tolist()
    assert batch.checkpoint_offsets_host.tolist() == [-1, 2, 1]
    assert batch.checkpoint_slot_ids_host.tolist() == [-1, 6, 7]
    assert batch.checkpoint_rows.tolist() == [1, 2]  # the rows that want one: an index, not a mask
    assert batch.kda_chunk_plan(64) is batch.kda_chunk_plan(64)
    assert batch.kda_chunk_plan(64).seq_lens == (1, 3, 2)
    without_host = {name: getattr(batch, name) for name in (
        "token_ids", "positions", "cu_seqlens", "num_computed", "seq_lens", "block_tables", "slot_mapping",
        "slot_ids", "checkpoint_offsets", "checkpoint_slot_ids", "num_decode")}
    with pytest.raises(ValueError, match="needs the host copies"):
        ForwardBatch(**without_host)
