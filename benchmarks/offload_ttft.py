"""TTFT of a long prompt whose prefix is a prefix-cache hit in each tier, against no hit, in the same run.

    python benchmarks/offload_ttft.py [--prompt-len 4095] [--prefix-len 3584] [--runs 3] [--device cpu]
        [--mooncake-config JSON] [--out results.json]

A first request of `prefix-len + 1` tokens leaves its unit (MLA blocks + KDA checkpoint) at `prefix-len` tokens; the
timed request (`prompt-len` tokens, the prefix then a fresh suffix, one output token) then hits it:

    device    the engine that ran the first request, its device prefix cache intact
    host      the same engine after its device prefix cache is cleared (kv_offload="host")
    mooncake  a second engine that never saw the prefix, the first one's unit in Mooncake Store (kv_offload="mooncake")
    none      an engine with prefix caching off (recomputes everything)

For the tiers: the unit's bytes copied in (`TierCounts.bytes_in`), the load's wall time (copies + checksums, timed
around the runner's `load`) and its bandwidth. Without `--mooncake-config` a `mooncake_master` is started on loopback
(as the package documents). Each figure is the median of `runs`, each run a fresh random prefix; engines are built
and warmed up untimed. Every hit must produce the no-hit engine's token ("match").
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.checkpoint import make_checkpoint


@dataclass
class Row:
    tier: str
    ttft_ms: float
    cached_tokens: int
    bytes_moved: int  # into the device, all ranks (0: device hit or none)
    load_ms: float  # the tier's load: copies and checksums
    bandwidth_gb_s: float | None  # bytes_moved / load time
    speedup: float  # none's TTFT / this one's
    match: bool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_master(workdir: Path) -> tuple[subprocess.Popen, str]:
    master = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    rpc, http = _free_port(), _free_port()
    proc = subprocess.Popen([master, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
                             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir)
    for port in (rpc, http):
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("mooncake_master did not start")
                time.sleep(0.05)
    config = {"master_server_addr": f"127.0.0.1:{rpc}", "metadata_server": f"http://127.0.0.1:{http}/metadata",
              "global_segment_size": 512 * 2**20, "local_buffer_size": 128 * 2**20, "timeout_s": 10.0}
    return proc, json.dumps(config)


class _LoadTimer:
    """Wall time of a tier's runner-side loads (benchmark instrumentation around `TierData.load`)."""

    def __init__(self, engine: LLMEngine, tier: str) -> None:
        self.seconds = 0.0
        data = engine.runner.offload[tier]
        load = data.load

        def timed(op, device):
            start = time.perf_counter()
            try:
                return load(op, device)
            finally:
                if device.mla_kv[0].is_cuda:
                    torch.cuda.synchronize()
                self.seconds += time.perf_counter() - start

        data.load = timed


def _ttft(engine: LLMEngine, prompt: list[int]) -> tuple[float, int, int]:
    """(seconds to the first token, cached tokens, the token)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(prompt, params)
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.new_token_ids:
                elapsed = time.perf_counter() - start
                token, cached = delta.new_token_ids[0], delta.num_cached_tokens
    while engine.has_unfinished():  # the step that writes its unit through
        engine.step()
    return elapsed, cached, token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=4095)  # + 1 output token: k3-tiny's 4096 positions
    parser.add_argument("--prefix-len", type=int, default=3584)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="k3-tiny", help="a preset (written to a temporary checkpoint) or a directory")
    parser.add_argument("--mooncake-config", default=None, help="a running store's kv_offload_mooncake_config")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not 0 < args.prefix_len < args.prompt_len:
        parser.error("need 0 < --prefix-len < --prompt-len")

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model if Path(args.model).is_dir() else str(make_checkpoint(args.model, Path(tmp) / "ckpt", seed=0))
        master, store = (None, args.mooncake_config) if args.mooncake_config else _start_master(Path(tmp))
        try:
            rows = _run(args, model, store)
        finally:
            if master is not None:
                master.terminate()
                master.wait(timeout=10)
    print(f"{'tier':<9} {'TTFT ms':>9} {'cached':>7} {'bytes':>12} {'load ms':>8} {'GB/s':>6} {'speedup':>7} match")
    for r in rows:
        bw = f"{r.bandwidth_gb_s:.2f}" if r.bandwidth_gb_s is not None else "-"
        print(f"{r.tier:<9} {r.ttft_ms:>9.1f} {r.cached_tokens:>7} {r.bytes_moved:>12} {r.load_ms:>8.1f} {bw:>6} "
              f"{r.speedup:>7.2f} {'yes' if r.match else 'NO'}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "rows": [asdict(r) for r in rows]}, indent=2))


def _run(args: argparse.Namespace, model: str, store: str) -> list[Row]:
    base = dict(model=model, device=args.device, max_model_len=args.prompt_len + 1, max_num_seqs=4,
                enforce_eager=True)
    host = LLMEngine(EngineArgs(**base, kv_offload="host"))
    writer = LLMEngine(EngineArgs(**base, kv_offload="mooncake", kv_offload_mooncake_config=store))
    reader = LLMEngine(EngineArgs(**base, kv_offload="mooncake", kv_offload_mooncake_config=store))
    plain = LLMEngine(EngineArgs(**base, enable_prefix_caching=False))
    timers = {"host": _LoadTimer(host, "host"), "mooncake": _LoadTimer(reader, "mooncake")}
    counts = {"host": host.offload.counts["host"], "mooncake": reader.offload.counts["mooncake"]}
    gen = torch.Generator().manual_seed(4096)
    vocab = host.config.vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    for engine in (host, writer, reader, plain):  # warm-up, untimed
        _ttft(engine, tokens(args.prompt_len))
    samples: dict[str, list[tuple[float, int, int, float, bool]]] = {t: [] for t in ("device", "host", "mooncake", "none")}
    for _ in range(args.runs):
        prefix = tokens(args.prefix_len + 1)  # its unit: prefix_len tokens
        suffixes = {t: tokens(args.prompt_len - len(prefix)) for t in samples}
        for engine in (host, writer):
            _ttft(engine, prefix)
        want = {t: _ttft(plain, prefix + s)[2] for t, s in suffixes.items() if t != "none"}
        seconds, cached, token = _ttft(plain, prefix + suffixes["none"])
        samples["none"].append((seconds, cached, 0, 0.0, True))
        seconds, cached, token = _ttft(host, prefix + suffixes["device"])
        samples["device"].append((seconds, cached, 0, 0.0, token == want["device"]))
        for tier, engine in (("host", host), ("mooncake", reader)):
            if tier == "host":
                host.scheduler.prefix_cache.clear()  # evicted from the device: only the host tier holds the unit
            before, timed = counts[tier].bytes_in, timers[tier].seconds
            seconds, cached, token = _ttft(engine, prefix + suffixes[tier])
            samples[tier].append((seconds, cached, counts[tier].bytes_in - before, timers[tier].seconds - timed,
                                  token == want[tier]))
        reader.scheduler.prefix_cache.clear()
    for engine in (host, writer, reader, plain):
        engine.close()
    none_ttft = statistics.median(s[0] for s in samples["none"])
    rows = []
    for tier, runs in samples.items():
        ttft = statistics.median(s[0] for s in runs)
        moved, load = statistics.median(s[2] for s in runs), statistics.median(s[3] for s in runs)
        rows.append(Row(tier, ttft * 1e3, min(s[1] for s in runs), int(moved), load * 1e3,
                        moved / load / 1e9 if load else None, none_ttft / ttft, all(s[4] for s in runs)))
    return rows


if __name__ == "__main__":
    main()
