"""PinManager spec: a request's blocks and slots stay pinned from the moment its writes are posted
until every expected rank confirmed, or it is aborted, its peer is lost, or its lease expires;
every path unpins exactly once, and a pinned block or slot is never handed out again. The pins go
through the handoff seam's `PoolPins` over real pools. Every test ends with empty pools, no lease and
zero pin gauges."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from _transfer_setup import BLOCK_SIZE, byte_equal, close, connect, fill_random_bytes, make_side, tiny_config
from k3serve.engine.block_pool import BlockPool
from k3serve.engine.kv_handoff import PoolPins
from k3serve.engine.state_pool import StatePool
from k3serve.model.batch import ModelCache
from k3serve.transfer.backend import TransferStatus
from k3serve.transfer.local import LocalBackend
from k3serve.transfer.metrics import BoundTransferMetrics
from k3serve.transfer.pins import PinManager
from k3serve.transfer.tp_map import RequestSpan


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Engine:
    blocks: BlockPool
    slots: StatePool
    pins: PinManager
    clock: Clock
    metrics: BoundTransferMetrics
    registry: CollectorRegistry

    def sample(self, name: str, **labels: str) -> float:
        """Current value of metric `k3serve:transfer_{name}` for this engine (0 if never touched)."""
        value = self.registry.get_sample_value(f"k3serve:transfer_{name}", {"model_name": "tiny", "role": "prefill", **labels})
        return value or 0.0

    def start_request(self, num_blocks: int) -> tuple[list[int], int]:
        """A request that owns blocks and a slot, as the scheduler would allocate them."""
        return self.blocks.allocate(num_blocks), self.slots.allocate()

    def finish_request(self, block_ids: list[int], slot_id: int) -> None:
        """The request ends (e.g. prefill done): the owner's refs go, pins keep the state."""
        self.blocks.free(block_ids)
        self.slots.free(slot_id)


@pytest.fixture
def engine(metrics: BoundTransferMetrics, registry: CollectorRegistry) -> Iterator[Engine]:
    clock = Clock()
    blocks, slots = BlockPool(num_blocks=8, block_size=BLOCK_SIZE), StatePool(num_slots=3)
    eng = Engine(blocks, slots, PinManager(PoolPins(blocks, slots), clock=clock, metrics=metrics), clock, metrics, registry)
    yield eng
    assert eng.pins.num_leases == 0 and eng.pins.num_pinned_blocks == 0 and eng.pins.num_pinned_slots == 0
    blocks.check_empty()
    slots.check_empty()
    assert eng.sample("pinned_blocks") == 0 and eng.sample("pinned_slots") == 0


def test_pins_hold_until_every_expected_rank_confirms(engine: Engine) -> None:
    block_ids, slot = engine.start_request(3)
    lease = engine.pins.pin("req-1", block_ids, [slot], expected_ranks={0, 1, 2}, lease_seconds=30, num_bytes=4096)
    engine.finish_request(block_ids, slot)
    assert [engine.blocks.pin_count(b) for b in block_ids] == [1, 1, 1] and engine.slots.pin_count(slot) == 1
    assert engine.blocks.num_free_blocks == 5 and engine.slots.num_free == 2
    assert (engine.sample("pinned_blocks"), engine.sample("pinned_slots")) == (3, 1)

    engine.clock.now += 0.25
    assert engine.pins.confirm("req-1", 2) is False
    assert engine.pins.confirm("req-1", 2) is False  # a repeated confirmation changes nothing
    assert engine.pins.confirm("req-1", 0) is False
    assert lease.missing_ranks == {1}
    assert engine.blocks.num_free_blocks == 5
    assert engine.pins.confirm("req-1", 1) is True  # last one: unpinned and forgotten
    assert engine.pins.lease("req-1") is None
    assert engine.blocks.num_free_blocks == 8 and engine.slots.num_free == 3
    assert engine.pins.confirm("req-1", 1) is False  # late confirmation of a released lease: ignored
    assert engine.sample("seconds_sum") == pytest.approx(0.25)
    assert engine.sample("bytes_total") == 4096


def test_confirmation_from_an_unexpected_rank_is_an_error(engine: Engine) -> None:
    block_ids, slot = engine.start_request(1)
    engine.pins.pin("req", block_ids, [slot], expected_ranks={0}, lease_seconds=5)
    with pytest.raises(ValueError, match="rank 3 is not expected"):
        engine.pins.confirm("req", 3)
    engine.pins.confirm("req", 0)
    engine.finish_request(block_ids, slot)


def test_abort_releases_once(engine: Engine) -> None:
    block_ids, slot = engine.start_request(2)
    engine.pins.pin("req", block_ids, [slot], expected_ranks={0, 1}, lease_seconds=5)
    engine.finish_request(block_ids, slot)
    assert engine.pins.abort("req", reason="client_abort") is True
    assert engine.pins.abort("req", reason="client_abort") is False  # nothing left to unpin
    assert engine.pins.confirm("req", 0) is False
    assert engine.sample("failures_total", reason="client_abort") == 1


def test_expire_releases_leases_past_their_deadline_and_heartbeat_extends(engine: Engine) -> None:
    a_blocks, a_slot = engine.start_request(1)
    b_blocks, b_slot = engine.start_request(1)
    engine.pins.pin("a", a_blocks, [a_slot], {0}, lease_seconds=10)
    engine.pins.pin("b", b_blocks, [b_slot], {0}, lease_seconds=10)
    engine.finish_request(a_blocks, a_slot)
    engine.finish_request(b_blocks, b_slot)

    engine.clock.now += 9
    assert engine.pins.heartbeat("b") is True  # b's deadline moves to now + 10
    assert engine.pins.expire() == []
    engine.clock.now += 1
    assert engine.pins.expire() == ["a"]  # deadline reached
    assert engine.pins.num_expired == 1 and engine.sample("lease_expiries_total") == 1
    assert engine.sample("failures_total", reason="lease_expired") == 1
    assert engine.pins.heartbeat("a") is False  # too late
    assert engine.pins.expire(now=engine.clock.now + 8.5) == []  # b: heartbeat at 1009, deadline 1019
    assert engine.pins.expire(now=engine.clock.now + 9) == ["b"]
    assert engine.pins.num_expired == 2


def test_peer_lost_releases_every_lease_to_that_peer(engine: Engine) -> None:
    owned = {}
    for rid, peers in [("x", {"decode-0"}), ("y", {"decode-1"}), ("z", {"decode-0", "decode-1"})]:
        owned[rid] = engine.start_request(1)
        engine.pins.pin(rid, owned[rid][0], [owned[rid][1]], {0}, lease_seconds=60, peers=peers)
        engine.finish_request(*owned[rid])
    assert sorted(engine.pins.peer_lost("decode-0")) == ["x", "z"]
    assert engine.pins.peer_lost("decode-0") == []
    assert engine.pins.lease("y") is not None
    assert engine.sample("failures_total", reason="peer_lost") == 2
    assert engine.pins.release_all() == 1


def test_a_failed_pin_leaves_nothing_pinned(engine: Engine) -> None:
    block_ids, slot = engine.start_request(2)
    with pytest.raises(ValueError, match="cannot pin slot 2"):
        engine.pins.pin("req", block_ids, [slot, 2], {0}, lease_seconds=5)  # slot 2 was never allocated
    assert [engine.blocks.pin_count(b) for b in block_ids] == [0, 0] and engine.slots.pin_count(slot) == 0
    assert engine.pins.num_leases == 0
    engine.pins.pin("req", block_ids, [slot], {0}, lease_seconds=5)
    with pytest.raises(ValueError, match="already holds"):
        engine.pins.pin("req", block_ids, [slot], {0}, lease_seconds=5)
    engine.pins.abort("req")
    engine.finish_request(block_ids, slot)


class SlowBackend(LocalBackend):
    """A backend whose writes stay PENDING for `num_pending_polls` polls, then land."""

    def __init__(self, num_pending_polls: int) -> None:
        super().__init__(polls_to_complete=num_pending_polls + 1)


def test_pinned_state_is_never_reallocated_while_a_slow_transfer_is_pending(engine: Engine) -> None:
    """The scheduler keeps allocating while the write crawls: it only ever gets other blocks and
    slots, and the bytes that finally land are the request's, untouched."""
    config = tiny_config()
    prefill_cache = ModelCache.allocate(config, num_blocks=8, num_slots=3, block_size=BLOCK_SIZE)
    fill_random_bytes(prefill_cache, seed=7)
    prefill = make_side(config, [prefill_cache], new_backend=lambda: SlowBackend(num_pending_polls=5))
    slow = prefill.backends[0]
    decode = make_side(config, [ModelCache.allocate(config, num_blocks=8, num_slots=3, block_size=BLOCK_SIZE)])
    try:
        mapping = connect(prefill, decode)
        block_ids, slot = engine.start_request(2)
        span = RequestSpan(tuple(block_ids), (4, 5), src_slot=slot, dst_slot=1, num_tokens=2 * BLOCK_SIZE)
        sent = [prefill_cache.mla_kv[0][block_ids].clone(), prefill_cache.kda_recurrent[0][slot].clone()]

        (pair, ops), = mapping.ops(span).items()
        engine.pins.pin("req", block_ids, [slot], expected_ranks=mapping.sending_ranks(), lease_seconds=30,
                        peers={"decode"}, num_bytes=sum(op.length for op in ops))  # fmt: skip
        handle = slow.write(decode.backends[0].endpoint, ops)
        engine.finish_request(block_ids, slot)  # prefill is done with the request; the pins hold

        polls = 0
        while (status := slow.poll(handle)) is TransferStatus.PENDING:
            polls += 1
            others = engine.blocks.allocate(engine.blocks.num_free_blocks)  # every block it can get
            other_slots = [engine.slots.allocate() for _ in range(engine.slots.num_free)]
            assert not set(others) & set(block_ids) and slot not in other_slots
            assert not engine.blocks.can_allocate(1)
            with pytest.raises(RuntimeError, match="all 3 are in use"):
                engine.slots.allocate()
            for b in others:  # the new owner scribbles over its blocks, then frees them
                prefill_cache.mla_kv[0][b].zero_()
            prefill_cache.zero_slots(other_slots)
            engine.blocks.free(others)
            for s in other_slots:
                engine.slots.free(s)
        assert status is TransferStatus.DONE and polls == 5
        slow.release(handle)
        assert engine.pins.confirm("req", pair[0]) is True

        got = decode.caches[0]
        assert byte_equal(got.mla_kv[0][[4, 5]], sent[0]) and byte_equal(got.kda_recurrent[0][1], sent[1])
        assert set(engine.blocks.allocate(8)) == set(range(8))  # unpinned: allocatable again
        engine.blocks.free(list(range(8)))
    finally:
        close(prefill, decode)
