"""A TP2 engine (rank 0 here, rank 1 a spawned process: `join_engine`, then `follow_forever` running each
step) generates what the TP1 engine generates: greedy tokens, their logprobs and the prompt logprobs, over
a vocab of 509 that 2 does not divide. Each rank holds half the vocab rows of the embedding and the
lm_head; the logits are gathered to rank 0, which alone samples, and the padded vocab row never shows.
The TP2 ranks score prompt logprobs in slices of 3 rows (every slice gathered on its own, ragged last ones
included), the TP1 engine each chunk in one slice.
On CUDA (`-m gpu`: rank r on GPU r of those visible; NCCL, the default, where each rank has a GPU of its own,
else gloo, which moves the CUDA tensors through the host: one device shared on a 1-GPU machine, rank 0 warning
why) fp32, with a looser logprob bound since the Triton kernels' dots may round through tf32.
On the CPU the ranks run gloo and never reach the choice of NCCL, which is the default only on CUDA: a CPU TP2
engine says nothing about it with K3SERVE_TP_NCCL unset."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.tp_group import NCCL_SWITCH, TPGroup
from k3serve.model.checkpoint import make_checkpoint

from _local_ranks import spawned, tcp_init_method
from tiny_presets import k3_tiny_odd_vocab

pytestmark = pytest.mark.timeout(60)

PROMPTS = [[3, 7, 11, 508, 2], list(range(1, 30))]  # 508: the last real vocab row, on rank 1
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
TP2_PROMPT_LOGPROBS_ROWS = 3  # the prompts score 4 and 28 rows: 2 and 10 slices, the last of each ragged


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(k3_tiny_odd_vocab(), tmp_path_factory.mktemp("k3-tiny-vocab-509"), seed=0)


def _engine_args(checkpoint: Path, device: str, tensor_parallel_size: int = 1) -> EngineArgs:
    return EngineArgs(model=str(checkpoint), block_size=8, max_model_len=128, cache_memory_bytes=16 << 20,
                      device=device, dtype="float32", tensor_parallel_size=tensor_parallel_size)


def _follower(rank: int, args: EngineArgs, init_method: str) -> None:
    from k3serve.engine.follower import join_engine
    from k3serve.engine.tp_group import follow_forever

    group, runner, _ = join_engine(rank, args, init_method, num_threads=1)
    runner.prompt_logprobs_rows = TP2_PROMPT_LOGPROBS_ROWS  # as rank 0's: each slice is a collective
    try:
        follow_forever(group, {"step": lambda output, want: runner.execute(output, want)})
    finally:
        group.close()


def _generate(engine: LLMEngine) -> dict[str, tuple]:
    """request id -> (tokens, their logprobs, prompt logprobs) of every prompt, run together."""
    ids = [engine.add_request(prompt, GREEDY) for prompt in PROMPTS]
    out = {rid: ([], [], None) for rid in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens, logprobs, _ = out[delta.request_id]
            tokens += delta.new_token_ids
            logprobs += delta.logprobs
            if delta.prompt_logprobs is not None:
                out[delta.request_id] = (tokens, logprobs, delta.prompt_logprobs[1:])  # the first is None
    return out


def _generate_tp2(args: EngineArgs) -> tuple[dict[str, tuple], bool]:
    """`_generate` on a TP2 engine (rank 1 spawned, inheriting this environment), and whether its model's
    collectives were capturable (NCCL's)."""
    init = tcp_init_method()
    with spawned(_follower, 1, args, init):
        engine = LLMEngine(args, TPGroup(0, 2, init, timeout_s=30))
        engine.runner.prompt_logprobs_rows = TP2_PROMPT_LOGPROBS_ROWS
        try:
            return _generate(engine), engine.runner.model.tp.capturable
        finally:
            engine.close()


@pytest.mark.parametrize(("device", "logprob_atol"), [("cpu", 1e-4), pytest.param("cuda", 2e-2, marks=pytest.mark.gpu)])
def test_tp2_engine_generates_what_tp1_generates(checkpoint: Path, device: str, logprob_atol: float) -> None:
    reference = _generate(LLMEngine(_engine_args(checkpoint, device)))
    got, _ = _generate_tp2(_engine_args(checkpoint, device, tensor_parallel_size=2))
    assert list(got.values())[0][0] and all(len(tokens) == GREEDY.max_tokens for tokens, _, _ in got.values())
    for (tokens, logprobs, prompt_lp), (ref_tokens, ref_logprobs, ref_prompt_lp) in zip(got.values(), reference.values()):
        assert tokens == ref_tokens
        assert len(prompt_lp) == len(ref_prompt_lp) > 0
        for entry, ref in zip([*logprobs, *prompt_lp], [*ref_logprobs, *ref_prompt_lp]):
            assert (entry.token_ids, entry.ranks) == (ref.token_ids, ref.ranks)
            assert max(abs(a - b) for a, b in zip(entry.logprobs, ref.logprobs)) < logprob_atol, (entry, ref)


def test_a_cpu_tp2_engine_runs_gloo_without_a_word_about_nccl_when_the_switch_is_unset(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(NCCL_SWITCH, raising=False)  # NCCL's default, on both ranks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, capturable = _generate_tp2(_engine_args(checkpoint, "cpu", tensor_parallel_size=2))
    assert not [str(w.message) for w in caught]
    assert not capturable  # gloo's collectives
    assert all(len(tokens) == GREEDY.max_tokens for tokens, _, _ in got.values())
