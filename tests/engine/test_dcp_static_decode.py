"""The fixed-shape decode step (the CUDA graphs' body) under decode context parallelism, run eagerly on the CPU by
two gloo ranks of one DCP group: the workload of test_static_decode.py, decode batches padded over buckets (2, 8),
block ids of 2 pages of 4 tokens. Every step's logits on rank 0 equal a one-rank eager runner's with blocks of 8
(to 1e-4: TP 2 sums its partial outputs in another order, ~1e-5 apart in fp32);
each rank's MLA pages that no token of its own landed in stay NaN poison (padding rows and the other rank's tokens
write nowhere here)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from k3serve.engine.cuda_graphs import DecodeGraphs
from k3serve.engine.runner import ModelRunner
from k3serve.engine.tp_group import TPGroup
from k3serve.kernels.mla import dcp
from k3serve.model.batch import ModelCache
from k3serve.model.loader import load_model

from _decode_steps import BUCKETS, MAX_BLOCKS, NUM_BLOCKS, NUM_SLOTS, TABLES, poison, workload
from _local_ranks import spawned, tcp_init_method

PAGE, DCP = 4, 2


def _run_rank(rank: int, init_method: str, checkpoint: Path) -> tuple[list[dict], ModelCache]:
    """This rank's sampled logits of every step of the workload (rank 0's; empty elsewhere) and its cache."""
    torch.set_num_threads(1)
    group = TPGroup(rank, DCP, init_method, timeout_s=60)
    try:
        model = load_model(checkpoint, replace(group.tensor_parallel(), dcp_size=DCP))
        cache = ModelCache.allocate(model.config, NUM_BLOCKS, NUM_SLOTS, PAGE, DCP, reserve_pad_slot=True,
                                    dcp_size=DCP)
        poison(cache)
        runner = ModelRunner(model, cache, graphs=DecodeGraphs(model, cache, BUCKETS, MAX_BLOCKS))
        logits = [runner.execute(step).sample_logits for step in workload(model.config.vocab_size, PAGE * DCP)]
        assert runner.graphs.num_padding_rows == 4 + 5 + 0 + 1  # the padded body ran
        _check_only_own_pages_written(cache, rank)
        return logits, cache
    finally:
        group.close()


def _check_only_own_pages_written(cache: ModelCache, rank: int) -> None:
    """Blocks no request holds are poison; in a request's blocks this rank wrote rows of its own pages only."""
    used = sorted({b for table in TABLES.values() for b in table})
    unused = [b for b in range(NUM_BLOCKS) if b not in used]
    for pool in cache.mla_kv:
        assert pool[unused].isnan().all()
        written = ~pool[used].isnan().all(-1)  # [used, PAGE]
        assert written.any()
    slots = torch.tensor([TABLES["d"][0] * PAGE * DCP + p for p in range(PAGE * DCP)])  # d's first block, full
    mine = dcp.local_slots(slots, PAGE, DCP, rank)
    rows = cache.mla_kv[0].flatten(0, 1)[mine[mine >= 0]]
    assert rows.shape[0] == PAGE and not rows.isnan().any()


def _follower(rank: int, init_method: str, checkpoint: Path) -> None:
    _run_rank(rank, init_method, checkpoint)


def test_the_padded_decode_body_splits_the_kv_and_equals_one_eager_rank(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint)
    eager = ModelRunner(model, ModelCache.allocate(model.config, NUM_BLOCKS, NUM_SLOTS, PAGE * DCP))
    want = [eager.execute(step).sample_logits for step in workload(model.config.vocab_size, PAGE * DCP)]
    init = tcp_init_method()
    with spawned(_follower, 1, init, tiny_checkpoint, join_s=60):
        got, _ = _run_rank(0, init, tiny_checkpoint)
    assert len(got) == len(want) == 6
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for rid in w:
            torch.testing.assert_close(g[rid], w[rid], rtol=1e-4, atol=1e-4)  # TP 2's all-reduce order: ~1e-5
