"""Where a TP engine's ranks run and whether their decode steps can be CUDA graphs, decided on the host (the
NCCL group itself needs two GPUs: tests/engine/test_tp_nccl_gpu.py).

* `rank_device`: a bare "cuda" puts rank r on GPU r of those the process sees (GPU 0 of one, as under
  Ray); an indexed device, the CPU, or a one-rank engine's device is taken as given.
* Graphs at TP > 1 need collectives a graph can record: NCCL's, not gloo's; the memory plan sets their
  memory aside whenever the arguments allow them (before the ranks have chosen their group).
* Every rank asks for NCCL unless it opted out (`K3SERVE_TP_NCCL=0`); the ranks keep the model on gloo unless
  every one asked, has a torch with NCCL and a GPU of its own; rank 0 warns why unless every rank opted out.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from k3serve.engine.config import EngineArgs
from k3serve.engine.cuda_graphs import graphs_allowed, graphs_enabled
from k3serve.engine.tp_group import NCCL_SWITCH, TPGroup, _nccl_refused, leader_store, nccl_requested, rank_device
from k3serve.model.parallel import TensorParallel


@pytest.mark.parametrize(("visible", "want"), [(2, ["cuda:0", "cuda:1"]), (8, ["cuda:0", "cuda:1"]),
                                               (1, ["cuda:0", "cuda:0"])])
def test_a_bare_cuda_spreads_the_ranks_over_the_visible_gpus(monkeypatch: pytest.MonkeyPatch, visible: int,
                                                             want: list[str]) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert [str(rank_device("cuda", rank, 2)) for rank in range(2)] == want


def test_other_devices_are_every_ranks_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [str(rank_device("cuda:3", rank, 2)) for rank in range(2)] == ["cuda:3", "cuda:3"]
    assert str(rank_device("cpu", 1, 2)) == "cpu"
    assert str(rank_device("cuda", 0, 1)) == "cuda"  # one rank: the current device, as before


def test_a_bare_cuda_without_a_visible_gpu_fails_naming_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="TP rank 1: device 'cuda' but this process sees no CUDA device"):
        rank_device("cuda", 1, 2)


def test_graphs_at_tp2_need_collectives_a_graph_can_record(monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.HashStore()
    gloo = dist.ProcessGroupGloo(store, 0, 1)  # a one-rank gloo group stands for a TP engine's
    args = EngineArgs(device="cuda", tensor_parallel_size=2)
    monkeypatch.setenv(NCCL_SWITCH, "0")
    assert not graphs_allowed(args)  # opted out to gloo: no pad slot, no graphs' pool set aside
    monkeypatch.delenv(NCCL_SWITCH)
    assert graphs_allowed(args)  # NCCL asked for, the default: the plan sets the pad slot and the graphs' pool aside
    assert not graphs_enabled(args)  # the group is not known yet
    assert not TensorParallel(0, 2, group=gloo).capturable
    assert not graphs_enabled(args, TensorParallel(0, 2, group=gloo))
    assert TensorParallel().capturable and graphs_enabled(EngineArgs(device="cuda"))
    assert not graphs_allowed(EngineArgs(device="cuda", tensor_parallel_size=2, enforce_eager=True))


def test_a_rank_asks_for_nccl_unless_its_switch_is_0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NCCL_SWITCH, raising=False)
    assert nccl_requested()  # the default
    monkeypatch.setenv(NCCL_SWITCH, "1")
    assert nccl_requested()
    monkeypatch.setenv(NCCL_SWITCH, "0")
    assert not nccl_requested()  # the opt-out
    for value in ("yes", "", "true"):
        monkeypatch.setenv(NCCL_SWITCH, value)
        with pytest.raises(ValueError, match=f"{NCCL_SWITCH}='{value}': must be 0"):
            nccl_requested()


def test_nccl_needs_every_rank_to_ask_and_have_nccl_and_a_gpu_of_its_own() -> None:
    assert _nccl_refused([(True, "GPU-a"), (True, "GPU-b")]) is None
    assert _nccl_refused([(True, "GPU-a"), (False, None)]) == f"rank(s) [1] set {NCCL_SWITCH}=0"
    assert _nccl_refused([(True, None), (True, "GPU-b")]) == "rank(s) [0] on a torch without NCCL"
    assert _nccl_refused([(True, "GPU-a"), (True, "GPU-a")]) == "ranks share a GPU (NCCL needs one GPU per rank)"


@pytest.mark.skipif(dist.is_nccl_available(), reason="a torch without NCCL: the choice runs without a GPU")
def test_the_opt_out_keeps_gloo_silently_and_an_unmet_ask_for_nccl_warns_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real choice over a one-rank group (`tensor_parallel("cuda")` itself needs a GPU)."""
    store, init = leader_store(1, "127.0.0.1")
    group = TPGroup(0, 1, init, store=store.clone())
    del store
    try:
        monkeypatch.setenv(NCCL_SWITCH, "0")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the opt-out says nothing
            assert group._join_nccl(torch.device("cuda", 0)) is None
        monkeypatch.delenv(NCCL_SWITCH)  # the default asks for NCCL
        with pytest.warns(UserWarning, match=r"on gloo.*rank\(s\) \[0\] on a torch without NCCL; "
                                             f"{NCCL_SWITCH}=0 on every rank chooses gloo without this warning"):
            assert group._join_nccl(torch.device("cuda", 0)) is None
        monkeypatch.setenv(NCCL_SWITCH, "yes")
        with pytest.raises(ValueError, match=f"{NCCL_SWITCH}='yes': must be 0"):
            group._join_nccl(torch.device("cuda", 0))
    finally:
        group.close()
