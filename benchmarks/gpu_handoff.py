"""One request's handoff between two GPUs of one host, as the prefill sender posts it: the MLA latent KV
of an 8K-token prompt and the KDA state (recurrent + conv) of every Kimi-K3 layer of one TP8 rank
(24 MLA + 69 KDA layers: 12 of 96 KDA heads, the MLA cache replicated), GPU0 -> GPU1, between TWO
processes (one per GPU; inside one process UCX has no CUDA-IPC path and runs at ~0.5 GB/s).

    python benchmarks/gpu_handoff.py [--backend nixl] [--tokens 8192] [--reps 50] [--out gpu_handoff.json]
    python benchmarks/gpu_handoff.py --backend mooncake --backend-opt protocol=tcp --reps 10 --warmup 2
    python benchmarks/gpu_handoff.py --smoke      # CPU: two processes, DRAM, 256 tokens (checks the script)

The decode side (a spawned process on cuda:1) allocates and registers a real decode-rank cache; the
prefill side (this process, cuda:0) registers its own, learns the decode layout and regions as the
handshake would deliver them, and posts exactly the writes `RankSender.push` posts:
`TPMapping.ops(RequestSpan)` for prefill rank 0 -> decode rank 0 of TP8 (contiguous block runs become
one op per MLA layer, a head range one op per KDA layer). Each handoff = write() -> poll() until DONE,
wall clock, warm-up first, median over --reps. Both caches start from different random bytes.

Checked in the same run: the transfer checksums of `transfer/checksum.py` on both GPUs (the sender's
share of the decode view == what the decode rank computes over what landed; they differed before the
first write), and a direct compare of every written byte range (decode side's bytes shipped back).
Also timed: each side's checksum pass on its GPU. Anchors in the same run, in this process, wall clock
with both GPUs synchronized: torch peer copies GPU0 -> GPU1 of the same byte ranges as tensor copies
(one copy_ per op, eager: pays torch's per-copy host cost), of the same byte count as one buffer (the
bandwidth-bound time of these bytes), and of a 1 GiB buffer (the NVLink copy rate). Goal: the handoff
>= 70% of the peer-copy rate; the table gives the ratio to every anchor."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from k3serve.model.batch import ModelCache
from k3serve.model.presets import preset_config
from k3serve.transfer.backend import TransferBackend, TransferStatus, WriteOp
from k3serve.transfer.backends import backend_names, make_backend
from k3serve.transfer import checksum
from k3serve.transfer.checksum import CachedRequest, mismatched_regions, request_checksums
from k3serve.transfer.layout import CacheLayout, HeadSlice, register_cache
from k3serve.transfer.tp_map import RankCache, RequestSpan, TPMapping

BLOCK = 64
TP = 8  # K3's per-rank shapes: prefill rank 0 -> decode rank 0 of TP8
GB = 1e9
CHECKSUM_REPS = 5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="nixl", choices=[b for b in backend_names() if b != "local"])
    parser.add_argument("--backend-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to make_backend (e.g. protocol=tcp for mooncake); repeatable")
    parser.add_argument("--preset", default="kimi-k3")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="CPU, DRAM, 256 tokens, few reps")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.reps, args.warmup = 256, 5, 2
    return args


def backend_options(pairs: list[str]) -> dict[str, str]:
    opts = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--backend-opt wants KEY=VALUE, got {pair!r}")
        opts[key] = value
    return opts


def sync(*devs: torch.device) -> None:
    for dev in devs:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


def allocate(preset: str, num_blocks: int, num_slots: int, dev: torch.device, seed: int) -> tuple[ModelCache, CacheLayout]:
    """One TP8 rank's cache (rank 0), every byte random (seeded: the two sides differ)."""
    config = preset_config(preset)
    cache = ModelCache.allocate(config, num_blocks, num_slots, BLOCK, TP, torch.bfloat16, dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    for t in cache.mla_kv + cache.kda_recurrent + cache.kda_conv:
        t.view(torch.uint8).random_(0, 256, generator=gen)
    sync(dev)
    return cache, CacheLayout.from_cache(cache, config, 0, TP)


def byte_ranges(cache: ModelCache, regions: dict, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    """uint8 views of (address, length) ranges inside this cache's registered regions."""
    flat = {name: t.view(-1).view(torch.uint8) for name, t in _named_tensors(cache).items()}
    views = []
    for addr, length in ranges:
        region = next(r for r in regions.values() if r.addr <= addr and addr + length <= r.addr + r.length)
        views.append(flat[region.name][addr - region.addr : addr - region.addr + length])
    return views


def _named_tensors(cache: ModelCache) -> dict[str, torch.Tensor]:
    """Region name -> tensor, as `register_cache` names them."""
    named = {f"mla.{i}": t for i, t in enumerate(cache.mla_kv)}
    named.update({f"kda_recurrent.{j}": t for j, t in enumerate(cache.kda_recurrent)})
    named.update({f"kda_conv.{j}": t for j, t in enumerate(cache.kda_conv)})
    return named


def timed_checksums(request: CachedRequest, heads: HeadSlice | None, include_mla: bool,
                    dev: torch.device) -> tuple[dict[str, str], list[float], str]:
    """request_checksums on the cache's device, CHECKSUM_REPS times after one warm-up (on CUDA it compiles
    the Triton kernel): the sums, ms each, and the path that ran ("triton" | "matmul")."""
    request_checksums(request, heads, include_mla)
    times, sums = [], {}
    for _ in range(CHECKSUM_REPS):
        sync(dev)
        t0 = time.perf_counter()
        sums = request_checksums(request, heads, include_mla)
        sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    return sums, times, checksum.last_backend["checksum"]


def receiver(conn, spec: dict) -> None:
    """The decode rank: registers its cache, answers checksum and byte requests about what landed."""
    try:
        dev = torch.device(spec["device"])
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        cache, layout = allocate(spec["preset"], spec["num_blocks"], spec["num_slots"], dev, seed=2)
        backend = make_backend(spec["backend"], **spec["backend_opts"])
        regions = register_cache(backend, cache)
        conn.send(("ready", backend.agent_info(), layout.to_json(), regions))
        while (msg := conn.recv()) is not None:
            if msg[0] == "checksums":
                _, block_ids, slot, num_tokens = msg
                request = CachedRequest(cache, layout, block_ids, slot, num_tokens)
                conn.send(("checksums", *timed_checksums(request, HeadSlice.whole_shard(layout), True, dev)))
            elif msg[0] == "bytes":
                landed = torch.cat(byte_ranges(cache, regions, msg[1])).cpu()
                conn.send_bytes(landed.numpy().tobytes())
        backend.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def recv(conn, kind: str, timeout_s: float = 600.0):
    if not conn.poll(timeout_s):
        raise SystemExit(f"decode process sent nothing within {timeout_s} s (waiting for {kind})")
    msg = conn.recv()
    if msg[0] == "error":
        raise SystemExit(f"decode process failed:\n{msg[1]}")
    if msg[0] != kind:
        raise SystemExit(f"decode process sent {msg[0]!r}, expected {kind!r}")
    return msg[1:]


def write_and_wait(backend: TransferBackend, peer: str, ops: list[WriteOp]) -> float:
    """Seconds from posting the batch to every op landed (busy poll: the transport's own time)."""
    t0 = time.perf_counter()
    handle = backend.write(peer, ops)
    while (status := backend.poll(handle)) is TransferStatus.PENDING:
        pass
    elapsed = time.perf_counter() - t0
    why = backend.error(handle) if status is not TransferStatus.DONE and hasattr(backend, "error") else ""
    backend.release(handle)
    if status is not TransferStatus.DONE:
        raise SystemExit(f"handoff write {status.name}: {why}")
    return elapsed


def copy_seconds(pairs: list[tuple[torch.Tensor, torch.Tensor]], src: torch.device, dst: torch.device,
                 warmup: int, reps: int) -> list[float]:
    """Wall seconds of copying every (src, dst) pair, both devices synchronized around it."""
    times = []
    for i in range(warmup + reps):
        sync(src, dst)
        t0 = time.perf_counter()
        for s, d in pairs:
            d.copy_(s)
        sync(src, dst)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def summary(name: str, nbytes: int, ops: int, seconds: list[float]) -> dict:
    med = statistics.median(seconds)
    p90 = sorted(seconds)[int(0.9 * (len(seconds) - 1))]
    return {"path": name, "bytes": nbytes, "ops": ops, "median_ms": med * 1e3, "p90_ms": p90 * 1e3,
            "gb_s": nbytes / med / GB, "times_ms": [t * 1e3 for t in seconds]}


def main() -> None:
    args = parse_args()
    if args.smoke:
        src_dev = dst_dev = torch.device("cpu")
    elif torch.cuda.device_count() >= 2:
        src_dev, dst_dev = torch.device("cuda:0"), torch.device("cuda:1")
    else:
        sys.exit(f"needs 2 GPUs (found {torch.cuda.device_count()}), or --smoke")
    if src_dev.type == "cuda":
        torch.cuda.set_device(src_dev)
    opts = backend_options(args.backend_opt)
    num_blocks = -(-args.tokens // BLOCK)
    src_blocks, dst_blocks = tuple(range(num_blocks)), tuple(range(1, num_blocks + 1))  # offsets differ on purpose
    src_slot, dst_slot = 1, 2
    spec = {"device": str(dst_dev), "preset": args.preset, "num_blocks": num_blocks + 1, "num_slots": 4,
            "backend": args.backend, "backend_opts": opts}
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, spec), daemon=True)
    proc.start()
    result: dict = {"backend": args.backend, "backend_opts": opts, "preset": args.preset, "tp": TP, "tokens": args.tokens,
                    "src": str(src_dev), "dst": str(dst_dev), "reps": args.reps, "warmup": args.warmup}
    try:
        cache, layout = allocate(args.preset, num_blocks, 2, src_dev, seed=1)
        backend = make_backend(args.backend, **opts)
        regions = register_cache(backend, cache)
        info, peer_layout_json, peer_regions = recv(conn, "ready")
        peer_layout = CacheLayout.from_json(peer_layout_json)
        mapping = TPMapping([RankCache(layout, regions)], [RankCache(peer_layout, peer_regions)])
        peer = backend.connect(info)
        ops = mapping.ops(RequestSpan(src_blocks, dst_blocks, src_slot, dst_slot, args.tokens))[(0, 0)]
        nbytes = sum(op.length for op in ops)
        view = mapping.view(0, 0)
        sent, send_ck_ms, send_ck_path = timed_checksums(CachedRequest(cache, layout, src_blocks, src_slot, args.tokens),
                                                         view.heads, view.mla, src_dev)
        conn.send(("checksums", dst_blocks, dst_slot, args.tokens))
        before, _, _ = recv(conn, "checksums")
        result["differed_before"] = len(mismatched_regions(sent, before))

        seconds = [write_and_wait(backend, peer, ops) for _ in range(args.warmup + args.reps)]
        label = " ".join([args.backend, *(f"{k}={v}" for k, v in opts.items())])  # e.g. "mooncake protocol=tcp"
        rows = [summary(f"{label} write, TPMapping ops", nbytes, len(ops), seconds[args.warmup:])]
        result["first_writes_ms"] = [s * 1e3 for s in seconds[: args.warmup]]

        conn.send(("checksums", dst_blocks, dst_slot, args.tokens))
        landed, recv_ck_ms, recv_ck_path = recv(conn, "checksums")
        bad = mismatched_regions(sent, landed)
        conn.send(("bytes", [(op.dst_addr, op.length) for op in ops]))
        landed_bytes = torch.frombuffer(bytearray(conn.recv_bytes()), dtype=torch.uint8)
        sent_bytes = torch.cat(byte_ranges(cache, regions, [(op.src_addr, op.length) for op in ops])).cpu()
        result.update(regions_checked=len(sent), checksum_mismatches=bad,
                      direct_compare_equal=bool(torch.equal(sent_bytes, landed_bytes)),
                      sender_checksum_ms=send_ck_ms, receiver_checksum_ms=recv_ck_ms,
                      checksum_paths=[send_ck_path, recv_ck_path])

        # Anchors, this process: the same ranges as tensor copies into a mirror of the decode cache on dst_dev.
        mirror, _ = allocate(args.preset, num_blocks + 1, 4, dst_dev, seed=3)
        mirror_flat = {name: t.view(-1).view(torch.uint8) for name, t in _named_tensors(mirror).items()}
        peer_by_name = {r.name: r for r in peer_regions.values()}
        dst_views = []
        for op in ops:
            r = next(r for r in peer_by_name.values() if r.addr <= op.dst_addr < r.addr + r.length)
            dst_views.append(mirror_flat[r.name][op.dst_addr - r.addr : op.dst_addr - r.addr + op.length])
        src_views = byte_ranges(cache, regions, [(op.src_addr, op.length) for op in ops])
        reps = args.reps
        rows.append(summary("torch peer copy, same ranges (one copy_ per op)", nbytes, len(ops),
                            copy_seconds(list(zip(src_views, dst_views)), src_dev, dst_dev, args.warmup, reps)))
        one_src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev)
        one_dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
        rows.append(summary("torch peer copy, same bytes as one buffer", nbytes, 1,
                            copy_seconds([(one_src, one_dst)], src_dev, dst_dev, args.warmup, reps)))
        del one_src, one_dst
        big = (1 << 20) if args.smoke else (1 << 30)
        big_src = torch.empty(big, dtype=torch.uint8, device=src_dev)
        big_dst = torch.empty(big, dtype=torch.uint8, device=dst_dev)
        rows.append(summary(f"torch peer copy, {big >> 20} MiB buffer (copy ceiling)", big, 1,
                            copy_seconds([(big_src, big_dst)], src_dev, dst_dev, 3, 10)))
        result["rows"] = rows
    finally:
        try:
            conn.send(None)
        except OSError:  # the decode process is gone already; its error was reported
            pass
        proc.join(60)
    report(result, args.out)
    if result["checksum_mismatches"] or not result["direct_compare_equal"] or not result["differed_before"]:
        sys.exit("handoff NOT byte-exact (see above)")


def report(result: dict, out: Path | None) -> None:
    rows = result["rows"]
    handoff, same_ranges, ceiling = rows[0], rows[1], rows[-1]
    print(f"\n### Handoff of one request, {result['preset']} TP{result['tp']} rank 0 -> rank 0, {result['tokens']} tokens "
          f"({result['src']} -> {result['dst']}, two processes; median of {result['reps']} after {result['warmup']} "
          "warm-ups)\n")
    print("| path | MB | ops | median ms | p90 ms | GB/s | vs same-ranges copy | vs big-buffer copy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['path']} | {r['bytes'] / 1e6:.1f} | {r['ops']} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} | "
              f"{r['gb_s']:.1f} | {100 * r['gb_s'] / same_ranges['gb_s']:.0f}% | {100 * r['gb_s'] / ceiling['gb_s']:.0f}% |")
    send_ck, recv_ck = statistics.median(result["sender_checksum_ms"]), statistics.median(result["receiver_checksum_ms"])
    print(f"\nfirst writes (warm-up) ms: {', '.join(f'{t:.2f}' for t in result['first_writes_ms'])}")
    print(f"checksum pass (transfer/checksum.py, on each side's device; median of {CHECKSUM_REPS}): sender share "
          f"{send_ck:.2f} ms, receiver landed {recv_ck:.2f} ms; handoff as the serving path runs it "
          f"(write + both checksums) {handoff['median_ms'] + send_ck + recv_ck:.2f} ms")
    mb = handoff["bytes"] / 1e6
    print(f"checksum kernel: {mb:.1f} MB in {result['regions_checked']} regions, sender path "
          f"{result['checksum_paths'][0]} {mb / send_ck:.1f} GB/s ({send_ck / handoff['median_ms']:.2f}x the write), "
          f"receiver path {result['checksum_paths'][1]} {mb / recv_ck:.1f} GB/s ({recv_ck / handoff['median_ms']:.2f}x "
          f"the write); goal each side < 1 ms (HBM read of these bytes at 4.8 TB/s: {mb / 4.8e6 * 1e3:.3f} ms)")
    print(f"byte-exact: {result['regions_checked']} region checksums "
          f"{'equal' if not result['checksum_mismatches'] else 'DIFFER: ' + ', '.join(result['checksum_mismatches'])}"
          f" (before the first write {result['differed_before']} differed); direct compare of "
          f"{handoff['bytes']} written bytes {'equal' if result['direct_compare_equal'] else 'DIFFERS'}")
    ratios = [100 * handoff["gb_s"] / r["gb_s"] for r in rows[1:]]
    print(f"goal: handoff >= 70% of the peer-copy rate. It runs at {ratios[0]:.0f}% of the same ranges as tensor "
          f"copies, {ratios[1]:.0f}% of the same bytes as one copy, {ratios[2]:.0f}% of the big-buffer copy -> "
          f"{'met' if ratios[0] >= 70 else 'MISSED'} against the same-ranges anchor, "
          f"{'met' if ratios[1] >= 70 else 'MISSED'} against the one-copy anchor")
    if out is not None:
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
