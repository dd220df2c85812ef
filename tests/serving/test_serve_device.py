"""`k3serve serve --device D --launcher local` answers a real HTTP request with the greedy text of the engine's
reference path on the same checkpoint (`LLM`, eager): on the CPU (k3-tiny, fp32) and, marked gpu, on CUDA
(K3_TINY_GPU, bf16: the GPU kernels, CUDA graphs in the server's decode steps), colocated and disaggregated
1P1D in one process (transfer `local`, and NIXL where it is installed: its GPU path between the two engines)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.transfer.backends import available_backends

from _server_harness import ServerSpec, launch

# K3_TINY_GPU's KDA slot is 3.1 MiB: 8 sequences leave most of the 64 MiB cache to MLA blocks
ENGINE = {"block_size": 64, "max_model_len": 1024, "cache_memory_bytes": 64 << 20, "max_num_seqs": 8}
FLAGS = ("--block-size", "64", "--max-num-seqs", "8")  # over the harness's small engine (1024 tokens, 64 MiB)
PROMPTS = [[(11 * i + 5 * j) % 400 + 30 for j in range(n)] for i, n in enumerate((9, 70, 200))]
MAX_TOKENS = 16


def _layouts(device: str) -> list:
    colocated = ServerSpec(mode="colocated", launcher="local", extra_args=("--device", device, *FLAGS))
    local = ServerSpec(transfer="local", launcher="local", extra_args=("--device", device, *FLAGS))
    nixl = pytest.param(ServerSpec(transfer="nixl", launcher="local", extra_args=("--device", device, *FLAGS)),
                        marks=pytest.mark.skipif(not available_backends()["nixl"], reason="NIXL is not installed"))
    return [colocated, local, nixl] if device == "cuda" else [colocated]


def _reference_texts(checkpoint: Path, device: str) -> list[str]:
    """The engine's greedy text of each prompt served alone, as the server gets them (one request at a time: a
    batch of other shapes would round differently in bf16)."""
    llm = LLM(model=str(checkpoint), device=device, enforce_eager=True, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = [llm.generate([prompt], params)[0].outputs[0].text for prompt in PROMPTS]
    llm.engine.close()
    return texts


def _served_texts(spec: ServerSpec, checkpoint: Path) -> list[str]:
    with launch(spec, checkpoint, deadline_s=600) as server:  # a fresh GPU machine compiles the kernels first
        texts = []
        for prompt in PROMPTS:
            body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True}
            resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
            assert resp.status_code == 200, resp.text
            texts.append(resp.json()["choices"][0]["text"])
        return texts


@pytest.mark.parametrize("spec", _layouts("cpu"), ids=lambda s: s.id)
def test_served_on_the_cpu_equals_the_engines_greedy_text(spec: ServerSpec, tiny_checkpoint: Path) -> None:
    assert _served_texts(spec, tiny_checkpoint) == _reference_texts(tiny_checkpoint, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", _layouts("cuda"), ids=lambda s: s.id)
def test_served_on_cuda_equals_the_engines_greedy_text(spec: ServerSpec, k3_tiny_gpu_checkpoint: Path) -> None:
    assert _served_texts(spec, k3_tiny_gpu_checkpoint) == _reference_texts(k3_tiny_gpu_checkpoint, "cuda")
