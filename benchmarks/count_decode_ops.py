"""Ops one decode step dispatches, counted on the CPU: a proxy for the GPU kernels of a step, since every
aten op the model layers issue outside `kernels/` is one GPU kernel launch there (and a CUDA graph replays
them all). Counts the aten ops that launch a kernel (not views, nor no-op casts) of `model(batch, cache)` +
`compute_logits` for one decode step of k3-tiny-gpu (K3's per-head sizes, `model/presets.py`) in bf16,
split by the source file that issued them; `kernels/` ops run their torch references here, so their
counts stand in for the GPU kernels only loosely, while the rest (model/) are the GPU's own counts.
On CUDA (`--device cuda`, e.g. `--config k3-rank-slice --layers 4`) the GPU kernels run, so the counts are
exactly the torch launches a step adds to its Triton and cuBLAS kernels; `--lines` lists them by source line.
`--tp N` runs rank 0 of a TP N model instead (collectives skipped), so the CPU counts the TP > 1 paths too
(the vocab-parallel embedding's gather, the MoE's fp32 all-reduce of the shared experts).

    python benchmarks/count_decode_ops.py [--batch 1] [--ctx 64] [--device cpu] [--config k3-tiny-gpu]
                                          [--layers 12] [--tp N] [--lines 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from gpu_engine import CONFIGS, build_model, decode_step_fn, make_cache, rank_slice_hf  # noqa: E402

from k3serve.kernels.embedding import naive as embedding_naive  # noqa: E402
from k3serve.kernels.gate import naive as gate_naive  # noqa: E402
from k3serve.kernels.head_matmul import naive as head_matmul_naive  # noqa: E402
from k3serve.kernels.norm import naive as norm_naive  # noqa: E402

_ROOT = str(Path(__file__).resolve().parents[1]) + "/"
# The torch references of the ops that are one launch a call on CUDA (a Triton kernel or one cuBLAS GEMM):
# reference file -> (module, functions)
_ONE_LAUNCH = {
    "kernels/norm/naive.py": (norm_naive, ("rms_norm", "gated_rms_norm", "l2_normalize")),
    "kernels/gate/naive.py": (gate_naive, ("sigmoid_gate",)),
    "kernels/embedding/naive.py": (embedding_naive, ("shard_embedding",)),
    "kernels/head_matmul/naive.py": (head_matmul_naive, ("head_matmul",)),
}
_FREE = {"empty", "empty_strided", "new_empty", "new_empty_strided", "detach", "detach_", "lift_fresh",
         "_local_scalar_dense", "is_nonzero", "item", "set_"}  # host-only: no kernel launched


def _origin() -> tuple[str, int]:
    """The k3serve source file (relative to the repository) and line of the innermost frame that issued the op."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_ROOT) and "/benchmarks/" not in name:
            return name[len(_ROOT):], frame.f_lineno
        frame = frame.f_back
    return "?", 0


def _storages(value) -> set[int]:
    flat = value if isinstance(value, (list, tuple)) else [value]
    return {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}


def _launches(name: str, args: tuple, out) -> bool:
    """Whether the op runs a kernel: not when it is host-only or its result aliases an input (a view, a
    reshape of contiguous data, a `.to()` to the dtype a tensor already has); in-place ops always do."""
    if name in _FREE:
        return False
    if name.endswith("_"):
        return True
    inputs = set().union(*(_storages(a) for a in args)) if args else set()
    return not (_storages(out) and _storages(out) <= inputs)


class OpCounter(TorchDispatchMode):
    """Counts launching aten ops by the file that issued them; casts (a new tensor of another dtype) apart.

    The mode sees composite ops (`to`, `linear`, `reshape`) before they decompose, one count each."""

    def __init__(self) -> None:
        super().__init__()
        self.by_file: collections.Counter[str] = collections.Counter()
        self.casts: collections.Counter[str] = collections.Counter()
        self.by_line: collections.Counter[str] = collections.Counter()  # "file:line op" -> launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if _launches(name, args, out):
            origin, line = _origin()
            self.by_file[origin] += 1
            self.by_line[f"{origin}:{line} {name}"] += 1
            src = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if name in ("to", "_to_copy", "type_as", "copy_") and src is not None and isinstance(out, torch.Tensor) \
                    and (out.dtype != src.dtype if name != "copy_" else args[1].dtype != src.dtype):
                self.casts[origin] += 1
        return out


@contextlib.contextmanager
def _counting_calls(module, names: tuple[str, ...]):
    """Within the block, calls of module.<name> (looked up through the module) are counted by name."""
    calls: collections.Counter[str] = collections.Counter()
    saved = {name: getattr(module, name) for name in names}

    def counted(name: str, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(module, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def count_step(batch: int, ctx: int, device: str = "cpu", config: str = "k3-tiny-gpu", layers: int = 12,
               tp: int | None = None) -> dict:
    hf, tp_size = CONFIGS[config]
    tp_size = tp or tp_size
    hf = rank_slice_hf(layers) if hf is None else hf
    dev, dtype = torch.device(device), torch.bfloat16
    model = build_model(hf, tp_size, dev, dtype)
    cache = make_cache(model, tp_size, batch, ctx, dev, dtype)
    step = decode_step_fn(model, cache, batch, ctx)
    step()  # warm-up: lazy imports, first-call paths
    counter = OpCounter()
    with counter, contextlib.ExitStack() as stack:
        calls = [stack.enter_context(_counting_calls(module, names)) for module, names in _ONE_LAUNCH.values()]
        step()
    model_ops = sum(n for f, n in counter.by_file.items() if f.startswith("model/"))
    return {
        "config": config, "device": device, "dtype": "bf16", "batch": batch, "ctx": ctx, "tp": tp_size,
        "layers": model.config.num_hidden_layers,
        "ops_total": sum(counter.by_file.values()),
        "ops_in_model": model_ops,
        "casts_total": sum(counter.casts.values()),
        # on CUDA each call of those ops is one launch instead of its reference's ops (a CUDA run calls no
        # reference: there this is ops_total, the Triton launches uncounted)
        "ops_with_kernels_as_one": sum(counter.by_file.values()) - sum(counter.by_file[f] for f in _ONE_LAUNCH)
        + sum(sum(c.values()) for c in calls),
        "casts_in_model": sum(n for f, n in counter.casts.items() if f.startswith("model/")),
        "ops_by_file": dict(counter.by_file.most_common()),
        "casts_by_file": dict(counter.casts.most_common()),
        "ops_by_line": dict(counter.by_line.most_common()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", default="k3-tiny-gpu", choices=sorted(CONFIGS))
    parser.add_argument("--layers", type=int, default=12, help="k3-rank-slice: K3's first LAYERS layers")
    parser.add_argument("--tp", type=int, help="rank 0 of this TP size (default: the config's, 1 or 8)")
    parser.add_argument("--lines", type=int, default=0, help="also list the N source lines that launch most")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = count_step(args.batch, args.ctx, args.device, args.config, args.layers, args.tp)
    print(f"{result['config']} {result['layers']} layers, TP {result['tp']} rank 0, batch {args.batch}, "
          f"ctx {args.ctx}: "
          f"{result['ops_total']} aten ops per decode step ({result['ops_in_model']} issued by model/), "
          f"{result['casts_total']} casts ({result['casts_in_model']} by model/); "
          + (f"{result['ops_with_kernels_as_one']} with each call of an op that is one launch on CUDA (norms, sigmoid "
             "gate, shard embedding, head matmul) counted one" if torch.device(args.device).type == "cpu"
             else "its Triton kernels are not aten ops: not counted"))
    for name, n in result["ops_by_file"].items():
        print(f"  {n:6d}  {name}  ({result['casts_by_file'].get(name, 0)} casts)")
    for name, n in list(result["ops_by_line"].items())[: args.lines]:
        print(f"  {n:6d}  {name}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
