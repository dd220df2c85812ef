"""The host offload tier on the real engine (tiny model, fp32, CPU): a prefix evicted from the device is served
from host memory, exactly; a corrupted host entry is a miss, still exact; nothing leaks on the device or the host."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3serve.engine.sampling_params import SamplingParams

from _llm_harness import (  # noqa: F401 (fixtures)
    BLOCK_SIZE, cache_bytes_for, make_llm, random_prompt,
)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def first_turns() -> list[list[int]]:
    gen = torch.Generator().manual_seed(22)
    return [random_prompt(gen, n) for n in (130, 200, 257, 64 * 5 + 3)]


def second_turns(firsts: list[list[int]]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(23)
    return [p + random_prompt(gen, 20) for p in firsts]


def unit_tokens(prompt: list[int]) -> int:
    """The boundary of the checkpoint a prompt leaves: its last block boundary below its length."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def assert_host_empty(llm) -> None:
    index = llm.engine.offload.tiers["host"]
    assert index.blocks.num_used == 0 and index.slots.num_used == 0, "host entries still held"
    index.clear()
    index.blocks.check_empty()
    index.slots.check_empty()


def test_a_prefix_evicted_from_the_device_is_served_from_host_memory(make_llm):
    llm = make_llm(kv_offload="host")
    plain = make_llm(enable_prefix_caching=False)
    firsts = first_turns()
    llm.generate(firsts, [greedy(4)] * len(firsts))
    llm.engine.scheduler.prefix_cache.clear()  # evicted from device memory: only the host holds the units
    seconds = second_turns(firsts)
    outs = llm.generate(seconds, [greedy(8)] * len(seconds))
    assert [o.num_cached_tokens for o in outs] == [unit_tokens(p) for p in firsts]
    want = plain.generate(seconds, [greedy(8)] * len(seconds))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    counts = llm.engine.offload.counts["host"]
    assert counts.hits == sum(unit_tokens(p) for p in firsts) and counts.misses == 0
    assert counts.bytes_in > 0 and counts.bytes_out > 0
    assert_host_empty(llm)


def test_a_corrupted_host_entry_is_a_miss_and_the_output_is_exact(make_llm):
    llm = make_llm(kv_offload="host")
    plain = make_llm(enable_prefix_caching=False)
    firsts = first_turns()[:2]
    llm.generate(firsts, [greedy(2)] * len(firsts))
    llm.engine.scheduler.prefix_cache.clear()
    host = llm.engine.runner.offload["host"]
    host.cache.mla_kv[0][:, 3, 7] += 1.0  # one value of every host block's row 3
    seconds = second_turns(firsts)
    outs = llm.generate(seconds, [greedy(8)] * len(seconds))
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain.generate(
        seconds, [greedy(8)] * len(seconds))]
    assert llm.engine.offload.counts["host"].misses == 2
    assert llm.engine.offload.tiers["host"].lookup([1]) == 0
    assert_host_empty(llm)


def test_a_corrupted_kda_checkpoint_is_a_miss(make_llm):
    llm = make_llm(kv_offload="host")
    firsts = first_turns()[:1]
    llm.generate(firsts, [greedy(2)])
    llm.engine.scheduler.prefix_cache.clear()
    llm.engine.runner.offload["host"].cache.kda_recurrent[-1][:, 0, 1, 2] += 1.0
    (out,) = llm.generate(second_turns(firsts)[:1], [greedy(4)])
    assert out.num_cached_tokens == 0 and llm.engine.offload.counts["host"].misses == 1
    assert_host_empty(llm)


def test_device_pressure_evicts_to_the_host_and_a_later_turn_hits_it(make_llm, tiny_checkpoint):
    """No clear(): a small device cache evicts the first turns' units LRU, the host still has them."""
    llm = make_llm(kv_offload="host", max_num_seqs=2,
                   cache_memory_bytes=cache_bytes_for(tiny_checkpoint, num_blocks=40, num_slots=4))
    firsts = first_turns()
    for prompt in firsts:  # one at a time: each evicts the one before from the device
        llm.generate([prompt], [greedy(2)])
    assert llm.engine.scheduler.prefix_cache.lookup(second_turns(firsts)[0]).num_tokens == 0
    (out,) = llm.generate(second_turns(firsts)[:1], [greedy(8)])
    assert out.num_cached_tokens == unit_tokens(firsts[0])
    (want,) = make_llm(enable_prefix_caching=False).generate(second_turns(firsts)[:1], [greedy(8)])
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert_host_empty(llm)


@pytest.mark.parametrize("args, message", [
    (dict(kv_offload="disk"), "kv_offload must be"),
    (dict(kv_offload="host", enable_prefix_caching=False), "needs enable_prefix_caching"),
    (dict(kv_offload="host", kv_offload_host_bytes=0), "kv_offload_host_bytes"),
    (dict(kv_offload="mooncake"), "needs kv_offload_mooncake_config"),
    (dict(kv_offload="mooncake", kv_offload_mooncake_config='{"master_server_addr": "m:1"}'), "metadata_server"),
    (dict(kv_offload="mooncake", kv_offload_mooncake_config="[1]"), "JSON object"),
])
def test_bad_offload_arguments_are_refused_naming_the_field(args, message):
    from k3serve.engine.config import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(**args)


def test_the_default_host_tier_is_capped_by_the_hosts_memory(make_llm, monkeypatch):
    from k3serve.engine.offload import factory

    llm = make_llm(kv_offload="host")
    runner = llm.engine.runner
    full = factory.host_pools(llm.engine.args, runner.cache, llm.engine.plan)
    full_bytes = factory.block_bytes(runner.cache) * full[0]
    monkeypatch.setattr(factory, "host_memory_bytes", lambda: full_bytes // 5)  # the tier takes half of that
    capped = factory.host_pools(llm.engine.args, runner.cache, llm.engine.plan)
    assert capped[0] < full[0] // 4 and capped[1] >= 1
    too_big = dataclasses.replace(llm.engine.args, kv_offload_host_bytes=10 ** 15)
    with pytest.raises(ValueError, match="exceeds the host's memory"):
        factory.host_pools(too_big, runner.cache, llm.engine.plan)
    capped_llm = make_llm(kv_offload="host")  # sized under the cap: the scheduler's index as its data
    index, data = capped_llm.engine.offload.tiers["host"], capped_llm.engine.runner.offload["host"]
    assert index.blocks.num_blocks == data.cache.mla_kv[0].shape[0] == capped[0]


def test_a_tier_that_does_not_restore_the_kda_state_is_refused():
    from k3serve.engine.block_pool import BlockPool
    from k3serve.engine.offload.host_tier import HostIndex
    from k3serve.engine.offload.manager import Offload
    from k3serve.engine.prefix_cache import PrefixCache
    from k3serve.engine.state_pool import StatePool

    kv_only = HostIndex(4, 1, BLOCK_SIZE)
    kv_only.restores_kda_state = False
    with pytest.raises(ValueError, match="does not restore the KDA state"):
        Offload([kv_only], PrefixCache(BlockPool(4, BLOCK_SIZE), StatePool(2)))


def test_a_checkpoint_taken_by_an_aligned_chunk_is_stored_and_served_alike(make_llm):
    llm = make_llm(kv_offload="host", kda_checkpoint_mode="align")
    firsts = first_turns()[2:3]
    llm.generate(firsts, [greedy(2)])
    llm.engine.scheduler.prefix_cache.clear()
    (out,) = llm.generate(second_turns(first_turns())[2:3], [greedy(4)])
    (want,) = make_llm(enable_prefix_caching=False).generate(second_turns(first_turns())[2:3], [greedy(4)])
    assert out.num_cached_tokens == unit_tokens(firsts[0]) and out.outputs[0].token_ids == want.outputs[0].token_ids
    assert_host_empty(llm)
