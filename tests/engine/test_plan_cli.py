"""`k3serve plan` (k3serve/cli.py) on the CPU: what it prints for a preset, what its options change, and a
clear refusal of a model it cannot find."""

from __future__ import annotations

import pytest

from k3serve.cli import main


def _rows(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, str]:
    assert main(["plan", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]  # after the title
    return {key.strip(): value.strip() for key, value in (line.rsplit("  ", 1) for line in lines)}


def _prefill(rows: dict[str, str]) -> tuple[str, str]:
    (key, value), = [(k, v) for k, v in rows.items() if k.startswith("prefill activations")]
    return key, value


def test_the_step_budget_sizes_the_prefill_reserve(capsys: pytest.CaptureFixture[str]) -> None:
    """--max-num-batched-tokens is the step's base budget; the plan sets aside the activations of the largest step
    the scheduler runs (twice the base: the adaptive ceiling), so a smaller budget leaves more for the KV cache."""
    small = _rows(capsys, "--max-num-batched-tokens", "4096")
    default = _rows(capsys)
    assert _prefill(small)[0] == "prefill activations (an eager step of 8,192 tokens, estimate)"
    assert _prefill(default)[0] == "prefill activations (an eager step of 32,768 tokens, estimate)"
    kv = lambda rows: float(rows["left for MLA KV"].split()[0])  # noqa: E731
    assert kv(small) > kv(default)


def test_graphs_say_why_they_are_off(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3SERVE_TP_NCCL", "0")
    assert _rows(capsys, "--tp", "8")["CUDA graphs"] == (
        "off (TP > 1 with K3SERVE_TP_NCCL=0: gloo collectives): eager decode")
    monkeypatch.delenv("K3SERVE_TP_NCCL")  # NCCL, the default: graphs at TP > 1
    assert any(key.startswith("CUDA graphs (decode") for key in _rows(capsys, "--tp", "8"))
    assert _rows(capsys, "--tp", "8", "--enforce-eager")["CUDA graphs"] == "off (enforce_eager): eager decode"
    one_rank = _rows(capsys, "--tp", "1", "--model", "kimi-linear-48b-a3b", "--device-memory-gib", "139")
    assert any(key.startswith("CUDA graphs (decode") for key in one_rank)


def test_an_unknown_model_is_refused_with_the_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "kimi-linear"]) == 2
    err = capsys.readouterr().err
    assert "no config.json in kimi-linear" in err and "kimi-linear-48b-a3b" in err


def test_dcp_splits_the_latent_kv_and_sets_the_capacity_against_tp_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """K3 at TP 8 on a GB300 rank: DCP 8 holds 1/8 of each token's latent KV, so about 8x the context fits in what
    is left (slightly less: the graphs and the step hold the DCP group's queries and partial outputs)."""
    rows = _rows(capsys, "--model", "kimi-k3", "--tp", "8", "--decode-context-parallel-size", "8")
    tp_only = _rows(capsys, "--model", "kimi-k3", "--tp", "8")
    fit = lambda r, key="tokens of context that fit": int(r[key].replace(",", ""))  # noqa: E731
    assert fit(rows, "tokens of context that fit without DCP (latent KV on every rank)") == fit(tp_only)
    assert 7.9 < fit(rows) / fit(tp_only) <= 8.0
    assert rows["DCP 8 capacity gain"] == f"{fit(rows) / fit(tp_only):.2f}x"
    assert rows["MLA latent KV per token (all MLA layers)"] == "27.0 KiB, 3.38 KiB on a rank"


def test_a_dcp_size_that_does_not_divide_tp_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--tp", "8", "--decode-context-parallel-size", "3"]) == 2
    assert "decode_context_parallel_size must be an integer >= 1 dividing tensor_parallel_size=8, got 3" in \
        capsys.readouterr().err
