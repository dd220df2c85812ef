"""How many tokens one forward pass may schedule: the adaptive token budget (pure functions).

With at most `max_running_to_scale` requests decoding:

    need   = num_running                     (one token per decode)
           + the leading waiting prompts, in scheduling order, that fit whole in max_budget
    budget = clamp(need, base_budget, max_budget)

and `max_budget` if not even the first waiting prompt fits whole; with more running requests, or nothing
waiting, `base_budget` (`max_num_batched_tokens`, which bounds how long a prefill chunk stalls the decodes
beside it). `max_budget` is what the memory plan sizes one step's activations for; `max_budget == base_budget`
gives the static budget. Why (few decodes gain nothing from split prompts): docs/design/token_budget.md.
"""

from __future__ import annotations

from collections.abc import Sequence

GIB = 1 << 30
HIGH_MEMORY_BYTES = 80 * GIB
HIGH_MEMORY_TOKEN_BUDGET = 16384
DEFAULT_TOKEN_BUDGET = 8192
DEFAULT_MAX_RUNNING_TO_SCALE = 16


def scheduled_token_budget(
    base_budget: int,
    max_budget: int,
    num_running: int,
    waiting_prompt_lens: Sequence[int],
    *,
    max_running_to_scale: int = DEFAULT_MAX_RUNNING_TO_SCALE,
) -> int:
    """Token budget for the next step.

    num_running: requests decoding this step (one token each).
    waiting_prompt_lens: tokens still to prefill per request, in the order the scheduler will
        take them (running mid-prefill requests first, then the waiting queue).
    """
    if not 1 <= base_budget <= max_budget:
        raise ValueError(f"need 1 <= base_budget <= max_budget, got base_budget={base_budget}, max_budget={max_budget}")
    if num_running > max_running_to_scale or not waiting_prompt_lens:
        return base_budget
    need = num_running
    num_whole_prompts = 0
    for prompt_len in waiting_prompt_lens:
        if need + prompt_len > max_budget:
            break
        need += prompt_len
        num_whole_prompts += 1
    if num_whole_prompts == 0:  # the first prompt is split anyway: fewest passes
        return max_budget
    return max(base_budget, need)


def default_token_budget(device_memory_bytes: int | None) -> int:
    """Base budget: 16384 on GPUs with >= 80 GiB (H100/H200/B200 class), else 8192."""
    if device_memory_bytes is not None and device_memory_bytes >= HIGH_MEMORY_BYTES:
        return HIGH_MEMORY_TOKEN_BUDGET
    return DEFAULT_TOKEN_BUDGET
