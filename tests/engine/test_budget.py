"""The adaptive scheduled-token budget: scale up when few requests run, so prompts stay whole."""

import pytest

from k3serve.engine.budget import default_token_budget, scheduled_token_budget

GIB = 1 << 30


def test_an_8k_prompt_next_to_one_decode_fits_in_one_pass():
    # static 8192 would split 1 decode + 8192 prompt tokens into two passes
    assert scheduled_token_budget(8192, 16384, num_running=1, waiting_prompt_lens=[8192]) == 8193


def test_several_whole_prompts_when_they_fit():
    assert scheduled_token_budget(8192, 16384, num_running=0, waiting_prompt_lens=[8000, 8000, 8000]) == 16000


def test_never_below_base_and_never_above_max():
    assert scheduled_token_budget(8192, 16384, num_running=2, waiting_prompt_lens=[100]) == 8192
    assert scheduled_token_budget(8192, 16384, num_running=16, waiting_prompt_lens=[16000]) == 16016
    assert scheduled_token_budget(8192, 16384, num_running=0, waiting_prompt_lens=[16384, 1]) == 16384


def test_a_prompt_too_long_for_max_gets_max():
    assert scheduled_token_budget(8192, 16384, num_running=3, waiting_prompt_lens=[50_000]) == 16384


def test_many_running_falls_back_to_base():
    assert scheduled_token_budget(8192, 16384, num_running=17, waiting_prompt_lens=[8192]) == 8192
    assert scheduled_token_budget(8192, 16384, num_running=5, waiting_prompt_lens=[8192], max_running_to_scale=4) == 8192


def test_nothing_waiting_is_base():
    assert scheduled_token_budget(8192, 16384, num_running=1, waiting_prompt_lens=[]) == 8192


def test_equal_base_and_max_is_static():
    for lens in ([8192], [50_000], [10, 20]):
        assert scheduled_token_budget(8192, 8192, num_running=1, waiting_prompt_lens=lens) == 8192


def test_bad_bounds_are_rejected():
    with pytest.raises(ValueError, match="base_budget=9000, max_budget=8192"):
        scheduled_token_budget(9000, 8192, 0, [1])


@pytest.mark.parametrize(
    "memory, budget", [(None, 8192), (24 * GIB, 8192), (79 * GIB, 8192), (80 * GIB, 16384), (141 * GIB, 16384)]
)
def test_default_token_budget(memory, budget):
    assert default_token_budget(memory) == budget
