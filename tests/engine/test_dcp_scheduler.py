"""Specification: under decode context parallelism the scheduler counts block ids of `tokens_per_block` tokens (a
page on each DCP rank): the same block pool holds N times the context, prefix hits and KDA checkpoints fall on
those blocks' boundaries, and a pool too small for the running requests still preempts by blocks."""

from __future__ import annotations

DCP4 = dict(tensor_parallel_size=4, decode_context_parallel_size=4, block_size=16)  # blocks of 64 tokens


def test_a_block_id_holds_the_tokens_of_its_ranks_pages(make_scheduler, h):
    s = make_scheduler(num_blocks=16, max_model_len=1024, **DCP4)
    assert s.config.block_size == 64 == s.block_pool.block_size
    s.add_request(h.request("a", 300, max_tokens=2))
    first = h.step(s)[0].seqs[0]
    assert len(first.block_ids) == -(-300 // 64) == 5  # without DCP: 19 blocks of 16
    h.run_to_completion(s)


def test_prefix_hits_fall_on_the_dcp_block_boundary(make_scheduler, h):
    s = make_scheduler(num_blocks=32, max_model_len=1024, **DCP4)
    prompt = list(range(1000, 1200))
    s.add_request(h.request("first", prompt, max_tokens=1))
    h.run_to_completion(s)
    again = h.request("again", prompt + [7, 8, 9], max_tokens=1)
    s.add_request(again)
    h.run_to_completion(s)
    assert again.num_cached_tokens == 192  # the first prompt's checkpoint: 3 blocks of 64 (199 // 64 * 64)


def test_a_pool_of_one_longest_request_preempts_by_blocks(make_scheduler, h):
    s = make_scheduler(num_blocks=4, max_model_len=256, max_num_batched_tokens=64, **DCP4)
    for rid in ("a", "b", "c"):
        s.add_request(h.request(rid, 100, max_tokens=60))
    preempted = 0
    while s.has_unfinished():
        output, _ = h.step(s)
        preempted += len(output.preempted_request_ids)
    assert preempted > 0
