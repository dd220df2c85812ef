"""The fixed-shape decode step (the body of the CUDA graphs, `engine/cuda_graphs.py`), run eagerly on the CPU.

A runner with `DecodeGraphs` (nothing captured: `run` executes the same padded body a graph records)
and a plain eager runner execute the same steps (`_decode_steps.workload`) on the k3-tiny model in fp32:
prefills (eager in both), then decode steps of 4, 3, 2 and 1 sequences over buckets (2, 8), padded by
4, 5, 0 and 1 rows. Every step's logits and, at the end, every request's KDA slots and MLA blocks are
equal. Every block and slot no request owns starts as NaN poison and stays poison: padding rows touch
only the cache's pad slot (which they do write: the padded path really ran).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3serve.engine.config import EngineArgs
from k3serve.engine.cuda_graphs import DecodeGraphs, graphs_enabled
from k3serve.engine.runner import ModelRunner
from k3serve.model.batch import ModelCache, StaticDecodeInputs
from k3serve.model.loader import load_model
from k3serve.model.model import KimiForCausalLM

from _decode_steps import BUCKETS, MAX_BLOCKS, NUM_BLOCKS, NUM_SLOTS, owned_pools, poison, workload

BLOCK = 8


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path) -> KimiForCausalLM:
    return load_model(tiny_checkpoint)


def test_padded_decode_body_equals_eager_and_touches_only_the_pad_slot(model: KimiForCausalLM) -> None:
    eager_cache = ModelCache.allocate(model.config, NUM_BLOCKS, NUM_SLOTS, BLOCK)
    static_cache = ModelCache.allocate(model.config, NUM_BLOCKS, NUM_SLOTS, BLOCK, reserve_pad_slot=True)
    assert static_cache.pad_slot == NUM_SLOTS and static_cache.kda_recurrent[0].shape[0] == NUM_SLOTS + 1
    poison(eager_cache)
    poison(static_cache)
    graphs = DecodeGraphs(model, static_cache, BUCKETS, MAX_BLOCKS)
    eager, static = ModelRunner(model, eager_cache), ModelRunner(model, static_cache, graphs=graphs)

    for i, step in enumerate(workload(model.config.vocab_size, BLOCK)):
        decode_only = all(not s.is_prefill for s in step.seqs)
        assert graphs.fits(step.seqs) == decode_only
        want, got = eager.execute(step).sample_logits, static.execute(step).sample_logits
        assert want.keys() == got.keys()
        for rid in want:
            assert torch.isfinite(got[rid]).all(), f"step {i}, {rid}: padding NaN reached a real row"
            torch.testing.assert_close(got[rid], want[rid], rtol=1e-5, atol=1e-5, msg=f"step {i}, {rid}")
    assert graphs.num_replays == 0  # nothing captured on the CPU: every decode ran the body eagerly
    assert graphs.num_padding_rows == 4 + 5 + 0 + 1

    for want, got in zip(owned_pools(eager_cache), owned_pools(static_cache)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    for pool in static_cache.kda_recurrent:  # unused blocks/slots are poison still; the pad slot was used
        assert pool[NUM_SLOTS].abs().sum() > 0


def test_static_inputs_pad_rows_and_reject_non_decode_rows() -> None:
    inputs = StaticDecodeInputs(max_seqs=4, max_blocks=3, block_size=BLOCK, pad_slot=9, device="cpu")
    inputs.load([11, 12], [8, 3], [[5, 2], [7]], [4, 1], num_rows=4)
    batch = inputs.batch(4)
    assert batch.token_ids.tolist() == [11, 12, 0, 0]
    assert batch.seq_lens.tolist() == [9, 4, 0, 0]  # padding rows read no cache
    assert batch.slot_mapping.tolist() == [2 * BLOCK + 0, 7 * BLOCK + 3, -1, -1]  # and write no MLA row
    assert batch.slot_ids.tolist() == [4, 1, 9, 9] and batch.pad_slot == 9  # their KDA step runs on the pad slot
    assert batch.block_tables[:2, :2].tolist() == [[5, 2], [7, -1]]
    assert batch.num_decode == batch.num_seqs == 4 and batch.checkpoint_offsets is None
    with pytest.raises(ValueError, match="continues a cached context"):
        inputs.load([1], [0], [[5]], [4], num_rows=1)  # a fresh sequence: not a decode row
    with pytest.raises(ValueError, match="continues a cached context"):
        inputs.load([1], [8], [[5]], [4], num_rows=1)  # position 8 needs a second block
    with pytest.raises(ValueError, match="padded to 1 rows"):
        inputs.load([1, 2], [1, 1], [[5], [6]], [4, 2], num_rows=1)


def test_graph_arguments_are_validated() -> None:
    assert EngineArgs(max_num_seqs=40).graph_batch_sizes == (1, 2, 4, 8, 16, 32, 40)
    assert EngineArgs(max_num_seqs=40, cuda_graph_batch_sizes=[3, 40]).graph_batch_sizes == (3, 40)
    for bad in [(), (4, 2), (1, 41), (0, 1)]:
        with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
            EngineArgs(max_num_seqs=40, cuda_graph_batch_sizes=bad)
    assert not graphs_enabled(EngineArgs(device="cpu"))
    assert not graphs_enabled(EngineArgs(device="cuda", enforce_eager=True))
    assert not graphs_enabled(EngineArgs(device="cuda", dtype="float32"))
    assert not graphs_enabled(EngineArgs(device="cuda", tensor_parallel_size=2))
    assert graphs_enabled(EngineArgs(device="cuda"))
