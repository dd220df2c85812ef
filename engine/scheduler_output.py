"""What the scheduler hands the model runner for one step: plain lists and ints, no tensors.

First, the step's offload copies (engine/offload/): prefix units out to their tiers, then units in, each
verified (before anything this step writes a block or slot). Then per sequence the runner does, in this order:

    before the forward   zero_state            -> zero slot_id (recurrent + conv window)
                         copy_state_from_slot  -> copy that checkpoint slot into slot_id
    forward              token_ids at positions num_computed_tokens ..., KV into block_ids,
                         KDA state read from and written back to slot_id;
                         checkpoint_offset >= 0 -> also emit the state after the first
                         checkpoint_offset tokens of this chunk into checkpoint_slot ("in_pass")
    after the forward    copy_state_to_slot    -> copy slot_id into that slot ("align")
                         needs_sample          -> sample one token from the chunk's last position

A verify row (speculative decoding, num_draft_tokens = k > 0) is the last token and k drafts at positions
n..n+k: its KDA slot is read, not written, its 1 + k rows all get logits, and after rejection the runner's
`commit_verified` folds the accepted prefix into the slot; num_computed_tokens then advances by that prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3serve.engine.offload.unit import NO_SLOT, UnitCopy


@dataclass
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # [num_scheduled_tokens] tokens computed this step
    num_computed_tokens: int  # position of token_ids[0]
    block_ids: list[int]  # [ceil((num_computed_tokens + num_scheduled_tokens) / block_size)] full table
    slot_id: int  # KDA working slot
    is_prefill: bool  # False: one token after a fully computed context (a decode)
    needs_sample: bool  # the chunk reaches the last known token
    checkpoint_offset: int = -1  # in (0, num_scheduled_tokens]: emit state after that many tokens
    checkpoint_slot: int = NO_SLOT  # where the in-pass checkpoint goes
    copy_state_from_slot: int = NO_SLOT  # prefix hit: resume from this checkpoint
    copy_state_to_slot: int = NO_SLOT  # align mode: the chunk ends at the boundary
    zero_state: bool = False  # fresh slot, no prefix hit
    num_draft_tokens: int = 0  # a verify row: token_ids = [last token] + drafts; slot read, committed after rejection

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)  # [num_seqs] decodes first, then prefills
    num_batched_tokens: int = 0  # sum of num_scheduled_tokens
    token_budget: int = 0  # the adaptive budget this step was scheduled under
    preempted_request_ids: list[str] = field(default_factory=list)  # [num_preempted] this step
    finished_request_ids: list[str] = field(default_factory=list)  # freed since the last step
    offload_stores: list[UnitCopy] = field(default_factory=list)  # prefix units copied out first, before anything
    offload_loads: list[UnitCopy] = field(default_factory=list)  # then units copied in (engine/offload/)

    @property
    def num_decodes(self) -> int:
        return sum(1 for seq in self.seqs if not seq.is_prefill)

    @property
    def is_empty(self) -> bool:
        return not (self.seqs or self.offload_stores or self.offload_loads)
