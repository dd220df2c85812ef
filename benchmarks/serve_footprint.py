"""Memory of README command 1's server at idle: `k3serve serve` (1 prefill + 1 decode replica on a local Ray,
Mooncake, the bundled k3-code), each process of its tree and the total.

    python benchmarks/serve_footprint.py [--settle-seconds 5] [--json out.json]

Starts the server as a new user would (fresh HOME: the checkpoint is written first), waits until /health is 200
and `--settle-seconds` more, reads every process's RSS and PSS from /proc, stops it with SIGTERM. PSS splits a
shared page among the processes mapping it, so the PSS total is the memory the tree holds; the RSS total counts
shared libraries (torch, Ray) once a process. The figure in README.md and docs/BENCHMARKS.md comes from here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "serving"))
from _server_harness import ServerSpec, launch, tree_memory  # noqa: E402

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settle-seconds", type=float, default=5.0, help="idle time after /health 200")
    parser.add_argument("--json", type=Path, help="also write the measurement here")
    args = parser.parse_args()
    start = time.monotonic()
    with launch(ServerSpec(embedded_default=True), None) as server:
        ready_s = time.monotonic() - start
        time.sleep(args.settle_seconds)
        processes = tree_memory(server.process.pid)
        stop_s = server.stop()
    rss, pss = sum(p.rss_bytes for p in processes), sum(p.pss_bytes for p in processes)
    print(f"{'RSS MiB':>8} {'PSS MiB':>8}  process")
    for p in sorted(processes, key=lambda p: -p.pss_bytes):
        print(f"{p.rss_bytes / MIB:8.0f} {p.pss_bytes / MIB:8.0f}  {p.pid} {p.command[:60]}")
    print(f"{rss / MIB:8.0f} {pss / MIB:8.0f}  total of {len(processes)} processes "
          f"(ready in {ready_s:.1f} s, stopped in {stop_s:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps({"rss_bytes": rss, "pss_bytes": pss, "ready_seconds": ready_s,
                                         "stop_seconds": stop_s, "processes": [asdict(p) for p in processes]},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
