"""benchmarks/eval_model.py on a micro trained checkpoint: the CPU serving paths (chunked prefill, prefix-cache
hits, TP 2) agree with the fp32 reference within the stated tolerance, and the whole evaluation prints its
tables, a trained drafter's acceptance among them."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm_engine import LLMEngine
from k3serve.model.tokenizer import Tokenizer

from benchmarks.eval_model import (
    PATH_TOLERANCE,
    disagg_check,
    engine_nll,
    function_cases,
    greedy_agreement,
    held_out_windows,
    main,
    path_row,
    position_ppl,
    prefix_cache_check,
    reference_nll,
    tp2_nll,
)
from tools.train.corpus import held_out_sources


def _setup(micro_run) -> tuple[Path, EngineArgs, "torch.Tensor", "torch.Tensor"]:  # noqa: F821
    checkpoint = micro_run[0] / "checkpoint"
    windows = held_out_windows(Tokenizer.from_dir(checkpoint), 48, 96)  # two windows of 48 scored tokens
    args = EngineArgs(model=str(checkpoint), block_size=16, max_model_len=128, max_num_batched_tokens=16)
    return checkpoint, args, windows, reference_nll(checkpoint, windows)


def test_chunked_prefill_and_prefix_cache_hits_agree_with_the_fp32_reference(micro_run) -> None:
    _, args, windows, ref = _setup(micro_run)
    row = path_row("chunked prefill", engine_nll(LLMEngine(args), windows), ref, "cpu")
    assert row.agrees and row.rel_diff < PATH_TOLERANCE["cpu"] and row.max_nll_diff < 1e-4, row
    cached = prefix_cache_check(args, [w.tolist() for w in windows], max_tokens=8)
    assert cached["cached_tokens"] > 0 and cached["tokens_match"] and cached["max_logprob_diff"] < 1e-4, cached
    whole_prompts = EngineArgs(**{**args.__dict__, "max_num_batched_tokens": None})  # the GPU row's comparison
    same = greedy_agreement(args, whole_prompts, [w[:24].tolist() for w in windows], max_tokens=8)
    assert same["mean_tokens_before_divergence"] == 8, same


@pytest.mark.slow
def test_greedy_continuations_through_a_disaggregated_handoff_equal_the_colocated_ones(micro_run) -> None:
    _, args, windows, _ = _setup(micro_run)
    handed_off = disagg_check(args, [w[:40].tolist() for w in windows], max_tokens=8)
    assert handed_off["tokens_match"] and handed_off["max_logprob_diff"] < 1e-4, handed_off


@pytest.mark.slow
def test_a_tp2_engine_agrees_with_the_fp32_reference(micro_run) -> None:
    _, args, windows, ref = _setup(micro_run)
    row = path_row("TP 2", tp2_nll(args, windows), ref, "cpu")
    assert row.agrees and row.max_nll_diff < 1e-4, row


def test_function_cases_end_their_prompt_where_the_body_begins(micro_run) -> None:
    tokenizer = Tokenizer.from_dir(micro_run[0] / "checkpoint")
    files, _ = held_out_sources()
    cases = function_cases(tokenizer, files[:20], count=5, context=64)
    assert len(cases) == 5
    for prompt, body in cases:
        assert 0 < len(prompt) <= 64 and 0 < len(body) <= 48
        assert tokenizer.decode(prompt).endswith("\n") and tokenizer.decode(body).startswith(" ")


def test_position_buckets_double_to_the_window_end() -> None:
    import torch

    buckets = position_ppl(torch.zeros(2, 64), num_buckets=4)
    assert [b for b, _ in buckets] == ["0-8", "8-16", "16-32", "32-64"] and all(p == 1.0 for _, p in buckets)


@pytest.mark.slow
def test_the_whole_evaluation_prints_its_tables(micro_run, micro_draft_run, capsys: pytest.CaptureFixture) -> None:
    checkpoint, drafter = micro_run[0] / "checkpoint", micro_draft_run[0] / "checkpoint"
    rc = main(["--model", str(checkpoint), "--seq-len", "48", "--num-tokens", "96", "--long-context", "128",
               "--functions", "3", "--drafter", str(drafter)])
    text = capsys.readouterr().out
    assert rc == 0, text
    for heading in ("| fp32 reference", "| engine, chunked prefill", "prefix-cache hits", "disaggregated 1P1D",
                    "function bodies", "ppl by position", "planted fact", "| ngram | 4 |", "| eagle | 4 |",
                    "| eagle | 8 |"):
        assert heading in text
