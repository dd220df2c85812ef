"""Train a K3-architecture model on the CPython standard library; deterministic given the recipe's seed.

    python -m tools.train --recipe k3-code --out OUT [--device cuda] [--set steps=2000 ...]

writes to OUT: `tokenizer/` (BPE trained on the training split), `checkpoint/` (the published format:
config.json, safetensors, tokenizer files; `model/weights.py` loads it), `train_log.jsonl` (a line a step),
`results.json` (the corpus, the recipe, and the final perplexities: val and held-out, routed experts dense and
as written, bf16 with MXFP4 experts; `before_qat`: val with dense and post-training-quantised experts where QAT
began), `loss.png` and `command.txt`. Design: docs/design/trained_model.md.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from k3serve.model.config import ModelConfig
from k3serve.model.tokenizer import Tokenizer, train_bpe_tokenizer
from tools.train.corpus import Corpus, load_corpus
from tools.train.data import eval_windows, token_stream, train_batch
from tools.train.export import round_to_checkpoint, write_checkpoint
from tools.train.model import TrainableK3
from tools.train.plot import plot_losses
from tools.train.recipe import DraftRecipe, Recipe


@torch.no_grad()
def perplexity(model: TrainableK3, windows: Tensor, batch_size: int = 8) -> float:
    """exp of the mean next-token NLL over `windows` [n, L + 1], each scored from a fresh state."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i : i + batch_size].to(device)
        logits = model(w[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    return math.exp(total / count)


def learning_rate(recipe: Recipe | DraftRecipe, step: int) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio at the last step."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - 1 - recipe.warmup_steps)
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def adamw(model: torch.nn.Module, recipe: Recipe | DraftRecipe) -> torch.optim.Optimizer:
    """AdamW; weight decay on the matrices only (not norms, gate biases, A_log, the embedding)."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trained if p.dim() >= 2 and "embed_tokens" not in n]
    rest = [p for n, p in trained if not (p.dim() >= 2 and "embed_tokens" not in n)]
    groups = [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8)


def seed_everything(seed: int, device: torch.device) -> None:
    torch.manual_seed(seed)
    if device.type == "cuda":  # cuBLAS's deterministic workspace; ops without a deterministic kernel warn
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def train_tokenizer(corpus: Corpus, recipe: Recipe, out_dir: Path) -> Tokenizer:
    """The BPE tokenizer (Kimi's split pattern, special tokens and chat template) of the training split."""
    train_bpe_tokenizer(out_dir, (f.text for f in corpus.train), recipe.vocab_size,
                        model_max_length=recipe.max_position_embeddings)
    return Tokenizer.from_dir(out_dir)


def final_perplexities(model: TrainableK3, windows: dict[str, Tensor]) -> dict[str, float]:
    """Each split's perplexity on the weights as written (bf16, MXFP4 experts), and with the experts dense."""
    rounded = round_to_checkpoint(model)
    model.set_fake_quant(False)
    out = {f"{split}_ppl_dense_experts": perplexity(model, w) for split, w in windows.items()}
    rounded.set_fake_quant(False)  # already MXFP4 values: rounding them again changes nothing
    out |= {f"{split}_ppl_checkpoint": perplexity(rounded, w) for split, w in windows.items()}
    return out


@dataclass
class _Data:
    corpus: Corpus
    tokenizer: Tokenizer
    streams: dict[str, Tensor]  # "train", "val", "held_out" -> [N] token ids
    windows: dict[str, Tensor]  # "val" and, where its packages are installed, "held_out" -> [n, seq_len + 1]


def _prepare_data(recipe: Recipe, out_dir: Path, log) -> _Data:
    """The corpus, the tokenizer trained on its training split, the token streams and the evaluation windows."""
    t_start = time.time()
    corpus = load_corpus(recipe.val_percent, recipe.max_files)
    log(f"corpus: {corpus.summary()}")
    tokenizer = train_tokenizer(corpus, recipe, out_dir / "tokenizer")
    streams = {name: token_stream(tokenizer, getattr(corpus, name)) for name in ("train", "val", "held_out")}
    log(f"tokens: {({k: v.numel() for k, v in streams.items()})} ({time.time() - t_start:.0f} s)")
    # the held-out packages may be missing where the run happens: then benchmarks/eval_model.py scores it later
    windows = {name: eval_windows(streams[name], recipe.seq_len, recipe.eval_tokens) for name in ("val", "held_out")
               if streams[name].numel() > recipe.seq_len}
    if "held_out" not in windows:
        log("no held-out packages installed here: the held-out perplexity is left to benchmarks/eval_model.py")
    return _Data(corpus, tokenizer, streams, windows)


@dataclass
class _Loop:
    losses: list[float] = field(default_factory=list)  # a step's training loss
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, val loss)
    before_qat: dict[str, float] = field(default_factory=dict)
    stopped_at_step: int | None = None
    seconds: float = 0.0


def _train_loop(model: TrainableK3, recipe: Recipe, data: _Data, out_dir: Path, deadline: float | None, log) -> _Loop:
    """The optimisation: a line of train_log.jsonl a step; QAT over the last qat_steps; stops past `deadline`."""
    dev = next(model.parameters()).device
    opt = adamw(model, recipe)
    gen = torch.Generator().manual_seed(recipe.seed)
    loop, t_train = _Loop(), time.time()
    with (out_dir / "train_log.jsonl").open("w") as log_file:
        for step in range(recipe.steps):
            if step == recipe.steps - recipe.qat_steps:
                loop.before_qat = _before_qat(model, data.windows["val"], step)
                log(f"before QAT at step {step}: {loop.before_qat}")
                model.set_fake_quant(True)
            lr = learning_rate(recipe, step)
            for group in opt.param_groups:
                group["lr"] = lr
            inputs, targets = (t.to(dev) for t in train_batch(data.streams["train"], recipe.batch_size,
                                                              recipe.seq_len, gen))
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
            opt.step()
            for moe in model.moe_layers():
                moe.balance(recipe.bias_update_rate)
            entry = {"step": step, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
                     "elapsed_s": round(time.time() - t_train, 2), "qat": step >= recipe.steps - recipe.qat_steps}
            if (step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps:
                entry["val_ppl"] = perplexity(model, data.windows["val"])
                loop.evals.append((step, math.log(entry["val_ppl"])))
                log(f"step {step + 1}/{recipe.steps} loss {entry['loss']:.3f} val ppl {entry['val_ppl']:.2f} "
                    f"({entry['elapsed_s']:.0f} s)")
            loop.losses.append(entry["loss"])
            log_file.write(json.dumps(entry) + "\n")
            if step == 19:
                log(f"20 steps in {entry['elapsed_s']:.1f} s: about {entry['elapsed_s'] / 20 * recipe.steps:.0f} s "
                    f"for {recipe.steps}")
            if deadline is not None and time.time() > deadline and step + 1 < recipe.steps:
                loop.stopped_at_step = step + 1
                log(f"time limit reached: stopping after step {step + 1}")
                break
    loop.seconds = round(time.time() - t_train, 1)
    return loop


def _before_qat(model: TrainableK3, val: Tensor, step: int) -> dict[str, float]:
    """Val perplexity with the experts dense and post-training quantised: PTQ's cost, to set QAT's against."""
    return {"val_ppl_dense_experts": perplexity(model, val), "val_ppl_ptq": perplexity(round_to_checkpoint(model), val),
            "step": step}


def train(recipe: Recipe, out_dir: Path, device: str = "cpu", time_limit_s: float | None = None, log=print) -> dict:
    """Run the recipe end to end; returns results.json's content. `time_limit_s` (from the start) stops the
    training loop after the step that crosses it (the schedule as planned, `stopped_at_step` in the results): a
    guard for a device call's limit, not part of the recipe."""
    t_start = time.time()
    dev = torch.device(device)
    seed_everything(recipe.seed, dev)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = _prepare_data(recipe, out_dir, log)
    hf = recipe.hf_config(data.tokenizer.bos_token_id, data.tokenizer.eos_token_id)
    torch.manual_seed(recipe.seed)
    model = TrainableK3(ModelConfig.from_hf_dict(hf), recipe.kda_chunk).to(dev)
    num_params = sum(p.numel() for p in model.parameters())
    log(f"model: {num_params:,} parameters")
    loop = _train_loop(model, recipe, data, out_dir, None if time_limit_s is None else t_start + time_limit_s, log)

    results = {
        "recipe": asdict(recipe), "corpus": data.corpus.summary(),
        "tokens": {k: v.numel() for k, v in data.streams.items()}, "num_parameters": num_params,
        "train_seconds": loop.seconds, "device": str(dev), "torch": torch.__version__,
        "platform": platform.platform(), "final_loss": loop.losses[-1], "stopped_at_step": loop.stopped_at_step,
        "before_qat": loop.before_qat, **final_perplexities(model, data.windows),
    }
    write_checkpoint(model, hf, out_dir / "tokenizer", out_dir / "checkpoint")
    results["checkpoint_bytes"] = sum(f.stat().st_size for f in (out_dir / "checkpoint").iterdir())
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot_losses(loop.losses, loop.evals, out_dir / "loss.png")
    log(f"done in {time.time() - t_start:.0f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in results.items()
                                                              if k.endswith(("_ppl_checkpoint", "_dense_experts"))))
    return results


def parse_cli(prog: str, description: str, recipes: dict, recipe_type: type, argv: list[str] | None,
              add_arguments=lambda parser: None):
    """The trainers' command line: --recipe (of `recipes`), --out, --device, --set FIELD=VALUE (fields of
    `recipe_type`), --time-limit-s, and what `add_arguments(parser)` adds. Returns (args, recipe), with --out
    created and the command written to its command.txt."""
    import argparse

    from tools.train.recipe import parse_overrides

    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    parser.add_argument("--recipe", default=next(iter(recipes)), choices=sorted(recipes))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="override recipe fields")
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="stop training after the step that crosses this many seconds, then export")
    args = parser.parse_args(argv)
    try:
        recipe = recipes[args.recipe].replace(**parse_overrides(args.set, recipe_type))
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    (args.out / "command.txt").write_text(f"{prog} {command}\n")
    return args, recipe


def main(argv: list[str] | None = None) -> int:
    from tools.train.recipe import RECIPES

    args, recipe = parse_cli("python -m tools.train", __doc__.split("\n\n")[0], RECIPES, Recipe, argv)
    train(recipe, args.out, args.device, args.time_limit_s, log=lambda line: print(line, flush=True))
    return 0
