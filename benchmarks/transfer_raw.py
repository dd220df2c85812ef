"""Raw one-sided write bandwidth of each transfer backend between two processes on loopback.

For every backend and size: a receiver process registers a target region, a sender process
registers a source region, connects, does one warm-up write, then times `--reps` writes of one
op each (write + poll to DONE) and reports the median.

    python benchmarks/transfer_raw.py                          # mooncake and nixl, 1/16/256 MiB
    python benchmarks/transfer_raw.py --backends nixl --sizes-mib 1 16 --out raw.json
    UCX_TLS=tcp python benchmarks/transfer_raw.py --backends nixl   # one UCX transport only

GiB/s = size / median(seconds). Loopback numbers bound what the engine sees on one host; they do
not predict cross-host RDMA or GPU NVLink numbers (run it there for those).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback

MIB = 1 << 20


def _recv(conn, timeout: float):
    if not conn.poll(timeout):
        raise TimeoutError(f"no message within {timeout} s")
    return conn.recv()


def _receiver(backend: str, nbytes: int, conn) -> None:
    try:
        import torch

        from k3serve.transfer.backends import make_backend

        b = make_backend(backend)
        b.register("dst", torch.zeros(nbytes, dtype=torch.uint8))
        conn.send(("info", b.agent_info()))
        _recv(conn, 3600)
        b.close()
        conn.send(("closed",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _sender(backend: str, nbytes: int, sizes: list[int], reps: int, poll_sleep: float, conn) -> None:
    try:
        import torch

        from k3serve.transfer.backend import TransferStatus, WriteOp
        from k3serve.transfer.backends import make_backend

        b = make_backend(backend)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        b.register("src", src)
        info = _recv(conn, 120)
        peer = b.connect(info)
        dst = info.regions[0].addr

        def once(size: int) -> float:
            if size < 0:  # scattered: -size bytes as 4 KiB ops at an 8 KiB stride
                n = -size // 4096
                ops = [WriteOp(src.data_ptr() + i * 8192, dst + i * 8192, 4096) for i in range(n)]
            else:
                ops = [WriteOp(src.data_ptr(), dst, size)]
            t0 = time.perf_counter()
            h = b.write(peer, ops)
            while (s := b.poll(h)) is TransferStatus.PENDING:
                if poll_sleep:
                    time.sleep(poll_sleep)
            dt = time.perf_counter() - t0
            b.release(h)
            if s is not TransferStatus.DONE:
                raise RuntimeError(f"{backend}: write of {size} bytes {s.name}")
            return dt

        out = {}
        for size in sizes:
            once(size)  # warm-up: connection setup, first-touch
            out[size] = [once(size) for _ in range(reps)]
        b.close()
        conn.send(("result", out))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def run_backend(backend: str, sizes: list[int], reps: int, poll_sleep: float) -> dict[int, list[float]]:
    ctx = mp.get_context("spawn")
    nbytes = max(max(sizes), 2 * -min(sizes))
    rx, rx_child = ctx.Pipe()
    tx, tx_child = ctx.Pipe()
    procs = [
        ctx.Process(target=_receiver, args=(backend, nbytes, rx_child), daemon=True),
        ctx.Process(target=_sender, args=(backend, nbytes, sizes, reps, poll_sleep, tx_child), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        msg = _recv(rx, 120)
        if msg[0] == "error":
            raise RuntimeError(f"{backend} receiver failed:\n{msg[1]}")
        tx.send(msg[1])
        msg = _recv(tx, 600)
        if msg[0] == "error":
            raise RuntimeError(f"{backend} sender failed:\n{msg[1]}")
        return msg[1]
    finally:
        try:
            rx.send(("exit",))
            _recv(rx, 30)
        except (OSError, EOFError, TimeoutError):
            pass
        for p in procs:
            p.join(15)
            if p.is_alive():
                p.kill()
                p.join(5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="+", default=None, help="default: every installed one of mooncake, nixl")
    ap.add_argument("--sizes-mib", nargs="+", type=float, default=[1, 16, 256])
    ap.add_argument("--scatter-mib", type=float, default=4.0,
                    help="also time this many MiB written as 4 KiB ops at an 8 KiB stride (0 = skip)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--poll-sleep-us", type=float, default=20.0, help="sleep between polls (0 = spin)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)

    from k3serve.transfer.backends import available_backends

    avail = available_backends()
    backends = args.backends or [b for b in ("mooncake", "nixl") if avail.get(b)]
    sizes = [int(s * MIB) for s in args.sizes_mib]
    if args.scatter_mib > 0:
        sizes.append(-int(args.scatter_mib * MIB))  # negative = scattered 4 KiB ops
    rows = []
    for backend in backends:
        if not avail.get(backend):
            print(f"{backend}: not installed, skipped", file=sys.stderr)
            continue
        res = run_backend(backend, sizes, args.reps, args.poll_sleep_us * 1e-6)
        for size in sizes:
            med = statistics.median(res[size])
            rows.append(
                {
                    "backend": backend,
                    "size_bytes": abs(size),
                    "size_mib": abs(size) / MIB,
                    "ops": abs(size) // 4096 if size < 0 else 1,
                    "median_s": med,
                    "gib_s": abs(size) / med / 2**30,
                    "samples_s": res[size],
                }
            )

    print(f"{'backend':<10} {'size':>9} {'ops':>5} {'median':>11} {'GiB/s':>8}")
    for r in rows:
        size = f"{r['size_mib']:>6g} MiB"
        print(f"{r['backend']:<10} {size} {r['ops']:>5} {r['median_s'] * 1e3:>8.3f} ms {r['gib_s']:>8.2f}")
    if args.out:
        meta = {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "reps": args.reps,
            "poll_sleep_us": args.poll_sleep_us,
            "ucx_tls": os.environ.get("UCX_TLS"),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
