"""The host tier on CUDA (`-m gpu`): the host copy is pinned, the landed checksums run in the Triton kernel, and a
hit after device eviction gives the tokens of the same CUDA engine hitting the same prefix in its device cache,
bf16 kernels and all (the same kernels on the same shapes: a restored unit must not change a bit of what follows;
a full recompute is another shape, whose bf16 rounding may part from it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.transfer import checksum

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_a_host_hit_on_cuda_is_pinned_verified_on_the_device_and_exact(k3_tiny_gpu_checkpoint: Path):
    gen = torch.Generator().manual_seed(5)
    firsts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (300, 700, 1500)]
    seconds = [p + torch.randint(0, 512, (40,), generator=gen).tolist() for p in firsts]
    args = dict(model=str(k3_tiny_gpu_checkpoint), device="cuda", max_model_len=2048, enforce_eager=True,
                max_num_seqs=8, cache_memory_bytes=256 << 20)
    llm = LLM(**args, kv_offload="host")
    host = llm.engine.runner.offload["host"]
    assert all(t.is_pinned() for t in host.cache.mla_kv + host.cache.kda_recurrent + host.cache.kda_conv)
    llm.generate(firsts, [GREEDY] * 3)
    llm.engine.scheduler.prefix_cache.clear()
    load, load_backends = host.load, []

    def recorded_load(*args):  # the real load; which checksum backend verified what landed
        loaded = load(*args)
        load_backends.append(checksum.last_backend["checksum"])
        return loaded

    host.load = recorded_load
    outs = llm.generate(seconds, [GREEDY] * 3)
    assert load_backends and set(load_backends) == {"triton"}  # the landed blocks, read in place on the device
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 64 * 64 for p in firsts]
    device_only = LLM(**args)
    device_only.generate(firsts, [GREEDY] * 3)
    device_hits = device_only.generate(seconds, [GREEDY] * 3)
    assert [o.num_cached_tokens for o in device_hits] == [o.num_cached_tokens for o in outs]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in device_hits]
