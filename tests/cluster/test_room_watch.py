"""`RoomWatch` (cluster/room_watch.py): when a decode replica counts as unable to admit work, on its stats as the
router's refreshes see them, with a clock the test advances."""

from __future__ import annotations

import pytest

from k3serve.cluster.room_watch import RoomWatch
from k3serve.engine.outputs import EngineStats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stats(free_slots: int = 0, free_blocks: int = 10, reserved: int = 2, running: int = 0) -> EngineStats:
    return EngineStats(num_running=running, num_waiting=0, num_free_blocks=free_blocks, num_free_slots=free_slots,
                       block_usage=0.5, slot_usage=1.0 if free_slots == 0 else 0.5, num_reserved=reserved)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def watch(clock: Clock) -> RoomWatch:
    return RoomWatch(stall_seconds=10.0, clock=clock)


def test_room_held_by_unmoving_reservations_is_a_stall_after_stall_seconds(watch, clock):
    watch.observe("d0", stats())
    clock.now += 9.9
    watch.observe("d0", stats())
    assert watch.stall("d0") is None
    clock.now += 0.2
    assert watch.stall("d0") == ("d0: no room for 10 s, held by 2 reservations that have not moved "
                                 "(admission_stall_seconds 10)")


def test_no_blocks_is_no_room_too(watch, clock):
    watch.observe("d0", stats(free_slots=3, free_blocks=0))
    clock.now += 11
    assert watch.stall("d0") is not None


@pytest.mark.parametrize("moved", [
    stats(reserved=1),  # a reservation handed off, or freed
    stats(reserved=2, running=1),  # a request began running (another ended, and its room was taken)
])
def test_reservations_that_move_restart_the_clock(watch, clock, moved):
    watch.observe("d0", stats())
    clock.now += 6
    watch.observe("d0", moved)
    clock.now += 6
    assert watch.stall("d0") is None  # 12 s full, but moving 6 s ago
    clock.now += 5
    assert watch.stall("d0") is not None


@pytest.mark.parametrize("clearing", ["room seen", "room held by running requests", "cleared"])
def test_room_running_requests_or_the_router_clear_it(watch, clock, clearing):
    """The router clears a replica when it admits there, and when the replica stops answering."""
    watch.observe("d0", stats())
    clock.now += 11
    assert watch.stall("d0") is not None
    if clearing == "room seen":
        watch.observe("d0", stats(free_slots=1))
    elif clearing == "room held by running requests":
        watch.observe("d0", stats(reserved=0, running=2))
    else:
        watch.clear("d0")
    assert watch.stall("d0") is None
    clock.now += 11
    assert watch.stall("d0") is None  # until refreshes find it held again


def test_replicas_are_watched_apart(watch, clock):
    watch.observe("d0", stats())
    watch.observe("d1", stats(free_slots=1))
    clock.now += 11
    assert watch.stall("d0") is not None and watch.stall("d1") is None


def test_stall_seconds_must_be_positive():
    with pytest.raises(ValueError, match="admission_stall_seconds must be > 0"):
        RoomWatch(stall_seconds=0)
