"""Train an EAGLE drafter for a trained K3 target, the target frozen; deterministic given the recipe's seed.

    python -m tools.train.draft --target DIR --out OUT [--recipe k3-code-eagle] [--device cuda] [--set F=V ...]

The drafter is the engine's (`model/draft/eagle.py`): position p reads fc([embed(t_{p+1}); h_p]), h_p the target's
final hidden state, through one MLA decoder layer with a dense MLP, and the target's lm_head over its normalised
output scores t_{p+2}; along a draft its own pre-norm output stands in for h. Training unrolls that (EAGLE-3's
training-time test): depth 1 is the context rows, attending causally to each other; depth d >= 2 at base p reads
the true t_{p+d} and depth d - 1's output there, and attends to the context rows 0..p and to depths 2..d of base p,
the rows the engine's drafter cache holds when it drafts d - 1 tokens past p (`tree_attention`). MLA has no
positions here (NoPE), so those rows need none. Depth d learns the target's next-token distribution at p + d.

Writes to OUT: `checkpoint/` (config.json and one safetensors file; the embedding and lm_head are the target's),
`train_log.jsonl`, `results.json` (per depth, top-1 agreement with the target on val and held-out windows,
teacher-forced, and the acceptance length that implies at K = unroll), `loss.png`, `command.txt`. The engine's
acceptance length on real drafts is `benchmarks/eval_model.py`'s. Design: docs/design/trained_model.md.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3serve.kernels.norm.naive import rms_norm
from k3serve.model.checkpoint import stored_dtype, write_shards
from k3serve.model.config import ModelConfig
from k3serve.model.draft.checkpoint import drafter_hf_config
from k3serve.model.draft.config import DrafterConfig
from k3serve.model.draft.eagle import EagleDrafter
from k3serve.model.tokenizer import Tokenizer
from k3serve.model.weights import checkpoint_targets
from tools.train.corpus import load_corpus
from tools.train.data import eval_windows, token_stream, train_batch
from tools.train.export import load_trainable
from tools.train.model import MLA, MLP, TrainableK3, Weight, norm_weight
from tools.train.plot import plot_losses
from tools.train.recipe import DraftRecipe
from tools.train.train import adamw, learning_rate, parse_cli, seed_everything


def tree_attention(q: Tensor, ctx_k: Tensor, ctx_v: Tensor, own_k: list[Tensor], own_v: list[Tensor],
                   scale: float) -> Tensor:
    """Depth d's attention: q [B, H, T, dk] at base p over the context rows 0..p (ctx_k, ctx_v [B, H, T, *]) and
    over base p's rows of depths 2..d (own_k, own_v: d - 1 tensors [B, H, T, *], the last q's own) -> [B, H, T, dv]."""
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    ctx = (q @ ctx_k.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
    own = torch.stack([(q * k).sum(-1) for k in own_k], dim=-1) * scale  # [B, H, T, d - 1]
    w = torch.softmax(torch.cat([ctx, own], dim=-1), dim=-1)
    return w[..., :T] @ ctx_v + (w[..., T:, None] * torch.stack(own_v, dim=-2)).sum(-2)


class DraftLayer(nn.Module):
    """`model.layers.0`: a plain pre-norm residual block of MLA and a dense SiTU MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D = config.hidden_size
        self.input_layernorm, self.post_attention_layernorm = norm_weight(D), norm_weight(D)
        self.self_attn = MLA(config)
        self.mlp = MLP(D, config.intermediate_size, config)


class DraftBody(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D = config.hidden_size
        self.fc = Weight(D, 2 * D)
        self.layers = nn.ModuleList([DraftLayer(config)])
        self.norm = norm_weight(D)


class TrainableEagle(nn.Module):
    """The EAGLE drafter's own weights (`model.*`, the engine's names), fp32; the target's embedding and lm_head
    are passed in, frozen."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DraftBody(config)

    def unroll(self, tokens: Tensor, hidden: Tensor, embed: Tensor, depth: int) -> list[Tensor]:
        """tokens [B, T + depth] (t_0 ..), hidden [B, T, D] (the target's h_0 .. h_{T-1}), embed [V, D] ->
        `depth` pre-norm outputs [B, T, D]; output d (1-based) at base p scores t_{p+d+1}."""
        T, eps = hidden.shape[1], self.config.rms_norm_eps
        layer = self.model.layers[0]
        attn = layer.self_attn
        outs: list[Tensor] = []
        own_k: list[Tensor] = []
        own_v: list[Tensor] = []
        prev = hidden
        for d in range(1, depth + 1):
            x = torch.cat([F.embedding(tokens[:, d : d + T], embed), prev], dim=-1) @ self.model.fc.weight.T
            n = rms_norm(x, layer.input_layernorm.weight, eps)
            q, k, v = attn.qkv(n)
            if d == 1:
                ctx_k, ctx_v = k, v
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
            else:
                own_k.append(k)
                own_v.append(v)
                o = tree_attention(q, ctx_k, ctx_v, own_k, own_v, attn.scale)
            h = x + attn.output(o, n)
            prev = h + layer.mlp(rms_norm(h, layer.post_attention_layernorm.weight, eps))
            outs.append(prev)
        return outs

    def logits(self, out: Tensor, lm_head: Tensor) -> Tensor:
        return rms_norm(out, self.model.norm.weight, self.config.rms_norm_eps) @ lm_head.T


def drafter_config(target_dir: Path, recipe: DraftRecipe) -> dict:
    """The drafter's config.json: the engine's EAGLE config for the target, with the recipe's MLP width."""
    return drafter_hf_config("eagle", target_dir, intermediate_size=recipe.intermediate_size)


class TargetAndDrafter:
    """The frozen target and the drafter being trained, on one device."""

    def __init__(self, target: TrainableK3, drafter: TrainableEagle, recipe: DraftRecipe) -> None:
        self.target, self.drafter, self.recipe = target, drafter, recipe
        self.embed = target.model.embed_tokens.weight.detach()
        self.lm_head = target.lm_head.weight.detach()
        self.weights = [recipe.depth_decay**d for d in range(recipe.unroll)]

    def step(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """tokens [B, T + unroll] -> (the depth-weighted loss, top-1 agreement with the target [B, T, unroll],
        each depth's loss [unroll])."""
        U, T = self.recipe.unroll, tokens.shape[1] - self.recipe.unroll
        with torch.no_grad():
            h = self.target.model(tokens)  # [B, T + U, D]
            teacher = h @ self.lm_head.T
        outs = self.drafter.unroll(tokens, h[:, :T], self.embed, U)
        losses, agree = [], []
        for d, out in enumerate(outs, start=1):
            logits, p = self.drafter.logits(out, self.lm_head), teacher[:, d : d + T]
            losses.append(F.kl_div(logits.log_softmax(-1), p.log_softmax(-1), reduction="none",
                                   log_target=True).sum(-1).mean())  # KL(target || drafter) a position
            agree.append(logits.argmax(-1) == p.argmax(-1))
        per_depth = torch.stack(losses)
        loss = (per_depth * per_depth.new_tensor(self.weights)).sum() / sum(self.weights)
        return loss, torch.stack(agree, dim=-1), per_depth.detach()

    @torch.no_grad()
    def evaluate(self, windows: Tensor, batch_size: int = 8) -> dict[str, object]:
        """Teacher-forced agreement per depth and the acceptance length it implies (1 + the leading depths that
        agree, averaged over positions), and the mean loss, over `windows` [n, T + unroll]."""
        device = next(self.drafter.parameters()).device
        agree, loss = [], 0.0
        for i in range(0, windows.shape[0], batch_size):
            w = windows[i : i + batch_size].to(device)
            batch_loss, a, _ = self.step(w)
            loss += batch_loss.item() * w.shape[0]
            agree.append(a.flatten(0, 1))
        a = torch.cat(agree).float()  # [positions, unroll]
        return {"loss": loss / windows.shape[0], "agreement_by_depth": [round(x, 4) for x in a.mean(0).tolist()],
                "acceptance_length": round(1 + a.cumprod(-1).sum(-1).mean().item(), 3)}


def export(drafter: TrainableEagle, hf_config: dict, out_dir: Path) -> Path:
    """config.json and one safetensors file with the engine's names and stored dtypes (bf16, norms included)."""
    tensors = {n: t.detach().cpu().to(stored_dtype(n, t.dtype)).contiguous() for n, t in drafter.state_dict().items()}
    with torch.device("meta"):
        expected = set(checkpoint_targets(EagleDrafter(DrafterConfig.from_hf_dict(hf_config), torch.float32)))
    if set(tensors) != expected:
        raise RuntimeError(f"the drafter's tensors do not match the engine's names: missing "
                           f"{sorted(expected - set(tensors))}, unexpected {sorted(set(tensors) - expected)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_shards(iter(sorted(tensors.items())), {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}, out_dir, 1)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    return out_dir


def train_drafter(recipe: DraftRecipe, target_dir: Path, out_dir: Path, device: str = "cpu",
                  time_limit_s: float | None = None, log=print) -> dict:
    """Train the drafter for the target checkpoint in `target_dir` end to end; returns results.json's content.
    `time_limit_s` stops the loop after the step that crosses it (`stopped_at_step`), as `train.train`'s."""
    t_start, dev = time.time(), torch.device(device)
    seed_everything(recipe.seed, dev)
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(recipe.val_percent, recipe.max_files)
    tokenizer = Tokenizer.from_dir(target_dir)
    streams = {name: token_stream(tokenizer, getattr(corpus, name)) for name in ("train", "val", "held_out")}
    length = recipe.seq_len + recipe.unroll  # a window: T context positions and the unrolled depths' tokens
    windows = {name: eval_windows(s, length - 1, recipe.eval_tokens) for name, s in streams.items()
               if name != "train" and s.numel() > length}
    log(f"corpus: {corpus.summary()}; tokens {({k: v.numel() for k, v in streams.items()})}")
    target = load_trainable(target_dir).to(dev).requires_grad_(False).eval()
    hf = drafter_config(target_dir, recipe)
    torch.manual_seed(recipe.seed)
    drafter = TrainableEagle(DrafterConfig.from_hf_dict(hf).model).to(dev)
    pair = TargetAndDrafter(target, drafter, recipe)
    opt = adamw(drafter, recipe)
    gen = torch.Generator().manual_seed(recipe.seed)
    losses, evals, stopped_at = [], [], None
    t_train = time.time()
    with (out_dir / "train_log.jsonl").open("w") as log_file:
        for step in range(recipe.steps):
            lr = learning_rate(recipe, step)
            for group in opt.param_groups:
                group["lr"] = lr
            inputs, targets = train_batch(streams["train"], recipe.batch_size, length - 1, gen)
            tokens = torch.cat([inputs, targets[:, -1:]], dim=1).to(dev)
            loss, agree, per_depth = pair.step(tokens)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), recipe.grad_clip)
            opt.step()
            entry = {"step": step, "loss": loss.item(), "loss_by_depth": [round(x, 4) for x in per_depth.tolist()],
                     "agreement_by_depth": [round(x, 4) for x in agree.float().mean((0, 1)).tolist()], "lr": lr,
                     "grad_norm": grad_norm.item(), "elapsed_s": round(time.time() - t_train, 2)}
            if (step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps:
                drafter.eval()
                entry["val"] = pair.evaluate(windows["val"])
                drafter.train()
                evals.append((step, entry["val"]["loss"]))
                log(f"step {step + 1}/{recipe.steps} loss {entry['loss']:.3f} val {entry['val']} "
                    f"({entry['elapsed_s']:.0f} s)")
            losses.append(entry["loss"])
            log_file.write(json.dumps(entry) + "\n")
            if step == 19:
                log(f"20 steps in {entry['elapsed_s']:.1f} s: about {entry['elapsed_s'] / 20 * recipe.steps:.0f} s "
                    f"for {recipe.steps}")
            if time_limit_s is not None and time.time() > t_start + time_limit_s and step + 1 < recipe.steps:
                stopped_at = step + 1
                log(f"time limit reached: stopping after step {step + 1}")
                break
    drafter.eval()
    results = {"recipe": asdict(recipe), "target": str(target_dir), "corpus": corpus.summary(),
               "num_parameters": sum(p.numel() for p in drafter.parameters()),
               "train_seconds": round(time.time() - t_train, 1), "stopped_at_step": stopped_at, "device": str(dev),
               "torch": torch.__version__, "platform": platform.platform(), "final_loss": losses[-1],
               **{name: pair.evaluate(w) for name, w in windows.items()}}
    export(drafter, hf, out_dir / "checkpoint")
    results["checkpoint_bytes"] = sum(f.stat().st_size for f in (out_dir / "checkpoint").iterdir())
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot_losses(losses, evals, out_dir / "loss.png", "KL(target || drafter), depth-weighted (nats/token)")
    log(f"done in {time.time() - t_start:.0f} s: " + json.dumps({k: results[k] for k in windows}))
    return results


def main(argv: list[str] | None = None) -> int:
    from tools.train.recipe import DRAFT_RECIPES

    def target_argument(parser) -> None:
        parser.add_argument("--target", required=True, type=Path, help="the trained target's checkpoint directory")

    args, recipe = parse_cli("python -m tools.train.draft", __doc__.split("\n\n")[0], DRAFT_RECIPES, DraftRecipe,
                             argv, target_argument)
    train_drafter(recipe, args.target, args.out, args.device, args.time_limit_s,
                  log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
