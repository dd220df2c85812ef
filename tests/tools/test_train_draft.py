"""The EAGLE drafter's trainer (tools/train/draft.py) trains the engine's drafter: its unrolled training form
equals the engine's drafting on the checkpoint it writes, depth by depth (the training-time test's attention is
the engine's drafter cache); the checkpoint has the engine's names and sizes; a micro run trains from a shipped-format
target and the engine speculates with what it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.spec.drafter import DraftRow, DraftRunner
from k3serve.model.batch import ForwardBatch, ModelCache
from k3serve.model.config import ModelConfig
from k3serve.model.draft.config import DrafterConfig
from k3serve.model.draft.loader import load_drafter
from k3serve.model.loader import load_model
from k3serve.model.tokenizer import Tokenizer, train_tiny_tokenizer
from tools.train.draft import TrainableEagle, drafter_config, export
from tools.train.export import load_trainable, write_checkpoint
from tools.train.model import TrainableK3
from tools.train.recipe import DRAFT_RECIPES, RECIPES

MICRO, MICRO_DRAFT = RECIPES["micro"], DRAFT_RECIPES["micro"]
BLOCK = 16


def _perturb(module: torch.nn.Module, scale: float = 0.3) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn_like(p) * (p.std() if p.numel() > 1 and p.std() > 0 else 1.0))


@pytest.fixture(scope="module")
def target_and_drafter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A micro target and an EAGLE drafter for it, every weight perturbed, as written checkpoints."""
    root = tmp_path_factory.mktemp("draft")
    torch.manual_seed(0)
    train_tiny_tokenizer(root / "tokenizer", vocab_size=MICRO.vocab_size)
    tokenizer = Tokenizer.from_dir(root / "tokenizer")
    hf = MICRO.hf_config(tokenizer.bos_token_id, tokenizer.eos_token_id)
    target = TrainableK3(ModelConfig.from_hf_dict(hf), chunk=16)
    _perturb(target)
    write_checkpoint(target, hf, root / "tokenizer", root / "target")
    draft_hf = drafter_config(root / "target", MICRO_DRAFT)
    drafter = TrainableEagle(DrafterConfig.from_hf_dict(draft_hf).model)
    _perturb(drafter, 1.0)
    export(drafter, draft_hf, root / "drafter")
    return root / "target", root / "drafter"


def _engine_drafts(target_dir: Path, drafter_dir: Path, tokens: list[int], k: int) -> tuple[list[int], list]:
    """The engine's K greedy drafts after `tokens` (all but the last computed) and each draft's logits [V]."""
    target = load_model(target_dir)
    drafter = load_drafter(drafter_dir, DrafterConfig.from_dir(drafter_dir), target, target_dir, "cpu")
    n, blocks = len(tokens) - 1, list(range(-(-len(tokens) // BLOCK) + 1))
    cache = ModelCache.allocate(target.config, len(blocks), 1, BLOCK, 1, target.dtype, "cpu")
    hidden = target(ForwardBatch.build([tokens[:n]], [0], [blocks], [0], BLOCK), cache)
    logits, layer_logits = [], drafter.logits
    drafter.logits = lambda out: logits.append(layer_logits(out)) or logits[-1]
    runner = DraftRunner(drafter, len(blocks), 1, BLOCK, k, probabilistic=False, device="cpu")
    row = DraftRow("r", 0, n, tokens, blocks, 0, SamplingParams(temperature=0.0, max_tokens=8), 1)
    drafts = runner.run([row], hidden, None)["r"].token_ids
    return drafts, [step[0] for step in logits]


def _drafter_tensors(drafter_dir: Path) -> dict[str, torch.Tensor]:
    """The written drafter's tensors, fp32."""
    from safetensors.torch import load_file

    return {n: t.float() for path in sorted(drafter_dir.glob("*.safetensors")) for n, t in load_file(path).items()}


def test_the_unrolled_training_form_equals_the_engines_drafting_depth_by_depth(target_and_drafter) -> None:
    target_dir, drafter_dir = target_and_drafter
    k = MICRO_DRAFT.unroll
    tokens = torch.randint(0, MICRO.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    drafts, engine_logits = _engine_drafts(target_dir, drafter_dir, tokens, k)
    # the trainer's window: the context t_0 .. t_N, then the drafts the engine fed back (teacher forcing = them)
    window = torch.tensor([tokens + drafts[:-1]])
    target, trainer = load_trainable(target_dir), TrainableEagle(DrafterConfig.from_dir(drafter_dir).model)
    trainer.load_state_dict(_drafter_tensors(drafter_dir))
    with torch.no_grad():
        n = len(tokens) - 1
        hidden = target.model(window)[:, :n]
        outs = trainer.unroll(window, hidden, target.model.embed_tokens.weight, k)
        trained = [trainer.logits(out[0, n - 1], target.lm_head.weight) for out in outs]
    for depth, (got, want) in enumerate(zip(trained, engine_logits), start=1):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"depth {depth}: {m}")
    assert [int(t.argmax()) for t in trained] == drafts


def test_the_written_drafter_is_the_engines_eagle_checkpoint(target_and_drafter) -> None:
    target_dir, drafter_dir = target_and_drafter
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["draft_method"] == "eagle" and config["intermediate_size"] == MICRO_DRAFT.intermediate_size
    tensors = _drafter_tensors(drafter_dir)
    assert "model.embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors  # the target's
    DrafterConfig.from_dir(drafter_dir).check_fits(ModelConfig.from_dir(target_dir), "eagle", 8)


def test_a_micro_drafter_run_serves_speculative_decoding_exactly(micro_run, micro_draft_run) -> None:
    (run, _), (draft_run, results) = micro_run, micro_draft_run
    assert {"val", "held_out"} <= set(results) and len(results["val"]["agreement_by_depth"]) == MICRO_DRAFT.unroll
    steps = [json.loads(line)["step"] for line in (draft_run / "train_log.jsonl").open()]
    assert steps == list(range(MICRO_DRAFT.steps))
    from k3serve import LLM

    prompts = ["def parse(value):\n    ", "import os\n\nclass Path:\n"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=str(run / "checkpoint")).generate(prompts, params)
    spec = LLM(model=str(run / "checkpoint"), speculative_config={
        "method": "eagle", "model": str(draft_run / "checkpoint"), "num_speculative_tokens": 3})
    out = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert spec.engine.runner.drafter.num_forwards > 0 and spec.engine.spec_stats.num_drafts > 0, \
        "decoded without drafting"
