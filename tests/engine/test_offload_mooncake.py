"""The Mooncake Store tier on the real engine and a real store on loopback (`mooncake_master` with its HTTP metadata
server, started as the package documents): a unit one replica put is a hit on another, exactly; a corrupted object,
one removed between lookup and get (its lease gone mid-read), a store that is down or frozen: each a miss, exact."""

from __future__ import annotations

import json
import time

import pytest

from k3serve.engine.sampling_params import SamplingParams

from _llm_harness import BLOCK_SIZE, make_llm, random_prompt  # noqa: F401 (fixture)
from _mooncake_master import Master

pytest.importorskip("mooncake.store")
pytestmark = pytest.mark.slow  # a real store server a test
@pytest.fixture
def store(tmp_path):
    master = Master(tmp_path)
    yield master
    master.stop()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def turns(num: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    import torch

    gen = torch.Generator().manual_seed(31)
    firsts = [random_prompt(gen, n) for n in (130, 257, 64 * 4 + 9)[:num]]
    return firsts, [p + random_prompt(gen, 12) for p in firsts]


def unit_tokens(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture
def replicas(make_llm, store):
    """Two engines on one store (A puts, B gets) and one with no cache at all; each store client closed after."""
    a, b = (make_llm(kv_offload="mooncake", kv_offload_mooncake_config=store.config) for _ in range(2))
    plain = make_llm(enable_prefix_caching=False)
    yield store, a, b, plain
    store.thaw()  # the clients leave a store that answers (a client closing on a dead one retries for long)
    for llm in (a, b):
        llm.engine.runner.close_offload()


def test_a_unit_one_replica_put_is_a_hit_on_another(replicas):
    _, a, b, plain = replicas
    firsts, seconds = turns()
    a.generate(firsts, [greedy(2)] * len(firsts))
    outs = b.generate(seconds, [greedy(6)] * len(seconds))
    assert [o.num_cached_tokens for o in outs] == [unit_tokens(p) for p in firsts]
    want = plain.generate(seconds, [greedy(6)] * len(seconds))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    counts = b.engine.offload.counts["mooncake"]
    assert counts.hits == sum(map(unit_tokens, firsts)) and counts.misses == 0 and counts.bytes_in > 0
    assert a.engine.offload.counts["mooncake"].bytes_out > 0


def object_name(llm, prompt: list[int]) -> str:
    from k3serve.engine.block_pool import compute_block_hashes
    from k3serve.engine.offload.unit import unit_name

    data = llm.engine.runner.offload["mooncake"]
    boundary = compute_block_hashes(prompt[: unit_tokens(prompt)], BLOCK_SIZE)[-1]
    return unit_name(data.compat_hash, boundary, 1, 0)


def assert_exact_misses(b, plain, seconds: list[list[int]], num_misses: int) -> None:
    outs = b.generate(seconds, [greedy(6)] * len(seconds))
    assert [o.num_cached_tokens for o in outs] == [0] * len(seconds)
    want = plain.generate(seconds, [greedy(6)] * len(seconds))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert b.engine.offload.counts["mooncake"].misses == num_misses


def test_a_corrupted_object_is_a_miss(replicas):
    _, a, b, plain = replicas
    firsts, seconds = turns(2)
    a.generate(firsts, [greedy(2)] * 2)
    store = a.engine.runner.offload["mooncake"].client.store
    for prompt in firsts:
        name = object_name(a, prompt)
        value = bytearray(store.get(name))
        value[-5] ^= 0x40  # one bit of the KDA state's last bytes (the size still fits)
        assert store.remove(name, True) == 0 and store.put(name, bytes(value)) == 0
    assert_exact_misses(b, plain, seconds, num_misses=2)


def test_an_object_gone_between_lookup_and_get_is_a_miss(replicas):
    """The lease that kept the object ran out mid-read: it is gone when the runner gets it."""
    _, a, b, plain = replicas
    firsts, seconds = turns(1)
    a.generate(firsts, [greedy(2)])
    data = b.engine.runner.offload["mooncake"]
    load = data.load

    def expire_then_load(op, device):
        assert data.client.store.remove(object_name(a, firsts[0]), True) == 0
        return load(op, device)

    data.load = expire_then_load
    assert_exact_misses(b, plain, seconds, num_misses=1)


@pytest.mark.parametrize("fault", ["down", "frozen"])
def test_a_store_that_is_down_or_frozen_is_a_miss_within_its_timeout(replicas, fault):
    master, a, b, plain = replicas
    firsts, seconds = turns(2)
    a.generate(firsts, [greedy(2)] * 2)
    master.kill() if fault == "down" else master.freeze()
    started = time.monotonic()
    assert_exact_misses(b, plain, seconds, num_misses=0)  # the lookups fail: no load begins, nothing to miss
    assert time.monotonic() - started < 10
    assert b.engine.offload.counts["mooncake"].queries > 0


def test_a_malformed_object_is_refused_before_anything_lands():
    from k3serve.engine.offload.mooncake_tier import _HEADER, _parse

    def obj(header, payload: bytes = b"\0" * 12) -> bytes:
        text = json.dumps(header).encode()
        return _HEADER.pack(len(text)) + text + payload

    good = {"blocks": ["a", "b"], "slot": "c", "num_blocks": 2}
    assert _parse(obj(good), 2, 4, 4) is not None
    for bad in (obj(good, b"\0" * 11), obj({**good, "slot": 1}), obj({**good, "blocks": ["a"]}),
                obj({k: v for k, v in good.items() if k != "slot"}), obj([1, 2]), b"", b"\x05\0\0\0\0\0\0\0{", None):
        assert _parse(bad, 2, 4, 4) is None, bad
