"""Model-level evaluations of a trained checkpoint (tools/train), each printing its table.

    python benchmarks/eval_model.py --model DIR [--device cpu|cuda] [--seq-len 512] [--num-tokens 8192]
        [--long-context 4096] [--functions 40] [--tp2] [--drafter DIR] [--out results.json]

1. Held-out perplexity (third-party source, `tools/train/corpus.py` HELD_OUT_PACKAGES, never trained on) through
   each serving path, per token against the fp32 reference (`model/score.py`, one full-sequence forward a
   window): the engine's chunked prefill (prompt logprobs, 64-token chunks), TP 2 (`--tp2`: a spawned rank 1,
   gloo on the CPU), and on CUDA the bf16 GPU kernels. A path agrees when its perplexity is within PATH_TOLERANCE
   of the reference's (relative).
2. Prefix-cache hits: a greedy continuation of a prompt whose prefix is cached equals the uncached one's, tokens
   and logprobs (the KDA checkpoint and the MLA blocks restored instead of recomputed). Likewise through a
   disaggregated 1P1D deployment in this process: the decode worker continues from the handed-off state.
3. Greedy exact match on held-out function bodies: the file up to a function's body as the prompt, the body
   (at most 48 tokens) as the answer; exact match and mean matched prefix.
4. Long context: held-out perplexity by position over `--long-context` tokens (KDA state and MLA over the whole
   window), and a planted fact: `SECRET = "<code>"` early, held-out code after, `assert SECRET == "` at the end.
5. Speculative decoding, greedy, on held-out code prompts: prompt lookup (n-gram, 4 drafts) and, with `--drafter`,
   the drafter (4 and 8 drafts): mean acceptance length, acceptance by draft position, and whether tokens and
   logprobs equal plain decoding's.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import math
import multiprocessing
import random
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm import LLM
from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.draft.config import DrafterConfig
from k3serve.model.loader import load_model
from k3serve.model.score import score_tokens
from k3serve.model.tokenizer import Tokenizer
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ lives in the checkout, not the package
from tools.train.corpus import SourceFile, held_out_sources  # noqa: E402
from tools.train.data import eval_windows, token_stream  # noqa: E402

PATH_TOLERANCE = {"cpu": 1e-3, "cuda": 2e-2}  # relative perplexity difference from the fp32 reference
MAX_BODY_TOKENS = 48


@dataclass
class PathRow:
    path: str
    ppl: float
    rel_diff: float  # |ppl / reference ppl - 1|
    max_nll_diff: float  # largest per-token |NLL - reference NLL|
    agrees: bool


def held_out_windows(tokenizer: Tokenizer, seq_len: int, num_tokens: int) -> torch.Tensor:
    """[n, seq_len + 1] of the held-out stream (the trainer's held-out evaluation uses the same windows)."""
    files, _ = held_out_sources()
    return eval_windows(token_stream(tokenizer, files), seq_len, num_tokens)


def reference_nll(model_dir: Path, windows: torch.Tensor) -> torch.Tensor:
    """[n, L] per-token NLL of one fp32 full-sequence forward a window (model/score.py)."""
    model = load_model(model_dir)
    rows = []
    for w in windows.tolist():
        logprobs = score_tokens(model, w[:-1]).log_softmax(-1)
        rows.append(-logprobs.gather(1, torch.tensor(w[1:])[:, None]).squeeze(1))
    return torch.stack(rows)


def engine_nll(engine: LLMEngine, windows: torch.Tensor) -> torch.Tensor:
    """[n, L] per-token NLL from the engine's prompt logprobs (each window a prompt, all queued at once)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    ids = [engine.add_request(w.tolist(), params) for w in windows]
    scored: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.error is not None:
                raise RuntimeError(delta.error)
            if delta.prompt_logprobs is not None:
                scored[delta.request_id] = [-entry.chosen_logprob for entry in delta.prompt_logprobs[1:]]
    return torch.tensor([scored[i] for i in ids])


def ppl(nll: torch.Tensor) -> float:
    return math.exp(nll.double().mean().item())


def path_row(name: str, nll: torch.Tensor, ref: torch.Tensor, device: str) -> PathRow:
    rel = abs(ppl(nll) / ppl(ref) - 1)
    return PathRow(name, ppl(nll), rel, (nll - ref).abs().max().item(), rel <= PATH_TOLERANCE[device])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _follower(rank: int, args: EngineArgs, init_method: str) -> None:
    from k3serve.engine.follower import join_engine
    from k3serve.engine.tp_group import follow_forever

    group, runner, _ = join_engine(rank, args, init_method, num_threads=1)
    try:
        follow_forever(group, {"step": lambda output, want: runner.execute(output, want)})
    finally:
        group.close()


def tp2_nll(args: EngineArgs, windows: torch.Tensor) -> torch.Tensor:
    """`engine_nll` on a TP 2 engine: rank 0 here, rank 1 a spawned process."""
    from k3serve.engine.tp_group import TPGroup

    args = EngineArgs(**{**asdict(args), "tensor_parallel_size": 2})
    init = f"tcp://127.0.0.1:{_free_port()}"
    follower = multiprocessing.get_context("spawn").Process(target=_follower, args=(1, args, init), daemon=True)
    follower.start()
    try:
        engine = LLMEngine(args, TPGroup(0, 2, init, timeout_s=60))
        try:
            return engine_nll(engine, windows)
        finally:
            engine.close()
    finally:
        follower.join(30)
        if follower.is_alive():
            follower.kill()


def prefix_cache_check(args: EngineArgs, prompts: list[list[int]], max_tokens: int = 16) -> dict:
    """Greedy continuations with the prompts' first halves cached equal those of an engine without a cache."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    plain = LLM(**{**asdict(args), "enable_prefix_caching": False}).generate(prompts, params)
    cached_llm = LLM(**asdict(args))
    cached_llm.generate([p[: len(p) // 2 + args.block_size] for p in prompts], SamplingParams(max_tokens=1))
    cached = cached_llm.generate(prompts, params)
    return {"cached_tokens": sum(o.num_cached_tokens for o in cached),
            "tokens_match": all(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(plain, cached)),
            "max_logprob_diff": _max_logprob_diff(plain, cached)}


def disagg_check(args: EngineArgs, prompts: list[list[int]], max_tokens: int = 16) -> dict:
    """Greedy continuations through a disaggregated 1P1D deployment in this process (the local launcher and the
    `local` transfer: the prefill worker hands each prompt's MLA blocks and KDA state to the decode worker, which
    generates every token) equal the colocated engine's, tokens and logprobs."""
    from k3serve.cluster.config import ServeConfig
    from k3serve.cluster.serve import start_deployment
    from k3serve.engine.stream_types import GenerateRequest

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    plain = LLM(**asdict(args)).generate(prompts, params)
    engine = {name: getattr(args, name) for name in ("device", "dtype", "block_size", "max_model_len",
                                                      "max_num_seqs", "cache_memory_bytes")}
    deployment = start_deployment(ServeConfig(model=args.model, launcher="local", transfer="local", **engine))

    async def served(i: int, prompt: list[int]) -> tuple[list[int], list[float]]:
        tokens, logprobs = [], []
        async for delta in deployment.client.generate(GenerateRequest(f"eval-disagg-{i}", prompt, params)):
            tokens += delta.new_token_ids
            logprobs += [entry.chosen_logprob for entry in delta.logprobs or []]
        return tokens, logprobs

    async def serve_all() -> list[tuple[list[int], list[float]]]:
        return await asyncio.gather(*(served(i, p) for i, p in enumerate(prompts)))

    try:
        got = asyncio.run(serve_all())
    finally:
        deployment.shutdown()
    diffs = [abs(a[t].logprob - b) for want, (_, lps) in zip(plain, got)
             for a, t, b in zip(want.outputs[0].logprobs, want.outputs[0].token_ids, lps)]
    return {"prompts": len(prompts), "tokens_match": all(w.outputs[0].token_ids == t for w, (t, _) in zip(plain, got)),
            "max_logprob_diff": max(diffs, default=0.0)}


def function_cases(tokenizer: Tokenizer, files: list[SourceFile], count: int,
                   context: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, body) token pairs: functions of the held-out files whose body (after its docstring) is at most
    MAX_BODY_TOKENS tokens, the prompt the file up to that body (its last `context` tokens); a fixed sample."""
    cases = []
    for f in files:
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        lines = f.text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
                continue
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            if not body:
                continue
            start = body[0].lineno - 1
            answer = "".join(lines[start : node.end_lineno])
            answer_ids = tokenizer.encode(answer) if len(answer) <= 16 * MAX_BODY_TOKENS else []
            if 0 < len(answer_ids) <= MAX_BODY_TOKENS:
                cases.append(("".join(lines[:start]), answer_ids))
    chosen = random.Random(0).sample(cases, min(count, len(cases)))
    # a token takes at most a few characters of code: the prompt's tail, encoded, holds `context` tokens
    return [(tokenizer.encode(prefix[-16 * context :])[-context:], answer) for prefix, answer in chosen]


def _matched_prefix(got: list[int], want: list[int]) -> int:
    """Tokens of `want` that `got` repeats before its first difference."""
    return next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))


def exact_match(llm: LLM, cases: list[tuple[list[int], list[int]]]) -> dict:
    outs = llm.generate([p for p, _ in cases],
                        [SamplingParams(temperature=0, max_tokens=len(a), ignore_eos=True) for _, a in cases])
    matched = [_matched_prefix(out.outputs[0].token_ids, answer) / len(answer) for (_, answer), out in zip(cases, outs)]
    return {"functions": len(cases), "exact_match": sum(m == 1.0 for m in matched) / max(1, len(cases)),
            "mean_matched_fraction": sum(matched) / max(1, len(matched))}


def position_ppl(nll: torch.Tensor, num_buckets: int = 4) -> list[tuple[str, float]]:
    """Perplexity over [start, end) position buckets of a [n, L] NLL, doubling in length: the long-context curve."""
    L = nll.shape[1]
    edges = [0] + [L >> (num_buckets - 1 - i) for i in range(num_buckets)]
    return [(f"{a}-{b}", ppl(nll[:, a:b])) for a, b in zip(edges, edges[1:]) if b > a]


def planted_fact(llm: LLM, tokenizer: Tokenizer, filler: list[int], trials: int = 4) -> dict:
    """A code defined early in the prompt, asked for after `filler`: the fraction of trials answered exactly."""
    rng = random.Random(0)
    prompts, codes = [], []
    for _ in range(trials):
        code = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8))
        codes.append(code)
        prompts.append(tokenizer.encode(f'SECRET = "{code}"\n\n') + filler + tokenizer.encode('\n\nassert SECRET == "'))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    hits = [out.outputs[0].text.startswith(code) for code, out in zip(codes, outs)]
    return {"prompt_tokens": len(prompts[0]), "trials": trials, "recalled": sum(hits) / trials}


def greedy_agreement(reference: EngineArgs, other: EngineArgs, prompts: list[list[int]], max_tokens: int = 32) -> dict:
    """How many greedy tokens the `other` engine emits before it first differs from the `reference` engine."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    want, got = (LLM(**asdict(a)).generate(prompts, params) for a in (reference, other))
    same = [_matched_prefix(g.outputs[0].token_ids, w.outputs[0].token_ids) for g, w in zip(got, want)]
    return {"prompts": len(prompts), "max_tokens": max_tokens, "mean_tokens_before_divergence": sum(same) / len(same)}


def spec_acceptance(args: EngineArgs, prompts: list[list[int]], plain: list, speculative_config: dict,
                    max_tokens: int) -> dict:
    """Greedy decoding with `speculative_config` against `plain` (the same prompts decoded without it): the mean
    acceptance length (tokens a verify row emits: 1 + accepted drafts), the acceptance rate at each draft
    position, and whether tokens and logprobs equal plain decoding's."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    spec_llm = LLM(**{**asdict(args), "speculative_config": speculative_config})
    spec = spec_llm.generate(prompts, params)
    stats = spec_llm.engine.spec_stats
    return {"method": speculative_config["method"], "num_speculative_tokens": speculative_config[
                "num_speculative_tokens"], "prompts": len(prompts), "verify_rows": stats.num_drafts,
            "mean_acceptance_length": stats.mean_acceptance_length,
            "acceptance_rate_by_position": [round(n / max(1, stats.num_drafts), 3) for n in stats.accepted_per_position],
            "tokens_match": all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(plain, spec)),
            "max_logprob_diff": _max_logprob_diff(plain, spec)}


def speculative_checks(args: EngineArgs, prompts: list[list[int]], drafter: Path | None,
                       max_tokens: int = 64) -> list[dict]:
    """n-gram prompt lookup with 4 drafts and, given a drafter checkpoint, the drafter with 4 and 8 drafts."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    plain = LLM(**asdict(args)).generate(prompts, params)
    configs = [{"method": "ngram", "num_speculative_tokens": 4}]
    if drafter is not None:
        method = DrafterConfig.from_dir(drafter).method
        configs += [{"method": method, "model": str(drafter), "num_speculative_tokens": k} for k in (4, 8)]
    return [spec_acceptance(args, prompts, plain, c, max_tokens) for c in configs]


def _max_logprob_diff(want: list, got: list) -> float:
    """The largest |logprob difference| of the chosen tokens two generations share, position by position."""
    return max((abs(a[t].logprob - b[u].logprob) for x, y in zip(want, got)
                for a, b, t, u in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, x.outputs[0].token_ids,
                                      y.outputs[0].token_ids)), default=0.0)


def evaluate(model_dir: Path, device: str = "cpu", seq_len: int = 512, num_tokens: int = 8192,
             long_context: int = 4096, functions: int = 40, tp2: bool = False, drafter: Path | None = None,
             paths_only: bool = False) -> dict:
    """Every evaluation above; returns the results (printed by `main`). `paths_only`: the perplexity paths alone
    and, on CUDA, the GPU engine's greedy agreement and speculative decoding (a short device call)."""
    tokenizer = Tokenizer.from_dir(model_dir)
    args = EngineArgs(model=str(model_dir), device="cpu", dtype="float32",
                      max_model_len=max(long_context, seq_len) + 128, max_num_batched_tokens=64, max_num_seqs=16,
                      cache_memory_bytes=256 << 20)
    windows = held_out_windows(tokenizer, seq_len, num_tokens)
    ref = reference_nll(model_dir, windows)
    rows = [PathRow("fp32 reference (model/score.py)", ppl(ref), 0.0, 0.0, True),
            path_row("engine, chunked prefill (64-token chunks)", engine_nll(LLMEngine(args), windows), ref, "cpu")]
    if tp2:
        rows.append(path_row("engine, TP 2 (gloo)", tp2_nll(args, windows), ref, "cpu"))
    gpu_greedy = None
    if device == "cuda":
        gpu = EngineArgs(**{**asdict(args), "device": "cuda", "dtype": "bfloat16", "max_num_batched_tokens": None})
        rows.append(path_row("engine, bf16 GPU kernels (prefill)", engine_nll(LLMEngine(gpu), windows), ref, "cuda"))
        # decode steps replay CUDA graphs: bf16 greedy text against fp32 CPU text (bf16 may diverge late)
        gpu_greedy = greedy_agreement(args, gpu, [w[: seq_len // 2].tolist() for w in windows[:8]])
    head = {"model": str(model_dir), "held_out_tokens": int(windows[:, 1:].numel()), "tolerance": PATH_TOLERANCE,
            "paths": [asdict(r) for r in rows], "gpu_greedy": gpu_greedy}
    if paths_only:
        spec_args = gpu if device == "cuda" else args
        return head | {"speculative": speculative_checks(spec_args, [w[:seq_len // 2].tolist() for w in windows[:8]],
                                                         drafter)}
    files, _ = held_out_sources()
    stream = token_stream(tokenizer, files)
    llm = LLM(**{**asdict(args), "max_num_batched_tokens": None})
    long_windows = eval_windows(stream, long_context, long_context)
    return head | {
        "prefix_cache": prefix_cache_check(args, [w.tolist() for w in windows[:4]]),
        "disagg": disagg_check(args, [w[: seq_len // 2].tolist() for w in windows[:4]]),
        "function_bodies": exact_match(llm, function_cases(tokenizer, files, functions, seq_len)),
        "long_context_ppl_by_position": position_ppl(engine_nll(llm.engine, long_windows)),
        "planted_fact": planted_fact(llm, tokenizer, stream[: long_context - 32].tolist()),
        "speculative": speculative_checks(args, [w[:seq_len // 2].tolist() for w in windows[:8]], drafter),
    }


def print_tables(results: dict) -> None:
    print(f"held-out perplexity, {results['held_out_tokens']} tokens (agreement: within "
          f"{results['tolerance']['cpu']:.0e} relative on the CPU, {results['tolerance']['cuda']:.0e} on CUDA)")
    print("| path | ppl | rel. diff | max token NLL diff | agrees |\n|---|---|---|---|---|")
    for r in results["paths"]:
        print(f"| {r['path']} | {r['ppl']:.3f} | {r['rel_diff']:.2e} | {r['max_nll_diff']:.2e} | {r['agrees']} |")
    if "prefix_cache" in results:  # not in a --paths-only run
        _print_checks(results)
    print("\nspeculative decoding, greedy, on held-out code prompts\n| method | drafts | mean acceptance length | "
          "acceptance by position | tokens match | max logprob diff |\n|---|---|---|---|---|---|")
    for sp in results["speculative"]:
        print(f"| {sp['method']} | {sp['num_speculative_tokens']} | {sp['mean_acceptance_length']:.2f} | "
              f"{', '.join(f'{r:.2f}' for r in sp['acceptance_rate_by_position'])} | {sp['tokens_match']} | "
              f"{sp['max_logprob_diff']:.2e} |")
    if (gg := results["gpu_greedy"]) is not None:
        print(f"bf16 GPU greedy (CUDA graphs) vs fp32 CPU: {gg['mean_tokens_before_divergence']:.1f} of "
              f"{gg['max_tokens']} tokens before the first difference, {gg['prompts']} prompts")


def _print_checks(results: dict) -> None:
    """The checks beyond the perplexity paths: prefix cache, handoff, function bodies, long context."""
    pc, fb, pf = results["prefix_cache"], results["function_bodies"], results["planted_fact"]
    print(f"\nprefix-cache hits: {pc['cached_tokens']} tokens cached, tokens match {pc['tokens_match']}, "
          f"max logprob diff {pc['max_logprob_diff']:.2e}")
    dg = results["disagg"]
    print(f"disaggregated 1P1D handoff (local transfer): {dg['prompts']} greedy continuations, tokens match "
          f"{dg['tokens_match']}, max logprob diff {dg['max_logprob_diff']:.2e}")
    print(f"function bodies: {fb['functions']} cases, exact match {fb['exact_match']:.1%}, "
          f"mean matched fraction {fb['mean_matched_fraction']:.1%}")
    by_position = results["long_context_ppl_by_position"]
    print("long context, ppl by position: " + ", ".join(f"{b}: {p:.2f}" for b, p in by_position))
    print(f"planted fact at {pf['prompt_tokens']} tokens: recalled {pf['recalled']:.0%} of {pf['trials']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="a checkpoint written by tools/train")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--num-tokens", type=int, default=8192)
    parser.add_argument("--long-context", type=int, default=4096)
    parser.add_argument("--functions", type=int, default=40)
    parser.add_argument("--tp2", action="store_true", help="add the TP 2 path (a second process)")
    parser.add_argument("--drafter", type=Path, default=None,
                        help="a drafter checkpoint for the model (e.g. model/assets/k3-code-eagle): its acceptance")
    parser.add_argument("--paths-only", action="store_true",
                        help="the perplexity paths and, on CUDA, the GPU greedy and speculative rows only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    results = evaluate(args.model, args.device, args.seq_len, args.num_tokens, args.long_context, args.functions,
                       args.tp2, args.drafter, args.paths_only)
    print_tables(results)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["agrees"] for r in results["paths"]) else 1


if __name__ == "__main__":
    sys.exit(main())
