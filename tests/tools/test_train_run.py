"""A micro training run end to end on the CPU (tools/train): the loss falls, the run repeats bit for bit, the
checkpoint it writes serves through the engine at the trainer's own held-out perplexity, and its tokenizer
round-trips code and speaks Kimi's chat format."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm_engine import LLMEngine
from k3serve.model.tokenizer import Tokenizer
from tools.train.corpus import load_corpus
from tools.train.data import eval_windows, token_stream

from _micro_run import MICRO_RUN as RECIPE
from _micro_run import run_micro
from benchmarks.eval_model import engine_nll, ppl


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]


def _digests(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (out / "checkpoint").iterdir()}


def test_the_loss_falls_over_a_micro_run(micro_run) -> None:
    out, results = micro_run
    losses = _losses(out)
    assert len(losses) == RECIPE.steps
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    assert results["val_ppl_checkpoint"] < RECIPE.vocab_size / 2
    assert (out / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_a_second_run_repeats_the_first_bit_for_bit(micro_run, tmp_path: Path) -> None:
    out, results = micro_run
    again = run_micro(tmp_path)
    assert _losses(tmp_path) == _losses(out)
    assert _digests(tmp_path) == _digests(out)
    assert again["held_out_ppl_checkpoint"] == results["held_out_ppl_checkpoint"]


def test_the_checkpoint_serves_the_trainers_held_out_perplexity(micro_run) -> None:
    out, results = micro_run
    tokenizer = Tokenizer.from_dir(out / "checkpoint")
    corpus = load_corpus(RECIPE.val_percent, RECIPE.max_files)
    windows = eval_windows(token_stream(tokenizer, corpus.held_out), RECIPE.seq_len, RECIPE.eval_tokens)
    engine = LLMEngine(EngineArgs(model=str(out / "checkpoint"), max_num_batched_tokens=24, max_model_len=256))
    served = ppl(engine_nll(engine, windows))  # chunked prefill, prompt logprobs
    assert math.isclose(served, results["held_out_ppl_checkpoint"], rel_tol=1e-4)
    # beside it: the unquantised experts' perplexity, and both where QAT began (post-training quantisation's cost)
    assert results["held_out_ppl_dense_experts"] > 1
    assert results["before_qat"]["step"] == RECIPE.steps - RECIPE.qat_steps
    assert results["before_qat"]["val_ppl_ptq"] > 1 and results["before_qat"]["val_ppl_dense_experts"] > 1


def test_the_tokenizer_round_trips_code_and_carries_kimis_special_tokens_and_chat_template(micro_run) -> None:
    out, _ = micro_run
    tokenizer = Tokenizer.from_dir(out / "checkpoint")
    assert tokenizer.vocab_size == RECIPE.vocab_size
    code = 'def f(x: int) -> str:\n    """Ünïcode ✓"""\n    return f"{x!r:>8}"  # 中文\n'
    assert tokenizer.decode(tokenizer.encode(code)) == code
    for token in ("[BOS]", "[EOS]", "<|im_user|>", "<|im_assistant|>", "<|im_end|>", "<|im_middle|>"):
        assert tokenizer.encode(token) == [tokenizer.special_token_id(token)]
    assert tokenizer.chat_format == "kimi_k2" and tokenizer.chat_template is not None
    ids = tokenizer.encode_chat([{"role": "user", "content": "print('hi')"}])
    assert tokenizer.special_token_id("<|im_end|>") in ids and tokenizer.eos_token_id in tokenizer.stop_token_ids
