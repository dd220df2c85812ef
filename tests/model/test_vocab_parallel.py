"""Specification of the vocab-parallel embedding and lm_head (`model/layers/vocab.py`): rank r of tp holds
vocab rows [r*S, (r+1)*S), S = ceil(V/tp), loaded from the checkpoint's unchanged [V, hidden] tensors (its
real rows only, the padding zero); the memory plan counts those S rows, not V; rank 0 receives the ranks'
logits in one collective and assembles them without a concatenation or a cast of its own. That the sharded
model gives the unsharded one's logits: tests/model/test_tensor_parallel.py; through a TP engine:
tests/engine/test_tp_engine.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3serve.engine.memory import weight_bytes
from k3serve.engine.tp_group import TPGroup
from k3serve.model.layers.vocab import VocabShard
from k3serve.model.loader import load_model
from k3serve.model.parallel import TensorParallel
from k3serve.model.presets import preset_config

from _checkpoint_files import read_tensor
from _lm_head_ranks import follower, lm_head
from _local_ranks import spawned, tcp_init_method

ODD_VOCAB = 509


def test_shards_cover_the_vocab_in_order_padding_the_last_rank() -> None:
    shards = [VocabShard.of(ODD_VOCAB, TensorParallel(r, 4)) for r in range(4)]
    assert [(s.start, s.rows) for s in shards] == [(0, 128), (128, 128), (256, 128), (384, 128)]
    assert shards[-1].start + shards[-1].rows == ODD_VOCAB + 3  # the last rank's 3 rows past the vocab: padding
    k3 = [VocabShard.of(163840, TensorParallel(r, 8)) for r in range(8)]
    assert {s.rows for s in k3} == {20480} and k3[-1].start + 20480 == 163840  # no padding
    assert VocabShard.of(ODD_VOCAB, TensorParallel()) == VocabShard(ODD_VOCAB, ODD_VOCAB, 0)  # TP 1: no padding
    assert VocabShard.of(5, TensorParallel(3, 4)).start >= 5  # a rank past the vocab holds padding only


@pytest.mark.parametrize("tp_size", [2, 4])
def test_each_rank_loads_its_own_vocab_rows_and_zero_padding(odd_vocab_checkpoint: Path, tp_size: int) -> None:
    """Loading needs no process group: each rank is built alone here. Together the ranks' real rows are
    the checkpoint's tensor, each row on exactly one rank."""
    rows = -(-ODD_VOCAB // tp_size)
    models = [load_model(odd_vocab_checkpoint, TensorParallel(rank, tp_size)) for rank in range(tp_size)]
    for name, get in [("language_model.model.embed_tokens.weight", lambda m: m.model.embed_tokens.weight),
                      ("language_model.lm_head.weight", lambda m: m.lm_head.weight)]:
        full = read_tensor(odd_vocab_checkpoint, name).float()
        assert full.shape[0] == ODD_VOCAB  # the checkpoint keeps its published, unpadded shape
        held = []
        for rank, model in enumerate(models):
            weight, real = get(model), min(rows, ODD_VOCAB - rank * rows)
            assert weight.shape == (rows, full.shape[1])
            assert not weight[real:].any(), f"{name} rank {rank}: padding rows are not zero"
            held.append(weight[:real])
        torch.testing.assert_close(torch.cat(held), full, rtol=0, atol=0)


def test_the_plan_counts_a_ranks_vocab_rows_not_the_whole_vocab() -> None:
    """Per rank, each tp more vocab entries cost one row of the embedding and one of the lm_head; a vocab
    padded up to a multiple of tp costs what that multiple costs."""
    config = preset_config("k3-tiny")  # vocab 512
    row = 2 * config.hidden_size * 2  # embedding + lm_head, bf16

    def per_rank(vocab: int, tp: int) -> int:
        return weight_bytes(dataclasses.replace(config, vocab_size=vocab), tp, torch.bfloat16)

    assert per_rank(512, 1) - per_rank(510, 1) == 2 * row
    assert per_rank(512, 2) - per_rank(510, 2) == row
    assert per_rank(512, 4) - per_rank(508, 4) == row
    assert per_rank(ODD_VOCAB, 2) == per_rank(510, 2)


class _Ops(TorchDispatchMode):
    """Every op run under it, with the dtype it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func.overloadpacket.__name__, out.dtype if isinstance(out, torch.Tensor) else None))
        return out


@pytest.mark.timeout(60)
def test_rank_0_gathers_tp1s_logits_in_one_buffer_without_a_cat_or_a_cast() -> None:
    """Two gloo ranks of a TPGroup (the engine's path), a vocab of 7 (rank 1's last row is padding), 3 rows:
    rank 0's fp32 logits are the unsharded head's exactly (bf16 products, widened), the padding cut off;
    assembling them writes fp32 once (the copy that orders and widens) and concatenates nothing."""
    init = tcp_init_method()
    with spawned(follower, init):
        group = TPGroup(0, 2, init, timeout_s=20.0)
        head, hidden = lm_head(group.tensor_parallel())
        local = head.compute_logits(hidden)
        recorded = _Ops()
        with recorded:
            got = head.gather(local)
        group.close()
    whole, _ = lm_head(TensorParallel())
    want = whole.gather(whole.compute_logits(hidden))
    assert got.dtype == torch.float32 and got.shape == want.shape == (3, 7)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    names = [name for name, _ in recorded.ops]
    assert "cat" not in names and "_to_copy" not in names, names
    assert [name for name, dtype in recorded.ops if dtype == torch.float32 and name == "copy_"] == ["copy_"], names
