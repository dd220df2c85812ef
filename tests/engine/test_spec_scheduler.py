"""Specification: the scheduler's side of speculative decoding (real pools, no model).

A decode with drafts is one verify row of 1 + k tokens after a fully computed context; drafts never exceed K, nor
what max_tokens, max_model_len and the step's token budget leave room for (all accepted plus the bonus token);
the row costs 1 + k of the budget and holds blocks for every position it writes. After rejection it advances by
the emitted tokens only, appended until the first stop. A request that cannot speculate (a penalty) decodes a
token a step beside it. Finished requests release their drafts' proposer state.
"""

from __future__ import annotations

from k3serve.engine.scheduler import Scheduler
from k3serve.engine.spec.config import SpeculativeConfig
from k3serve.engine.spec.proposer import Speculator

K = 4


class Repeat:
    """Drafts: the last token, as many times as asked (a real DraftProposer, deterministic)."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        return [token_ids[-1]] * max_tokens

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def _speculating(scheduler: Scheduler) -> Repeat:
    proposer = Repeat()
    scheduler.speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=K), proposer)
    return proposer


def _prefill(scheduler: Scheduler, first_token: int = 7) -> None:
    output = scheduler.schedule()
    scheduler.update_from_output(output, {s.request_id: first_token for s in output.seqs if s.needs_sample})


def _step_rejecting_all(scheduler: Scheduler):
    """One step in which every draft is rejected: each row emits token 8."""
    output = scheduler.schedule()
    plain = {s.request_id: 8 for s in output.seqs if s.needs_sample and not s.num_draft_tokens}
    verified = {s.request_id: [8] for s in output.seqs if s.num_draft_tokens}
    scheduler.update_from_output(output, plain, verified_token_ids=verified)
    return output


def test_a_verify_row_is_the_last_token_and_k_drafts_and_advances_by_what_it_emits(make_scheduler, h) -> None:
    scheduler = make_scheduler(block_size=16)
    proposer = _speculating(scheduler)
    scheduler.add_request(h.request("a", 14, max_tokens=20))
    _prefill(scheduler)
    output = scheduler.schedule()
    (seq,) = output.seqs
    assert (seq.token_ids, seq.num_draft_tokens, seq.num_computed_tokens, seq.is_prefill) == ([7] * 5, K, 14, False)
    assert output.num_batched_tokens == 1 + K and len(seq.block_ids) == 2  # positions 14..18 cross a block
    scheduler.update_from_output(output, {}, verified_token_ids={"a": [7, 7, 9]})  # 2 accepted, then 9
    req = scheduler.requests["a"]
    assert (req.num_computed_tokens, req.output_token_ids) == (17, [7, 7, 7, 9])
    assert req.num_tokens - req.num_computed_tokens == 1  # a decode again: the invariant holds
    scheduler.finish_request("a")
    assert proposer.released == ["a"]


def test_drafts_leave_room_for_max_tokens_max_model_len_and_the_budget(make_scheduler, h) -> None:
    scheduler = make_scheduler(block_size=16, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=4,
                               max_adaptive_batched_tokens=4)
    _speculating(scheduler)
    scheduler.add_request(h.request("short", 4, max_tokens=3))
    scheduler.add_request(h.request("long", 58, max_tokens=None))  # until max_model_len 64
    seen = {}
    while scheduler.has_unfinished():
        before = {rid: (r.num_output_tokens, r.num_tokens, r.sampling_params.max_tokens or 64)
                  for rid, r in scheduler.requests.items()}
        output = _step_rejecting_all(scheduler)
        assert output.num_batched_tokens <= 4  # the budget
        for seq in output.seqs:
            num_outputs, num_tokens, max_tokens = before[seq.request_id]
            if seq.num_draft_tokens:  # all accepted + the bonus must fit both limits
                seen[seq.request_id] = True
                assert num_outputs + seq.num_draft_tokens + 1 <= max_tokens
                assert num_tokens + seq.num_draft_tokens + 1 <= 64
    assert seen == {"short": True, "long": True}


def test_a_stop_inside_the_run_truncates_it_and_finishes_the_request(make_scheduler, h) -> None:
    scheduler = make_scheduler(block_size=16, eos_token_id=2)
    _speculating(scheduler)
    scheduler.add_request(h.request("a", 5, max_tokens=20))
    _prefill(scheduler)
    output = scheduler.schedule()
    [done] = scheduler.update_from_output(output, {}, verified_token_ids={"a": [7, 2, 7]})
    assert (done.output_token_ids, done.finish_reason) == ([7, 7, 2], "stop")


def test_a_request_with_penalties_decodes_plainly_beside_a_speculating_one(make_scheduler, h) -> None:
    scheduler = make_scheduler(block_size=16)
    _speculating(scheduler)
    scheduler.add_request(h.request("plain", 5, max_tokens=20, repetition_penalty=1.2))
    scheduler.add_request(h.request("spec", 5, max_tokens=20))
    _prefill(scheduler)
    drafts = {s.request_id: s.num_draft_tokens for s in scheduler.schedule().seqs}
    assert drafts == {"plain": 0, "spec": K}
    for rid in ("plain", "spec"):
        scheduler.finish_request(rid)
