"""Time and peak memory of one tiny-model forward on CPU (the README status table's numbers).

    python benchmarks/tiny_forward.py [--tokens 512] [--repeats 10]

Prints the median wall time of a full-sequence forward (fresh cache each run, after one
warm-up) and the process's peak RSS, before and after the forward passes.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time

import torch

from k3serve.model.checkpoint import make_checkpoint
from k3serve.model.loader import load_model
from k3serve.model.score import score_tokens


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        make_checkpoint("k3-tiny", d, seed=0)
        model = load_model(d)
    rss_loaded = peak_rss_mib()
    ids = torch.randint(0, model.config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    score_tokens(model, ids)  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        score_tokens(model, ids)
        times.append(time.perf_counter() - start)
    result = {
        "tokens": args.tokens,
        "median_ms": round(1000 * statistics.median(times), 2),
        "tokens_per_s": round(args.tokens / statistics.median(times)),
        "peak_rss_after_load_mib": round(rss_loaded, 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
