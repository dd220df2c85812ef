"""A fixed workload for the fixed-shape decode tests (CPU and GPU), as the scheduler hands it to the runner:
four requests prefilled in two steps, then decode steps of 4, 3, 2 and 1 sequences. Over the buckets
(2, 8) the decode batches are padded by 4, 5, 0 and 1 rows.

Block tables are out of order and prompts end inside, and on, block boundaries. Every block and request
slot starts as NaN poison (`poison`); prefills zero their slots and write their rows, so whatever else
is read or written shows up.
"""

from __future__ import annotations

import torch

from k3serve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from k3serve.model.batch import ModelCache

NUM_BLOCKS, NUM_SLOTS = 24, 8
MAX_BLOCKS = 6  # the static block-table width: max_model_len = 6 blocks
BUCKETS = (2, 8)
TABLES = {"a": [7, 2, 11], "b": [0, 9, 3], "c": [5, 14, 1], "d": [20, 4, 16, 8]}
SLOTS = {"a": 3, "b": 0, "c": 6, "d": 1}
DECODE_STEPS = ["abcd", "bcd", "ad", "c"]


def prompt_lens(block: int) -> dict[str, int]:
    """b ends on a block boundary (its first decode opens a block); d spans three blocks."""
    return {"a": block - 3, "b": block, "c": 2 * block - 3, "d": 2 * block + 1}


def workload(vocab_size: int, block: int, seed: int = 3) -> list[SchedulerOutput]:
    gen = torch.Generator().manual_seed(seed)
    lens = prompt_lens(block)
    prompts = {n: torch.randint(0, vocab_size, (k,), generator=gen).tolist() for n, k in lens.items()}

    def prefill(name: str) -> ScheduledSeq:
        return ScheduledSeq(name, prompts[name], 0, TABLES[name], SLOTS[name], is_prefill=True, needs_sample=True,
                            zero_state=True)

    steps = [SchedulerOutput([prefill("a"), prefill("b")]), SchedulerOutput([prefill("c"), prefill("d")])]
    for names in DECODE_STEPS:
        seqs = []
        for name in names:
            token = int(torch.randint(0, vocab_size, (1,), generator=gen))
            blocks = TABLES[name][: lens[name] // block + 1]
            seqs.append(ScheduledSeq(name, [token], lens[name], blocks, SLOTS[name], is_prefill=False,
                                     needs_sample=True))
            lens[name] += 1
        steps.append(SchedulerOutput(seqs))
    return steps


def poison(cache: ModelCache) -> None:
    """NaN in every MLA block and every request slot (not the pad slot)."""
    for pool in cache.mla_kv:
        pool.fill_(float("nan"))
    for pool in cache.kda_recurrent + cache.kda_conv:
        pool[:NUM_SLOTS].fill_(float("nan"))


def owned_pools(cache: ModelCache) -> list[torch.Tensor]:
    """Every MLA pool and every KDA pool without the pad slot: the requests' rows and the poison around them."""
    return cache.mla_kv + [pool[:NUM_SLOTS] for pool in cache.kda_recurrent + cache.kda_conv]
