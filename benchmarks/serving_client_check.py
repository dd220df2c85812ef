"""The GPU serving benchmark's load client (`gpu_serving.py`) against guidellm on the same CPU server: both drive
one `k3serve serve` (k3-tiny, colocated, --launcher local) at the same concurrency, prompt and output lengths, one
after the other; their medians and p90s of TTFT, ITL, TPOT and e2e, and output tok/s, side by side. guidellm cannot
run on the GPU machine (no network, not carried); this shows the two clients measure the same quantities.

    python benchmarks/serving_client_check.py [--concurrency 1,4] [--requests 16] [--prompt-tokens 120]
                                              [--output-tokens 32] [--out check.json]

guidellm sends text (synthetic_text, chat completions, its prompt length before the chat template); ours sends token
ids (completions): the prompts differ by the template's few tokens."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "serving"))

from _server_harness import ServerSpec, launch  # noqa: E402
from gpu_serving import Prompts, Window, serve_window  # noqa: E402
from k3serve.model.checkpoint import make_checkpoint  # noqa: E402

GUIDELLM = {"ttft": "time_to_first_token_ms", "itl": "inter_token_latency_ms", "tpot": "time_per_output_token_ms",
            "e2e": "request_latency"}  # request_latency in seconds


def guidellm_exe() -> str:
    for exe in (Path(sys.executable).with_name("guidellm"), shutil.which("guidellm")):
        if exe and Path(exe).exists():
            return str(exe)
    sys.exit("guidellm is not installed (pip install -e '.[test]')")


def run_guidellm(url: str, model_dir: Path, c: int, args: argparse.Namespace, report: Path) -> dict:
    cmd = [guidellm_exe(), "run", "--backend", f"kind=openai_http,target={url}",
           "--profile", f"kind=concurrent,streams={c}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
           "--constraint", f"kind=max_requests,count={args.requests}",
           "--tokenizer", f"kind=huggingface_auto,model={model_dir}", "--output", f"kind=json,path={report}",
           "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        sys.exit(f"guidellm failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    (bench,) = json.loads(report.read_text())["benchmarks"]
    metrics, out = bench["metrics"], {"wall_s": time.perf_counter() - t0}
    for key, name in GUIDELLM.items():
        dist = metrics[name]["successful"]
        scale = 1e3 if key == "e2e" else 1.0
        out[key] = {"median": dist["median"] * scale, "p90": dist["percentiles"]["p90"] * scale}
    out["out_tok_s"] = metrics["output_tokens_per_second"]["successful"]["mean"]
    out["completed"] = bench["scheduler_metrics"]["requests_made"]["successful"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--requests", type=int, default=16, help="guidellm's requests a level (ours: as many seconds)")
    p.add_argument("--prompt-tokens", type=int, default=120)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        model_dir = make_checkpoint("k3-tiny", Path(d) / "tiny", seed=0)
        spec = ServerSpec(mode="colocated", launcher="local")
        with launch(spec, model_dir) as server:
            for c in (int(x) for x in args.concurrency.split(",")):
                theirs = run_guidellm(server.url, model_dir, c, args, Path(d) / f"guidellm-c{c}.json")
                window = serve_window(server.url, server.model, Prompts(args.prompt_tokens, 450), c,
                                      args.output_tokens, theirs["wall_s"] / 2, 60.0,
                                      Window("colocated", "all_on", 0, c, theirs["wall_s"] / 2))
                ours = {**window.stats_ms, "out_tok_s": window.out_tok_s, "completed": window.completed}
                rows[c] = {"guidellm": theirs, "ours": ours}
    print(f"k3-tiny on the CPU, colocated; {args.prompt_tokens} in / {args.output_tokens} out; median (p90), ms")
    print("| concurrency | client | requests | TTFT | ITL | TPOT | e2e | out tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for c, both in rows.items():
        for client, r in both.items():
            cells = [f"{r[k]['median']:.1f} ({r[k]['p90']:.1f})" for k in GUIDELLM]
            print(f"| {c} | {client} | {r['completed']} | " + " | ".join(cells) + f" | {r['out_tok_s']:.1f} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
