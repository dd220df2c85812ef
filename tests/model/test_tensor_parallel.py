"""Specification of tensor parallelism on CPU: two gloo ranks, each loading only its shard
(KDA and MLA heads, MLP columns/rows, whole experts, vocab rows), give rank 0 the logits of one rank
holding everything, for every step of a run with prefill, decode and a mixed batch; also for a vocab
that 2 does not divide (509: the last rank's vocab block is padded, the padding never shows).

    rank r holds  KDA heads [r*H/2, (r+1)*H/2)   MLA heads likewise    experts [r*E/2, (r+1)*E/2)
                  embedding and lm_head rows [r*S, (r+1)*S), S = ceil(V/2)
                  its own ModelCache (KDA slots: H/2 heads; MLA latent cache: replicated)
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3serve.model.config import ConfigError
from k3serve.model.loader import load_model
from k3serve.model.parallel import TensorParallel

from _runs import allocate, assert_logits_close, mixed_seqs, mixed_step, run_in_chunks

WORLD_SIZE = 2
TIMEOUT_S = 120


def _run(model, seqs: dict[str, list[int]], long_seq: list[int]) -> list[torch.Tensor]:
    """Logits of a mixed batch (decode + prefill) and of a chunked prefill followed by decode."""
    mixed = mixed_step(model, allocate(model, num_blocks=8, num_slots=4), seqs)
    chunked = run_in_chunks(model, allocate(model), long_seq, [11, 9, 1, 1, 1])
    return [*mixed, chunked]


def _worker(rank: int, port: int, checkpoints: list[str], seqs: list, long_seqs: list, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        results = []
        for checkpoint, s, long_seq in zip(checkpoints, seqs, long_seqs):
            model = load_model(checkpoint, TensorParallel(rank, WORLD_SIZE))
            results.append(_run(model, s, long_seq))
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_ranks_give_the_logits_of_one(
    tiny_checkpoint: Path, kimi_linear_tiny_checkpoint: Path, odd_vocab_checkpoint: Path, tmp_path: Path
) -> None:
    checkpoints = [tiny_checkpoint, kimi_linear_tiny_checkpoint, odd_vocab_checkpoint]
    models = [load_model(c) for c in checkpoints]
    seqs = [mixed_seqs(m.config.vocab_size) for m in models]
    long_seqs = [torch.randint(0, m.config.vocab_size, (23,)).tolist() for m in models]
    out = tmp_path / "rank0_logits.pt"

    context = mp.start_processes(
        _worker,
        args=(_free_port(), [str(c) for c in checkpoints], seqs, long_seqs, str(out)),
        nprocs=WORLD_SIZE,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"tensor-parallel workers did not finish within {TIMEOUT_S} s")

    sharded = torch.load(out)
    assert [len(r) for r in sharded] == [5, 5, 5]
    names = ("k3-tiny", "kimi-linear-tiny", "k3-tiny vocab 509")
    for name, model, s, long_seq, got in zip(names, models, seqs, long_seqs, sharded):
        steps = ("decode a", "decode b", "prefill c", "chunk d", "chunked")
        for step, ref, tp in zip(steps, _run(model, s, long_seq), got):
            assert_logits_close(f"{name} {step}: tp=2 vs tp=1", ref, tp)


def test_rank_outside_world_is_rejected() -> None:
    with pytest.raises(ValueError, match="rank 2 outside world size 2"):
        TensorParallel(rank=2, world_size=2)


def test_model_refuses_a_tp_size_that_does_not_divide_the_heads(tiny_checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="tensor parallel size 3"):
        load_model(tiny_checkpoint, TensorParallel(rank=0, world_size=3))
