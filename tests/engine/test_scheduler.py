"""The scheduler, driven with hand-written sampled tokens (no model).

Fixtures (conftest.py): `make_scheduler(num_blocks, num_slots, **EngineArgs)` builds a real
Scheduler over real pools and checks after the test that nothing is left referenced or pinned;
`h` holds the helpers `request`, `step`, `run_to_completion`, `chunk_lens`.
"""

import random
import zlib
from dataclasses import replace

import pytest

from k3serve.engine.config import EngineArgs
from k3serve.engine.memory import scheduler_config
from k3serve.engine.request import Request, RequestStatus
from k3serve.engine.sampling_params import SamplingParams

STATIC_1024 = dict(max_num_batched_tokens=1024, max_adaptive_batched_tokens=1024)
SMALL = dict(block_size=4, max_num_batched_tokens=64, max_adaptive_batched_tokens=64, enable_prefix_caching=False)


# ---- chunked prefill and mixed batches ---------------------------------------------------------
def test_chunked_prefill_splits_a_long_prompt_by_the_budget(make_scheduler, h):
    s = make_scheduler(**STATIC_1024)
    s.add_request(h.request("long", 2500, max_tokens=1))
    chunks = [h.step(s)[0].seqs[0] for _ in range(3)]
    assert [c.num_scheduled_tokens for c in chunks] == [1024, 1024, 452]
    assert [c.num_computed_tokens for c in chunks] == [0, 1024, 2048]
    assert [c.needs_sample for c in chunks] == [False, False, True]
    assert [c.zero_state for c in chunks] == [True, False, False]  # the fresh slot is zeroed once
    assert len({c.slot_id for c in chunks}) == 1
    assert len(chunks[-1].block_ids) == 2500 // 64 + 1
    assert not s.has_unfinished()


def test_long_prefill_token_threshold_caps_each_request(make_scheduler, h):
    s = make_scheduler(long_prefill_token_threshold=512)
    s.add_request(h.request("a", 2000, max_tokens=1))
    s.add_request(h.request("b", 2000, max_tokens=1))
    assert h.chunk_lens(h.step(s)[0]) == {"a": 512, "b": 512}
    h.run_to_completion(s)


def test_mixed_batch_puts_decodes_first(make_scheduler, h):
    s = make_scheduler(**STATIC_1024)
    s.add_request(h.request("old", 10, max_tokens=5))
    s.add_request(h.request("long", 1500, max_tokens=1))
    h.step(s)  # "old" prefilled whole (10), "long" got a 1014-token chunk
    s.add_request(h.request("new", 10, max_tokens=5))
    out, _ = h.step(s)
    assert [(q.request_id, q.is_prefill) for q in out.seqs] == [
        ("old", False),
        ("long", True),
        ("new", True),
    ]
    assert out.num_decodes == 1
    assert out.num_batched_tokens == sum(q.num_scheduled_tokens for q in out.seqs) <= out.token_budget
    h.run_to_completion(s)


def test_a_decode_is_one_token_after_a_fully_computed_context(make_scheduler, h):
    s = make_scheduler()
    s.add_request(h.request("r", 10, max_tokens=3))
    h.step(s, token_id=7)
    out, _ = h.step(s, token_id=8)
    [seq] = out.seqs
    assert (seq.token_ids, seq.num_computed_tokens, seq.needs_sample, seq.is_prefill) == ([7], 10, True, False)
    assert not seq.zero_state and seq.copy_state_from_slot == -1
    _, [done] = h.step(s, token_id=9)
    assert done.output_token_ids == [7, 8, 9] and done.finish_reason == "length"


# ---- adaptive budget ---------------------------------------------------------------------------
@pytest.mark.parametrize("adaptive", [False, True], ids=["static8192", "adaptive"])
def test_adaptive_budget_keeps_8000_token_prompts_whole(make_scheduler, h, adaptive):
    s = make_scheduler(max_num_batched_tokens=8192, max_adaptive_batched_tokens=16384 if adaptive else 8192)
    s.add_request(h.request("chat", 100, max_tokens=20))
    h.step(s)  # "chat" is decoding: concurrency 1
    s.add_request(h.request("a", 8000, max_tokens=1))
    s.add_request(h.request("b", 8000, max_tokens=1))
    out, _ = h.step(s)
    if adaptive:
        assert h.chunk_lens(out) == {"chat": 1, "a": 8000, "b": 8000} and out.token_budget == 16001
    else:  # the static budget leaves "b" a 191-token chunk and a second pass
        assert h.chunk_lens(out) == {"chat": 1, "a": 8000, "b": 191}
    h.run_to_completion(s)


@pytest.mark.parametrize("adaptive", [False, True], ids=["static8192", "adaptive"])
def test_adaptive_budget_keeps_an_8k_prompt_next_to_one_decode_whole(make_scheduler, h, adaptive):
    s = make_scheduler(max_num_batched_tokens=8192, max_adaptive_batched_tokens=16384 if adaptive else 8192)
    s.add_request(h.request("chat", 100, max_tokens=20))
    h.step(s)
    s.add_request(h.request("a", 8192, max_tokens=1))
    out, _ = h.step(s)
    assert h.chunk_lens(out)["a"] == (8192 if adaptive else 8191)
    h.run_to_completion(s)


def test_budget_falls_back_to_base_with_many_running(make_scheduler, h):
    s = make_scheduler(max_num_seqs=32, max_num_batched_tokens=8192, max_running_to_scale=4)
    for i in range(5):
        s.add_request(h.request(f"d{i}", 10, max_tokens=10))
    h.step(s)
    s.add_request(h.request("big", 9000, max_tokens=1))
    out, _ = h.step(s)
    assert out.token_budget == 8192 and h.chunk_lens(out)["big"] == 8192 - 5
    h.run_to_completion(s)


# ---- KDA checkpoints ---------------------------------------------------------------------------
@pytest.mark.parametrize("block_size, boundary", [(64, 7936), (512, 7680)])
def test_in_pass_checkpoint_offset_without_splitting_the_chunk(make_scheduler, h, block_size, boundary):
    # boundary = ((8000 - 1) // block_size) * block_size: the last block boundary below the end
    s = make_scheduler(block_size=block_size, max_num_batched_tokens=4096, max_adaptive_batched_tokens=4096)
    s.add_request(h.request("r", 8000, max_tokens=1))
    first, _ = h.step(s)
    assert first.seqs[0].checkpoint_offset == -1  # [0, 4096) does not reach the boundary
    second, _ = h.step(s)
    [seq] = second.seqs
    assert seq.num_scheduled_tokens == 8000 - 4096  # not split at the boundary
    assert seq.checkpoint_offset == boundary - seq.num_computed_tokens == boundary - 4096
    assert seq.checkpoint_slot not in (-1, seq.slot_id) and seq.copy_state_to_slot == -1
    assert s.state_pool.num_cached == 1  # the checkpoint outlives the request, reusable


def test_in_pass_checkpoint_in_a_single_pass(make_scheduler, h):
    s = make_scheduler()
    s.add_request(h.request("r", 8000, max_tokens=1))
    [seq] = h.step(s)[0].seqs
    assert (seq.num_scheduled_tokens, seq.checkpoint_offset) == (8000, 7936)


def test_align_mode_clips_the_chunk_at_the_boundary(make_scheduler, h):
    s = make_scheduler(kda_checkpoint_mode="align")
    s.add_request(h.request("r", 8000, max_tokens=1))
    out, _ = h.step(s)
    [seq] = out.seqs
    assert seq.num_scheduled_tokens == 7936 and not seq.needs_sample
    assert seq.copy_state_to_slot not in (-1, seq.slot_id) and seq.checkpoint_offset == -1
    [tail] = h.step(s)[0].seqs
    assert (tail.num_computed_tokens, tail.num_scheduled_tokens, tail.needs_sample) == (7936, 64, True)
    assert tail.copy_state_to_slot == -1


def test_no_checkpoints_without_prefix_caching_or_in_mode_none(make_scheduler, h):
    for config in (dict(enable_prefix_caching=False), dict(kda_checkpoint_mode="none")):
        s = make_scheduler(**config)
        s.add_request(h.request("r", 8000, max_tokens=1))
        [seq] = h.step(s)[0].seqs
        assert seq.num_scheduled_tokens == 8000 and seq.checkpoint_offset == -1 and seq.copy_state_to_slot == -1
        assert s.state_pool.num_cached == 0


# ---- prefix caching ----------------------------------------------------------------------------
def test_second_request_with_the_same_prefix_resumes_from_the_checkpoint(make_scheduler, h):
    s = make_scheduler()
    first = h.request("first", 8000, max_tokens=3)
    s.add_request(first)
    [seq] = h.step(s)[0].seqs
    checkpoint_slot = seq.checkpoint_slot
    second = Request("second", first.prompt_token_ids[:7936] + list(range(500)), SamplingParams(max_tokens=2))
    s.add_request(second)
    out, _ = h.step(s)
    decode, hit = out.seqs
    assert decode.request_id == "first" and hit.request_id == "second"
    assert hit.num_computed_tokens == 7936 == second.num_cached_tokens
    assert hit.token_ids == second.prompt_token_ids[7936:]
    assert hit.copy_state_from_slot == checkpoint_slot and not hit.zero_state
    assert hit.block_ids[:124] == first.block_ids[:124]
    assert all(s.block_pool.ref_count(b) == 2 for b in first.block_ids[:124])
    assert hit.checkpoint_offset == 8384 - 7936  # its own last boundary, (8435 // 64) * 64
    h.run_to_completion(s)


def test_identical_prompt_hits_below_its_end(make_scheduler, h):
    s = make_scheduler()
    prompt = h.request("x", 8000).prompt_token_ids
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=1)))
    h.run_to_completion(s)
    s.add_request(Request("b", prompt, SamplingParams(max_tokens=1)))
    [seq] = h.step(s)[0].seqs
    assert (seq.num_computed_tokens, seq.num_scheduled_tokens, seq.needs_sample) == (7936, 64, True)
    assert seq.checkpoint_offset == -1  # the boundary is already cached


def test_align_checkpoint_is_reused_by_the_next_request(make_scheduler, h):
    s = make_scheduler(kda_checkpoint_mode="align")
    prompt = h.request("x", 1000).prompt_token_ids
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=1)))
    [seq] = h.step(s)[0].seqs
    h.run_to_completion(s)
    s.add_request(Request("b", prompt + [1, 2, 3], SamplingParams(max_tokens=1)))
    [hit] = h.step(s)[0].seqs
    assert hit.num_computed_tokens == 960 and hit.copy_state_from_slot == seq.copy_state_to_slot


def test_a_hit_is_not_evicted_by_its_own_allocation(make_scheduler, h):
    # 2 slots: after "a" finishes, one holds the cached checkpoint. Admitting "b" needs a working
    # slot; the held hit must not be the one handed out.
    s = make_scheduler(num_slots=2)
    prompt = h.request("x", 200).prompt_token_ids
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=1)))
    h.run_to_completion(s)
    s.add_request(Request("b", prompt + [5], SamplingParams(max_tokens=1)))
    [seq] = h.step(s)[0].seqs
    assert seq.copy_state_from_slot != seq.slot_id and seq.num_computed_tokens == 192


# ---- preemption --------------------------------------------------------------------------------
def test_preemption_takes_the_latest_arrival_and_it_later_completes(make_scheduler, h):
    # 6 blocks of 4 tokens. a (8 tokens), b and c (5 each) fill them; a's first decode needs a 7th.
    s = make_scheduler(num_blocks=6, max_model_len=24, **SMALL)
    for rid, n in (("a", 8), ("b", 5), ("c", 5)):
        s.add_request(h.request(rid, n, max_tokens=8))
    h.step(s)
    assert s.block_pool.num_free_blocks == 0
    c = s.requests["c"]
    out, _ = h.step(s)
    assert out.preempted_request_ids == ["c"]  # not b: c arrived last
    assert [q.request_id for q in out.seqs] == ["a", "b"]
    assert c.status is RequestStatus.PREEMPTED and s.waiting[0] is c
    assert (c.num_computed_tokens, c.block_ids, c.slot_id) == (0, [], None)

    readmitted = None
    while s.has_unfinished():
        out, _ = h.step(s)
        readmitted = readmitted or next((q for q in out.seqs if q.request_id == "c"), None)
    assert readmitted.zero_state and readmitted.num_computed_tokens == 0
    assert len(readmitted.token_ids) >= 6  # prompt and the output sampled before preemption
    assert c.num_preemptions >= 1 and c.finish_reason == "length" and len(c.output_token_ids) == 8


def test_running_request_preempts_itself_when_it_is_the_latest(make_scheduler, h):
    s = make_scheduler(num_blocks=6, max_model_len=24, **SMALL)
    s.add_request(h.request("a", 4, max_tokens=20))
    s.add_request(h.request("b", 20, max_tokens=4))  # 5 blocks
    h.step(s)
    out, _ = h.step(s)  # b needs a 7th block for token 20: it is the latest, so it goes
    assert out.preempted_request_ids == ["b"] and h.chunk_lens(out) == {"a": 1}
    h.run_to_completion(s)


# ---- FCFS, no starvation -----------------------------------------------------------------------
def test_fcfs_admission_under_a_stream_of_requests(make_scheduler, h):
    s = make_scheduler(num_blocks=64, max_num_seqs=2, max_model_len=64, **SMALL)
    first_scheduled: dict[str, int] = {}
    for t in range(400):
        if t < 40:  # one arrival per step: faster than two slots can serve
            s.add_request(h.request(f"r{t:02d}", 10, max_tokens=5))
        out, _ = h.step(s)
        for q in out.seqs:
            first_scheduled.setdefault(q.request_id, t)
        if not s.has_unfinished():
            break
    assert not s.has_unfinished()
    assert list(first_scheduled) == sorted(first_scheduled)  # admitted in arrival order
    assert len(first_scheduled) == 40


def test_a_big_waiting_head_is_not_overtaken_by_small_later_requests(make_scheduler, h):
    s = make_scheduler(num_blocks=16, max_model_len=64, **SMALL)
    s.add_request(h.request("running", 32, max_tokens=6))  # 8 blocks, growing to 10
    h.step(s)
    s.add_request(h.request("big", 40, max_tokens=1))  # needs 10 blocks: does not fit yet
    s.add_request(h.request("small", 4, max_tokens=1))  # would fit, but waits its turn
    order = []
    while s.has_unfinished():
        out, _ = h.step(s)
        order += [q.request_id for q in out.seqs if q.request_id != "running" and q.request_id not in order]
    assert order == ["big", "small"]


# ---- stopping ----------------------------------------------------------------------------------
def test_eos_stops_unless_ignored(make_scheduler, h):
    s = make_scheduler(eos_token_id=2)
    s.add_request(h.request("stops", 10, max_tokens=5))
    s.add_request(h.request("ignores", 10, max_tokens=3, ignore_eos=True))
    s.add_request(h.request("min", 10, max_tokens=5, min_tokens=2))
    _, finished = h.step(s, token_id=2)
    assert [(r.request_id, r.status, r.finish_reason) for r in finished] == [
        ("stops", RequestStatus.FINISHED_STOPPED, "stop")
    ]
    _, finished = h.step(s, token_id=2)
    assert [(r.request_id, r.finish_reason) for r in finished] == [("min", "stop")]  # its 2nd token
    _, finished = h.step(s, token_id=2)
    assert [(r.request_id, r.finish_reason, r.output_token_ids) for r in finished] == [("ignores", "length", [2, 2, 2])]
    assert s.requests == {}


def test_stop_token_ids_and_max_model_len(make_scheduler, h):
    s = make_scheduler(max_model_len=1024)
    s.add_request(h.request("stop", 10, max_tokens=None, stop_token_ids=[7]))
    s.add_request(h.request("long", 1022, max_tokens=None))
    _, finished = h.step(s, token_id=7)
    assert [(r.request_id, r.finish_reason) for r in finished] == [("stop", "stop")]
    _, finished = h.step(s, token_id=7)
    assert [(r.request_id, r.finish_reason, r.num_tokens) for r in finished] == [("long", "length", 1024)]


def test_stop_string_found_by_the_detokenizer(make_scheduler, h):
    s = make_scheduler()
    s.add_request(h.request("r", 10, max_tokens=50))
    h.step(s)
    done = s.finish_request("r", "stop")
    assert done.status is RequestStatus.FINISHED_STOPPED and done.finish_reason == "stop"
    assert h.step(s)[0].finished_request_ids == ["r"]


# ---- aborts ------------------------------------------------------------------------------------
def test_abort_waiting_mid_prefill_and_mid_decode(make_scheduler, h):
    s = make_scheduler(**STATIC_1024)
    s.add_request(h.request("prefill", 3000, max_tokens=5))
    s.add_request(h.request("decode", 10, max_tokens=5))
    h.step(s)  # "prefill" took the whole budget: "decode" still waits
    s.add_request(h.request("waiting", 10, max_tokens=5))
    assert s.requests["prefill"].num_computed_tokens == 1024
    for rid in ("prefill", "waiting"):
        assert s.finish_request(rid).finish_reason == "abort"
    out, _ = h.step(s)
    assert out.finished_request_ids == ["prefill", "waiting"] and h.chunk_lens(out) == {"decode": 10}
    h.step(s)
    aborted = s.finish_request("decode")
    assert aborted.status is RequestStatus.FINISHED_ABORTED and aborted.block_ids == [] and aborted.slot_id is None
    assert s.finish_request("decode") is None  # idempotent
    with pytest.raises(ValueError, match="reason must be one of"):
        s.finish_request("x", "timeout")


def test_output_of_an_aborted_request_is_ignored(make_scheduler, h):
    s = make_scheduler()
    s.add_request(h.request("r", 100))
    out = s.schedule()
    s.finish_request("r")
    assert s.update_from_output(out, {"r": 1}) == []


def test_abort_during_a_checkpointing_step_releases_the_checkpoint_slot(make_scheduler, h):
    s = make_scheduler()
    s.add_request(h.request("r", 8000))
    out = s.schedule()
    assert out.seqs[0].checkpoint_slot >= 0
    s.finish_request("r")
    assert s.state_pool.num_used == 0 and s.state_pool.num_cached == 0


# ---- pins --------------------------------------------------------------------------------------
def test_pinned_blocks_and_slot_outlive_the_request_until_unpinned(make_scheduler, h):
    s = make_scheduler(num_blocks=8, num_slots=2, max_model_len=32, **SMALL)
    s.add_request(h.request("handoff", 10, max_tokens=1))
    out = s.schedule()
    [seq] = out.seqs
    s.block_pool.pin(seq.block_ids)  # the transfer layer starts writing KV + boundary state
    s.state_pool.pin(seq.slot_id)
    [done] = s.update_from_output(out, {"handoff": 1})
    assert done.is_finished and s.block_pool.num_used == 3 and s.state_pool.num_used == 1

    s.add_request(h.request("b", 20, max_tokens=2))
    s.add_request(h.request("c", 4, max_tokens=1))
    out, _ = h.step(s)
    [b] = out.seqs  # "c" has no slot: one is b's, the other is still pinned
    assert set(b.block_ids).isdisjoint(seq.block_ids) and b.slot_id != seq.slot_id

    s.block_pool.unpin(seq.block_ids)  # every rank confirmed its writes
    s.state_pool.unpin(seq.slot_id)
    assert "c" in h.chunk_lens(h.step(s)[0])
    h.run_to_completion(s)


# ---- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_num_seqs=0), "max_num_seqs=0"),
        (dict(max_num_batched_tokens=8, max_num_seqs=16), "max_num_batched_tokens=8 must be >= max_num_seqs=16"),
        (dict(kda_checkpoint_mode="every"), "'every'"),
        (dict(max_adaptive_batched_tokens=100), "max_adaptive_batched_tokens=100"),
        (dict(long_prefill_token_threshold=0), "got 0"),
        (dict(block_size=0), "block_size=0"),
    ],
)
def test_config_errors_quote_the_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        replace(scheduler_config(EngineArgs(), None, None), **kwargs)


def test_the_config_is_the_engine_args_with_their_defaults_resolved():
    """SchedulerConfig has no defaults: an engine's comes from its EngineArgs, the budget from the device."""
    cfg = scheduler_config(EngineArgs(), None, eos_token_id=7)
    assert (cfg.max_num_seqs, cfg.max_model_len, cfg.block_size) == (64, 4096, 64)  # EngineArgs' defaults
    assert (cfg.max_num_batched_tokens, cfg.max_adaptive_batched_tokens) == (8192, 16384)  # no GPU: 8192, 2x
    assert (cfg.enable_prefix_caching, cfg.kda_checkpoint_mode, cfg.eos_token_id) == (True, "in_pass", 7)
    assert scheduler_config(EngineArgs(), 141 << 30, None).max_num_batched_tokens == 16384  # an H200
    args = EngineArgs(max_num_seqs=8, max_num_batched_tokens=512, enable_prefix_caching=False, block_size=16)
    cfg = scheduler_config(args, None, None)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_adaptive_batched_tokens) == (8, 512, 1024)
    assert (cfg.enable_prefix_caching, cfg.block_size) == (False, 16)


def test_requests_are_checked_at_the_door(make_scheduler, h):
    s = make_scheduler(max_model_len=1024)
    with pytest.raises(ValueError, match="more than max_model_len=1024"):
        s.add_request(h.request("huge", 1025))
    s.add_request(h.request("r", 10, max_tokens=1))
    with pytest.raises(ValueError, match="duplicate request_id 'r'"):
        s.add_request(h.request("r", 10))
    with pytest.raises(ValueError, match="num_blocks=8 cannot hold one request"):
        make_scheduler(num_blocks=8, max_model_len=1024)
    h.run_to_completion(s)


# ---- the invariant, against a fake runner ------------------------------------------------------
class FakeRunner:
    """Executes SchedulerOutputs on fake caches: a KDA "state" is the tuple of tokens it has
    absorbed, an MLA block holds the tokens written into it. A model that samples from the state
    then gives the same tokens as an uninterrupted run iff every state advanced once per token."""

    def __init__(self, scheduler):
        self.s = scheduler
        self.state: dict[int, tuple[int, ...]] = {}
        self.kv: dict[int, list[int | None]] = {}

    def execute(self, output) -> dict[str, int]:
        bs = self.s.config.block_size
        sampled = {}
        for seq in output.seqs:
            req = self.s.requests[seq.request_id]
            if seq.zero_state:
                self.state[seq.slot_id] = ()
            if seq.copy_state_from_slot >= 0:
                self.state[seq.slot_id] = self.state[seq.copy_state_from_slot]
            state = self.state[seq.slot_id]
            start = seq.num_computed_tokens
            assert state == tuple(req.all_token_ids[:start]), "KDA state does not match the context"
            context = [self.kv[seq.block_ids[p // bs]][p % bs] for p in range(start)]
            assert context == req.all_token_ids[:start], "MLA blocks do not hold the context"
            for i, token in enumerate(seq.token_ids):
                block = seq.block_ids[(start + i) // bs]
                assert self.s.block_pool.ref_count(block) == 1, "writing into a shared block"
                self.kv.setdefault(block, [None] * bs)[(start + i) % bs] = token
                state += (token,)
                if seq.checkpoint_offset == i + 1:
                    self.state[seq.checkpoint_slot] = state
            self.state[seq.slot_id] = state
            if seq.copy_state_to_slot >= 0:
                self.state[seq.copy_state_to_slot] = state
            if seq.needs_sample:
                sampled[seq.request_id] = model(state)
        return sampled


def model(state: tuple[int, ...]) -> int:
    return zlib.crc32(repr(state).encode()) % 40


def uninterrupted(prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens:
        tokens.append(model(tuple(tokens)))
        if tokens[-1] == eos:
            break
    return tokens[len(prompt) :]


@pytest.mark.parametrize("mode", ["in_pass", "align", "none"])
@pytest.mark.parametrize("seed", range(6))
def test_every_token_is_computed_once_under_preemption_chunking_and_prefix_hits(make_scheduler, seed, mode):
    rng = random.Random(seed)
    s = make_scheduler(
        num_blocks=16, num_slots=5, block_size=4, max_num_seqs=4, max_model_len=64,
        max_num_batched_tokens=24, max_adaptive_batched_tokens=48, max_running_to_scale=2,
        kda_checkpoint_mode=mode, eos_token_id=0, long_prefill_token_threshold=rng.choice([None, 9]),
    )  # fmt: skip
    runner = FakeRunner(s)
    roots = [[rng.randrange(1, 40) for _ in range(40)] for _ in range(3)]
    expected, requests, num_preempted, num_hits = {}, [], 0, 0
    for t in range(2000):
        if t < 60 and rng.random() < 0.5:
            prompt = rng.choice(roots)[: rng.randrange(1, 40)] + [rng.randrange(1, 40) for _ in range(rng.randrange(0, 8))]
            req = Request(f"r{t}", prompt, SamplingParams(max_tokens=rng.randrange(1, 14)))
            expected[req.request_id] = uninterrupted(prompt, req.sampling_params.max_tokens, eos=0)
            requests.append(req)
            s.add_request(req)
        output = s.schedule()
        num_preempted += len(output.preempted_request_ids)
        num_hits += sum(q.copy_state_from_slot >= 0 for q in output.seqs)
        s.update_from_output(output, runner.execute(output))
        if rng.random() < 0.02 and s.requests:
            rid = rng.choice(sorted(s.requests))
            expected[rid] = None
            s.finish_request(rid)
        if t >= 60 and not s.has_unfinished():
            break
    assert not s.has_unfinished()
    for req in requests:
        if expected[req.request_id] is not None:
            assert req.output_token_ids == expected[req.request_id], req.request_id
    assert num_preempted > 0, "the pools are meant to be tight enough to preempt"
    if mode != "none" and seed == 0:
        assert num_hits > 0
