"""Specification: a step mixing plain decodes, verify rows and a prefill chunk ([decodes | verify rows | prefills])
gives each row what it gets in a step of its own (k3-tiny, CPU fp32), and its commit leaves each verify row's KDA
slot as decoding the accepted tokens one at a time would. The decode and verify slices of the KDA layers run on
their own slices of the batch with no index_select / index_copy_ gather at all. A rejected draft's MLA row, poisoned
after the step, changes nothing: it lies past the request's computed tokens and is overwritten before it is read.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from k3serve.engine.runner import ModelRunner
from k3serve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from k3serve.model.batch import ModelCache
from k3serve.model.layers.kda import KimiDeltaAttention
from k3serve.model.loader import load_model
from k3serve.model.model import KimiForCausalLM

BLOCK, NUM_BLOCKS, NUM_SLOTS = 8, 32, 8
GATHERS = {"index_select", "index_copy_", "index_copy"}
TOLERANCE = 1e-5  # the same rows in batches of other shapes round differently in the GEMMs


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path) -> KimiForCausalLM:
    return load_model(tiny_checkpoint)


def _seq(rid: str, tokens: list[int], computed: int, slot: int, first_block: int, drafts: int = 0,
         **kw) -> ScheduledSeq:
    blocks = list(range(first_block, first_block + -(-(computed + len(tokens)) // BLOCK)))
    return ScheduledSeq(rid, tokens, computed, blocks, slot, is_prefill=len(tokens) > 1 and not drafts,
                        needs_sample=True, num_draft_tokens=drafts, **kw)


def _primed(model: KimiForCausalLM, prompts: dict[str, list[int]]) -> ModelRunner:
    runner = ModelRunner(model, ModelCache.allocate(model.config, NUM_BLOCKS, NUM_SLOTS, BLOCK))
    runner.execute(SchedulerOutput([_seq("d", prompts["d"], 0, 0, 0, zero_state=True),
                                    _seq("s", prompts["s"], 0, 1, 4, zero_state=True)]))
    return runner


def _state(runner: ModelRunner, slot: int) -> list[torch.Tensor]:
    return [pool[slot].clone() for pool in runner.cache.kda_recurrent + runner.cache.kda_conv]


class _CountGathers(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in GATHERS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_mixed_step_is_its_rows_run_alone_and_commits_the_accepted_prefix(model: KimiForCausalLM) -> None:
    gen = torch.Generator().manual_seed(0)
    tok = lambda n: torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    prompts, step, fresh = {"d": tok(10), "s": tok(12)}, tok(5), tok(9)
    decode, verify = _seq("d", step[:1], 10, 0, 0), _seq("s", step[1:], 12, 1, 4, drafts=3)
    prefill = _seq("p", fresh, 0, 2, 8, zero_state=True)

    mixed = _primed(model, prompts)
    got = mixed.execute(SchedulerOutput([prefill, verify, decode]))  # the runner orders the slices itself
    for records in mixed._pending_commit.records:  # the verify rows' own tensors, not views of whole activations
        for t in (records.kda.k_hat, records.kda.u, records.kda.g, records.conv_inputs):
            assert t.shape[0] == 4 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    mixed.commit_verified({"s": 2})  # the last token and the first draft stay

    alone = _primed(model, prompts)
    want_decode = alone.execute(SchedulerOutput([decode])).sample_logits["d"]
    want_verify = alone.execute(SchedulerOutput([verify])).verify_logits["s"]
    alone.commit_verified({"s": 2})
    want_prefill = alone.execute(SchedulerOutput([prefill])).sample_logits["p"]
    torch.testing.assert_close(got.sample_logits["d"], want_decode, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(got.verify_logits["s"], want_verify, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(got.sample_logits["p"], want_prefill, atol=TOLERANCE, rtol=0)
    assert got.verify_logits["s"].shape[0] == 4

    stepped = _primed(model, prompts)  # the accepted tokens decoded one at a time
    for i, token in enumerate(step[1:3]):
        stepped.execute(SchedulerOutput([_seq("s", [token], 12 + i, 1, 4)]))
    for a, b in zip(_state(mixed, 1), _state(stepped, 1)):
        torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=0)

    # the rejected drafts' MLA rows (positions 14, 15) poisoned: the next decode at 14 overwrites and reads them
    for pool in mixed.cache.mla_kv:
        pool[5, 6:8] = 1e30
    nxt = tok(1)
    after = mixed.execute(SchedulerOutput([_seq("s", nxt, 14, 1, 4)])).sample_logits["s"]
    want = stepped.execute(SchedulerOutput([_seq("s", nxt, 14, 1, 4)])).sample_logits["s"]
    torch.testing.assert_close(after, want, atol=TOLERANCE, rtol=0)


def test_the_kda_layers_gather_nothing_for_decodes_and_verify_rows(model: KimiForCausalLM, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(1)
    tok = lambda n: torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    runner = _primed(model, {"d": tok(10), "s": tok(12)})
    counter = _CountGathers()
    forward = KimiDeltaAttention.forward

    def counted(self, *args, **kwargs):
        with counter:
            return forward(self, *args, **kwargs)

    monkeypatch.setattr(KimiDeltaAttention, "forward", counted)
    runner.execute(SchedulerOutput([_seq("d", tok(1), 10, 0, 0), _seq("s", tok(5), 12, 1, 4, drafts=4)]))
    runner.commit_verified({"s": 5})
    assert counter.calls == [], f"gathers in a decode + verify step's KDA layers: {counter.calls}"
