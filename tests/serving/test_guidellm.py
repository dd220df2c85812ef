"""guidellm (the benchmark users point at OpenAI servers) completes against the disaggregated server
with zero errors at concurrency 1, 4 and 16; its JSON report is kept as a test artifact."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _server_harness import Server

CONCURRENCIES = (1, 4, 16)
REQUESTS_PER_LEVEL = 16
PROMPT_TOKENS, OUTPUT_TOKENS = 32, 16


def _guidellm() -> str:
    """This venv's guidellm (test extras), else one on PATH, else scripts/install_guidellm.sh's venv."""
    candidates = [Path(sys.executable).with_name("guidellm"), shutil.which("guidellm"),
                  Path(__file__).resolve().parents[2] / ".venv-guidellm" / "bin" / "guidellm"]
    for exe in candidates:
        if exe and Path(exe).exists():
            return str(exe)
    pytest.fail("guidellm is not installed: pip install -e '.[test]' (or scripts/install_guidellm.sh)")


@pytest.mark.timeout(600)
def test_guidellm_runs_clean_against_the_server(disagg_server: Server, tiny_checkpoint: Path, artifacts_dir: Path) -> None:
    report = artifacts_dir / "guidellm.json"
    cmd = [
        _guidellm(), "run",
        "--backend", f"kind=openai_http,target={disagg_server.url}",
        "--profile", f"kind=concurrent,streams={CONCURRENCIES[0]}",
        "--override", "profile.streams", ",".join(map(str, CONCURRENCIES)),
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--constraint", f"kind=max_requests,count={REQUESTS_PER_LEVEL}",
        "--tokenizer", f"kind=huggingface_auto,model={tiny_checkpoint}",
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, f"guidellm failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    print(f"guidellm report: {report}")

    benchmarks = json.loads(report.read_text())["benchmarks"]
    assert len(benchmarks) == len(CONCURRENCIES)
    for bench in benchmarks:
        totals = bench["scheduler_metrics"]["requests_made"]
        assert totals["errored"] == 0, f"guidellm saw errors: {totals}"
        assert totals["successful"] >= REQUESTS_PER_LEVEL - max(CONCURRENCIES), totals
        # guidellm takes token counts from the server's usage chunk: exactly the requested 16 out,
        # and the synthetic 32-token prompt plus the chat template in
        out = bench["metrics"]["output_token_count"]["successful"]
        assert out["min"] == out["max"] == OUTPUT_TOKENS, out
        assert bench["metrics"]["prompt_token_count"]["successful"]["min"] > PROMPT_TOKENS
