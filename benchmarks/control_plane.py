"""Control-plane overhead per request: Reserve + TransferReady round trips over loopback gRPC.

    python benchmarks/control_plane.py [--requests 200] [--clients 8] [--in-process] [--json out.json]

A real DecodeControlServer (thread pool) with a trivial in-memory handler, so the numbers are
the control plane's own cost (serialization, gRPC, thread hand-off), not the decode worker's.
The server runs in a child process (as in deployment: prefill and decode are separate processes);
`--in-process` runs it in this one, where client and server threads share one GIL.
Handshake is measured once and excluded from the per-request figure. `--clients N` also runs
N clients in parallel threads (N prefill ranks talking to one decode rank). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

from k3serve.transfer.auth import new_secret
from k3serve.transfer.backend import AgentInfo, RegionDesc
from k3serve.transfer.control import DecodeControlClient, DecodeControlServer, HandshakeInfo, Reservation

COMPAT = "bench"
AGENT = AgentInfo("local", "bench", b"", tuple(RegionDesc(f"mla.{i}", 4096 * i, 4096, "cpu") for i in range(64)))
CHECKSUMS = {"mla": "0" * 16, "kda_recurrent": "1" * 16, "kda_conv": "2" * 16}


class TrivialDecode:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.known: set[str] = set()

    def handshake(self, peer, layout_json, tp_size, tp_rank, request_id):
        return HandshakeInfo(AGENT, "{}", 1, 0)

    def reserve(self, request_id, num_tokens, lease_seconds, peer):
        with self.lock:
            self.known.add(request_id)
        return Reservation(tuple(range(-(-num_tokens // 16))), 0, time.time() + lease_seconds)

    def transfer_ready(self, request_id, from_rank, first_token_id, num_tokens, checksums, attempt):
        pass

    def abort(self, request_id, reason):
        with self.lock:
            self.known.discard(request_id)

    def heartbeat(self, request_ids, sender):
        with self.lock:
            return [r for r in request_ids if r not in self.known]


def stats_ms(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    pick = lambda q: 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"n": len(times), "median_ms": round(1000 * statistics.median(times), 3),
            "p90_ms": round(pick(0.90), 3), "p99_ms": round(pick(0.99), 3)}


def run_requests(client: DecodeControlClient, tag: str, num_requests: int, num_tokens: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"reserve": [], "transfer_ready": [], "per_request": []}
    for i in range(num_requests):
        rid = f"{tag}-{i}"
        t0 = time.perf_counter()
        client.reserve(rid, num_tokens, 30.0)
        t1 = time.perf_counter()
        client.transfer_ready(rid, 0, 1, num_tokens, CHECKSUMS)
        t2 = time.perf_counter()
        out["reserve"].append(t1 - t0)
        out["transfer_ready"].append(t2 - t1)
        out["per_request"].append(t2 - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192, help="prompt tokens per request (block ids returned)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--in-process", action="store_true", help="run the server in this process")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--secret", default=new_secret(), help=argparse.SUPPRESS)  # the child's: the parent's
    args = parser.parse_args()

    workers = max(8, args.clients)
    if args.serve:
        server = DecodeControlServer(TrivialDecode(), COMPAT, max_workers=workers, secret=args.secret).start()
        print(server.address, flush=True)
        sys.stdin.read()  # until the parent closes our stdin
        server.stop(0)
        return
    if args.in_process:
        server = DecodeControlServer(TrivialDecode(), COMPAT, max_workers=workers, secret=args.secret).start()
        address, stop = server.address, lambda: server.stop(0)
    else:
        child = subprocess.Popen([sys.executable, __file__, "--serve", "--clients", str(args.clients),
                                  "--secret", args.secret],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        address = child.stdout.readline().strip()

        def stop() -> None:
            child.stdin.close()
            child.wait(timeout=30)

    rows: dict[str, dict] = {}
    try:
        client = DecodeControlClient(address, COMPAT, timeout_s=5.0, secret=args.secret)
        t0 = time.perf_counter()
        client.handshake(AGENT, "{}", 1, 0)
        rows["handshake (64 regions, once)"] = stats_ms([time.perf_counter() - t0])
        run_requests(client, "warm", 20, args.tokens)
        seq = run_requests(client, "seq", args.requests, args.tokens)
        rows["Reserve"] = stats_ms(seq["reserve"])
        rows["TransferReady"] = stats_ms(seq["transfer_ready"])
        rows["per request: Reserve + TransferReady"] = stats_ms(seq["per_request"])
        ids = [f"seq-{i}" for i in range(64)]
        hb = []
        for _ in range(args.requests):
            t = time.perf_counter()
            client.heartbeat(ids, "bench")
            hb.append(time.perf_counter() - t)
        rows["Heartbeat (64 ids)"] = stats_ms(hb)
        client.close()

        clients = [DecodeControlClient(address, COMPAT, timeout_s=5.0, secret=args.secret) for _ in range(args.clients)]
        results: list[dict[str, list[float]]] = [{} for _ in clients]

        def work(k: int) -> None:
            results[k] = run_requests(clients[k], f"par{k}", args.requests, args.tokens)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(args.clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        for c in clients:
            c.close()
        par = [x for r in results for x in r["per_request"]]
        rows[f"per request, {args.clients} clients in parallel"] = {
            **stats_ms(par), "requests_per_s": round(len(par) / wall)}
    finally:
        stop()

    print(f"server {'in this process' if args.in_process else 'in a child process'} at {address}")
    print(f"{'measurement':44s} {'n':>6s} {'median ms':>10s} {'p90 ms':>8s} {'p99 ms':>8s} {'req/s':>8s}")
    for name, r in rows.items():
        print(f"{name:44s} {r['n']:6d} {r['median_ms']:10.3f} {r['p90_ms']:8.3f} {r['p99_ms']:8.3f} "
              f"{r.get('requests_per_s', ''):>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"requests": args.requests, "clients": args.clients, "tokens": args.tokens, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
