"""The scheduler's side of the offload tiers with the real host index and no model: the runner's results are written
by hand (bytes moved, None for a copy that failed), as vLLM's scheduler tests write a ModelRunnerOutput. What it
pins, holds and frees around stores and loads, a load that misses, an abort while a loaded hit waits."""

from __future__ import annotations

from k3serve.engine.block_pool import BlockPool
from k3serve.engine.config import EngineArgs
from k3serve.engine.memory import scheduler_config
from k3serve.engine.offload.host_tier import HostIndex
from k3serve.engine.offload.manager import Offload
from k3serve.engine.prefix_cache import PrefixCache
from k3serve.engine.request import Request
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.scheduler import Scheduler
from k3serve.engine.state_pool import StatePool

BLOCK = 16
FIRST = list(range(100, 150))  # its unit: 48 tokens, 3 blocks
SECOND = FIRST + list(range(300, 320))


def make(num_blocks: int = 32, host_blocks: int = 16) -> tuple[Scheduler, Offload, HostIndex]:
    cfg = scheduler_config(EngineArgs(block_size=BLOCK, max_model_len=256, max_num_seqs=4), None, None)
    blocks, slots = BlockPool(num_blocks, BLOCK), StatePool(8)
    prefix_cache = PrefixCache(blocks, slots)
    host = HostIndex(host_blocks, 4, BLOCK)
    offload = Offload([host], prefix_cache)
    return Scheduler(cfg, blocks, slots, prefix_cache, offload=offload), offload, host


def run(scheduler: Scheduler, results=lambda output: [64] * (len(output.offload_stores) + len(output.offload_loads))):
    """Steps until nothing is left, each copy answered by `results(output)`; the outputs."""
    outputs = []
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        sampled = {s.request_id: 7 for s in output.seqs if s.needs_sample}
        scheduler.update_from_output(output, sampled, offload_results=results(output))
        outputs.append(output)
    return outputs


def add(scheduler: Scheduler, rid: str, prompt: list[int]) -> Request:
    req = Request(rid, prompt, SamplingParams(max_tokens=2))
    scheduler.add_request(req)
    return req


def assert_nothing_held(scheduler: Scheduler, host: HostIndex) -> None:
    for pool in (scheduler.block_pool, scheduler.state_pool, host.blocks, host.slots):
        assert pool.num_used == 0, pool


def test_a_checkpoint_is_stored_the_next_step_with_its_blocks_pinned_until_then():
    scheduler, offload, host = make()
    add(scheduler, "a", FIRST)
    first = scheduler.schedule()
    scheduler.update_from_output(first, {"a": 7})
    assert offload.has_pending and scheduler.has_unfinished()
    pinned = [b for b in range(32) if scheduler.block_pool.pin_count(b)]
    assert len(pinned) == 3 and sum(scheduler.state_pool.pin_count(s) for s in range(8)) == 1
    outputs = run(scheduler)
    (store,) = outputs[0].offload_stores
    assert store.num_tokens == 48 and [d for d, _ in store.moves] == pinned
    assert host.lookup(store.block_hashes) == 3
    assert_nothing_held(scheduler, host)


def test_a_unit_evicted_from_the_device_is_loaded_then_admitted_from_it():
    scheduler, offload, host = make()
    add(scheduler, "a", FIRST)
    run(scheduler)
    scheduler.prefix_cache.clear()
    req = add(scheduler, "b", SECOND)
    loading = scheduler.schedule()
    assert not loading.seqs and [op.num_tokens for op in loading.offload_loads] == [48]
    assert req.status.name == "WAITING"
    scheduler.update_from_output(loading, {}, offload_results=[4096])
    admitted = scheduler.schedule()
    (seq,) = admitted.seqs
    assert seq.num_computed_tokens == 48 and seq.copy_state_from_slot >= 0
    assert req.num_cached_tokens == 48 and offload.counts["host"].hits == 48
    scheduler.update_from_output(admitted, {"b": 7}, offload_results=[])
    run(scheduler)
    assert_nothing_held(scheduler, host)


def test_a_load_that_did_not_verify_is_a_miss_the_request_recomputes_and_the_host_forgets_the_unit():
    scheduler, offload, host = make()
    add(scheduler, "a", FIRST)
    run(scheduler)
    scheduler.prefix_cache.clear()
    req = add(scheduler, "b", SECOND)
    outputs = run(scheduler, lambda output: [None] * len(output.offload_loads) + [64] * len(output.offload_stores))
    assert [op.num_tokens for op in outputs[0].offload_loads] == [48]
    assert outputs[1].seqs[0].num_computed_tokens == 0 and req.num_cached_tokens == 0
    assert offload.counts["host"].misses == 1
    assert host.lookup(outputs[0].offload_loads[0].block_hashes) == 0
    assert_nothing_held(scheduler, host)


def test_an_abort_while_a_loaded_hit_waits_frees_it():
    scheduler, offload, host = make()
    add(scheduler, "a", FIRST)
    run(scheduler)
    scheduler.prefix_cache.clear()
    add(scheduler, "b", SECOND)
    loading = scheduler.schedule()
    scheduler.update_from_output(loading, {}, offload_results=[4096])
    assert scheduler.block_pool.num_used == 3 and scheduler.state_pool.num_used == 1  # the loaded hit, held
    scheduler.finish_request("b")
    run(scheduler)
    assert_nothing_held(scheduler, host)


def test_a_full_host_skips_the_store_and_shared_blocks_are_stored_once():
    scheduler, offload, host = make(host_blocks=4)
    add(scheduler, "a", FIRST)
    run(scheduler)
    add(scheduler, "b", SECOND)  # a device hit, then its own unit of 4 blocks: only the new one moves
    outputs = run(scheduler)
    (store,) = [op for o in outputs for op in o.offload_stores]
    assert store.num_blocks == 4 and len(store.moves) == 1
    add(scheduler, "c", list(range(500, 600)))  # 6 blocks: more than the host holds
    assert not [op for o in run(scheduler) for op in o.offload_stores]
    assert_nothing_held(scheduler, host)
