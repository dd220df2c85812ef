"""Handoff time and GiB/s of one request's state (MLA latent KV + KDA recurrent + conv) between two
processes on loopback, per backend and prompt length.

    python benchmarks/handoff.py [--preset kimi-linear-48b-a3b] [--tokens 128 1024 8192 32768]
                                 [--backends mooncake nixl] [--reps 5] [--out handoff.json]
    python benchmarks/handoff.py --breakdown [--tokens 1000] [--backends mooncake] [--reps 5]

The receiver registers a real decode cache, the sender a real prefill cache of the same preset
(bf16, TP 1); the writes are exactly those the prefill worker posts (`TPMapping.ops`). Each
measurement is post -> all landed (polled), median of `--reps`; the landed bytes are verified
with the transfer checksums every time. Anchor measured in the same run: a torch copy of the same
bytes inside one process (the memory-bandwidth floor of any handoff).

`--breakdown`: the whole handoff path in one process (launcher local): a k3-tiny PrefillWorker and
DecodeWorker (block 16, fp32, one engine thread each), one prompt at a time (4 output tokens), each
step of the path timed by wrapping it (a wrapper adds microseconds); median, min and max over `--reps`
after one warm-up, with the `torch` threads of this process set to one, as in the Ray actors.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing as mp
import statistics
import time

import torch

from k3serve.decode import handoff as decode_handoff
from k3serve.decode.worker import DecodeWorker
from k3serve.engine.config import EngineArgs
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.batch import ModelCache
from k3serve.model.presets import preset_config
from k3serve.prefill import handoff as prefill_handoff
from k3serve.prefill.messages import HandoffTarget
from k3serve.prefill.worker import PrefillWorker
from k3serve.transfer.backend import TransferStatus
from k3serve.transfer.backends import make_backend
from k3serve.transfer.checksum import CachedRequest, request_checksums
from k3serve.transfer.control import DecodeControlClient
from k3serve.transfer.layout import CacheLayout, HeadSlice, register_cache
from k3serve.transfer.tp_map import RankCache, RequestSpan, TPMapping

BLOCK = 64


def make_cache(preset: str, max_tokens: int, seed: int) -> tuple[ModelCache, CacheLayout]:
    config = preset_config(preset)
    cache = ModelCache.allocate(config, max_tokens // BLOCK + 1, 2, BLOCK, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    for t in cache.mla_kv + cache.kda_recurrent + cache.kda_conv:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return cache, CacheLayout.from_cache(cache, config, 0, 1)


def receiver(conn, backend_name: str, preset: str, max_tokens: int) -> None:
    cache, layout = make_cache(preset, max_tokens, seed=1)
    backend = make_backend(backend_name)
    regions = register_cache(backend, cache)
    conn.send((backend.agent_info(), layout.to_json(), {n: r for n, r in regions.items()}))
    while (msg := conn.recv()) is not None:  # (block_ids, slot, num_tokens) -> checksums of what landed
        block_ids, slot, num_tokens = msg
        conn.send(request_checksums(CachedRequest(cache, layout, block_ids, slot, num_tokens), HeadSlice.whole_shard(layout)))
    backend.close()


def bench_backend(backend_name: str, preset: str, tokens: list[int], reps: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, backend_name, preset, max(tokens)), daemon=True)
    proc.start()
    cache, layout = make_cache(preset, max(tokens), seed=0)
    backend = make_backend(backend_name)
    regions = register_cache(backend, cache)
    info, peer_layout_json, peer_regions = parent.recv()
    peer_layout = CacheLayout.from_json(peer_layout_json)
    mapping = TPMapping([RankCache(layout, regions)], [RankCache(peer_layout, peer_regions)])
    key = backend.connect(info)
    rows = []
    try:
        for n in tokens:
            blocks = tuple(range(-(-n // BLOCK)))
            span = RequestSpan(blocks, blocks, 0, 1, n)
            ops = mapping.ops(span)[(0, 0)]
            nbytes = sum(op.length for op in ops)
            times = []
            for _ in range(reps + 1):  # first one warms the connection
                t0 = time.perf_counter()
                handle = backend.write(key, ops)
                while (status := backend.poll(handle)) is TransferStatus.PENDING:
                    pass
                times.append(time.perf_counter() - t0)
                backend.release(handle)
                assert status is TransferStatus.DONE, status
            parent.send((blocks, 1, n))
            landed = parent.recv()
            view = mapping.view(0, 0)
            sent = request_checksums(CachedRequest(cache, layout, blocks, 0, n), view.heads, view.mla)
            assert landed == sent, "landed state differs from what was sent"
            median = statistics.median(times[1:])
            rows.append({"backend": backend_name, "tokens": n, "bytes": nbytes, "ops": len(ops),
                         "median_ms": median * 1e3, "gib_s": nbytes / median / 2**30})
    finally:
        parent.send(None)
        proc.join(30)
        backend.close()
    return rows


def memcpy_anchor(preset: str, tokens: list[int], reps: int) -> list[dict]:
    """The same bytes copied by torch inside one process: what no network transfer can beat."""
    src, _ = make_cache(preset, max(tokens), seed=0)
    dst, _ = make_cache(preset, max(tokens), seed=1)
    rows = []
    for n in tokens:
        nb = -(-n // BLOCK)
        pairs = [(s[:nb], d[:nb]) for s, d in zip(src.mla_kv, dst.mla_kv)]
        pairs += [(s[0], d[1]) for s, d in zip(src.kda_recurrent + src.kda_conv, dst.kda_recurrent + dst.kda_conv)]
        nbytes = sum(s.numel() * s.element_size() for s, _ in pairs)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            for s, d in pairs:
                d.copy_(s)
            times.append(time.perf_counter() - t0)
        median = statistics.median(times[1:])
        rows.append({"backend": "torch copy (anchor)", "tokens": n, "bytes": nbytes, "ops": len(pairs),
                     "median_ms": median * 1e3, "gib_s": nbytes / median / 2**30})
    return rows


class StepTimes:
    """Wall time of every call of the wrapped steps, per step name."""

    def __init__(self, *steps: str) -> None:
        self.times: dict[str, list[float]] = {step: [] for step in steps}  # report order

    def wrap(self, owner: object, attr: str, step: str) -> None:
        fn = getattr(owner, attr)
        self.times.setdefault(step, [])

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(step, time.perf_counter() - t0)

        setattr(owner, attr, timed)

    def add(self, step: str, seconds: float) -> None:
        self.times.setdefault(step, []).append(seconds)


def handoff_breakdown(backend_name: str, num_tokens: int, reps: int) -> list[dict]:
    """Where the time of a handoff goes, from the prefill engine's last step to decode's adopt."""
    torch.set_num_threads(1)
    args = EngineArgs(model="k3-tiny", block_size=16, max_model_len=num_tokens + 24, cache_memory_bytes=64 << 20)
    decode = DecodeWorker(args, transfer=backend_name)
    prefill = PrefillWorker(args, transfer=backend_name)
    steps = StepTimes("prefill: prompt compute + first token", "handoff (k3serve:handoff_time_seconds)")
    steps.wrap(prefill.sender, "push", "prefill rank: post writes, checksum sent state, wait until landed")
    steps.wrap(prefill_handoff, "request_checksums", "  checksum of the sent state (while writes fly)")
    steps.wrap(DecodeControlClient, "transfer_ready", "prefill: TransferReady RPC (returns after adopt)")
    steps.wrap(decode, "transfer_ready", "  decode: TransferReady handler")
    steps.wrap(decode, "_adopt", "    decode engine thread: verify + adopt")
    steps.wrap(decode_handoff, "request_checksums", "      checksum of the landed state")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def one(i: int) -> None:
        rid, prompt = f"r{i}", [(7 * i + j) % 500 + 3 for j in range(num_tokens)]
        reservation = await decode.admit(rid, prompt, params)
        result = await prefill.prefill(rid, prompt, params, HandoffTarget(await decode.addresses(), reservation))
        steps.add("prefill: prompt compute + first token", result.prefill_seconds)
        steps.add("handoff (k3serve:handoff_time_seconds)", result.transfer_seconds)
        async for _ in decode.stream(rid):
            pass

    async def run() -> None:
        for i in range(reps + 1):
            await one(i)
            if i == 0:  # warm-up: connections, handshake, first allocations
                for times in steps.times.values():
                    times.clear()

    try:
        asyncio.run(run())
    finally:
        prefill.shutdown()
        decode.shutdown()
    return [{"backend": backend_name, "tokens": num_tokens, "step": step, "median_ms": statistics.median(t) * 1e3,
             "min_ms": min(t) * 1e3, "max_ms": max(t) * 1e3, "calls": len(t)} for step, t in steps.times.items()]


def print_breakdown(rows: list[dict], reps: int) -> None:
    print(f"handoff breakdown, k3-tiny (fp32, TP1 -> TP1), one process, median of {reps}")
    print("| backend | prompt tokens | step | median ms | min ms | max ms |")
    print("|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['backend']} | {r['tokens']} | {r['step']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | "
              f"{r['max_ms']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="kimi-linear-48b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 8192, 32768])
    parser.add_argument("--backends", nargs="+", default=["mooncake", "nixl"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out")
    parser.add_argument("--breakdown", action="store_true", help="the whole handoff path of a k3-tiny prompt, timed per step")
    args = parser.parse_args()
    if args.breakdown:
        tokens = args.tokens if args.tokens != parser.get_default("tokens") else [1000]
        rows = [row for name in args.backends for n in tokens for row in handoff_breakdown(name, n, args.reps)]
        print_breakdown(rows, args.reps)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"preset": "k3-tiny", "rows": rows}, f, indent=2)
        return
    rows = memcpy_anchor(args.preset, args.tokens, args.reps)
    for name in args.backends:
        rows += bench_backend(name, args.preset, args.tokens, args.reps)
    print(f"handoff of one request's state, preset {args.preset} (bf16, TP1 -> TP1), two processes on loopback, "
          f"median of {args.reps}")
    print("| backend | prompt tokens | MiB | write ops | median ms | GiB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['backend']} | {r['tokens']} | {r['bytes'] / 2**20:.2f} | {r['ops']} | {r['median_ms']:.2f} | "
              f"{r['gib_s']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
