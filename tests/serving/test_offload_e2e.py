"""`k3serve serve --kv-offload host` end to end (colocated, a real server process): a prompt whose prefix its device
cache evicted under pressure is served from host memory, `usage.prompt_tokens_details.cached_tokens` says so, the
text is an engine's with no cache, and GET /metrics counts the tier's hit."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from k3serve.engine.llm import LLM
from k3serve.engine.memory import cache_sizes
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.config import ModelConfig

from _server_harness import SMALL_ENGINE_ARGS, ServerSpec, launch

BLOCK, NUM_BLOCKS, MAX_NUM_SEQS = 16, 72, 2  # a device cache of 72 blocks: five 300-token prompts overflow it


def _cache_bytes(checkpoint: Path) -> int:
    sizes = cache_sizes(ModelConfig.from_dir(checkpoint), 1, torch.float32)
    return 2 * MAX_NUM_SEQS * sizes.kda_bytes_per_slot + NUM_BLOCKS * BLOCK * sizes.mla_bytes_per_token


def test_a_prefix_evicted_from_the_device_is_a_host_hit_through_the_api(tiny_checkpoint: Path, tmp_path: Path):
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(20, 500, (300,), generator=gen).tolist() for _ in range(5)]
    second = prompts[0] + torch.randint(20, 500, (30,), generator=gen).tolist()
    small = ("--cache-memory-bytes", str(_cache_bytes(tiny_checkpoint)), "--max-num-seqs", str(MAX_NUM_SEQS))
    spec = ServerSpec(mode="colocated", launcher="local", extra_args=("--kv-offload", "host", *small))
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with launch(spec, tiny_checkpoint, keep_log=tmp_path / "server.log") as server:
        def complete(prompt: list[int]) -> dict:
            r = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": prompt, **body},
                           timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        for prompt in prompts:  # one at a time: the later ones evict the first's unit from the device
            complete(prompt)
        got = complete(second)
        hits = sum(v for (name, labels), v in server.metrics().items()
                   if name == "vllm:external_prefix_cache_hits_total" and ("tier", "host") in labels)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 288  # (300 - 1) // 16 * 16
    assert hits == 288
    args = dict(zip(SMALL_ENGINE_ARGS[::2], SMALL_ENGINE_ARGS[1::2]))
    plain = LLM(str(tiny_checkpoint), enable_prefix_caching=False, block_size=BLOCK,
                max_model_len=int(args["--max-model-len"]))
    (want,) = plain.generate([second], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert got["choices"][0]["text"] == want.outputs[0].text
