"""`k3serve make-checkpoint --drafter METHOD --target DIR`: a random drafter for a target, under the published
EAGLE / DFlash tensor names, that loads onto the target (its config fits it) and is the same bytes for the same
seed; without --target it refuses with a message."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from k3serve.cli import main
from k3serve.model.draft.config import DrafterConfig
from k3serve.model.draft.loader import load_drafter
from k3serve.model.loader import load_model
from k3serve.model.weights import checkpoint_files

NAMES = {"eagle": {"model.fc.weight", "model.norm.weight"},
         "dspark": {"model.fc.weight", "model.hidden_norm.weight", "model.norm.weight",
                    "model.markov_head.markov_w1.weight", "model.markov_head.markov_w2.weight"}}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


@pytest.mark.parametrize("method", ["eagle", "dspark"])
def test_a_written_drafter_loads_onto_its_target(tiny_checkpoint: Path, tmp_path: Path, method: str) -> None:
    out, again = tmp_path / "a", tmp_path / "b"
    for where in (out, again):
        assert main(["make-checkpoint", "--drafter", method, "--target", str(tiny_checkpoint), "--out",
                     str(where)]) == 0
    tensors = _tensors(out)
    assert NAMES[method] <= set(tensors)
    assert all(name.startswith(("model.fc.", "model.hidden_norm.", "model.norm.", "model.layers.0.",
                                "model.markov_head."))
               for name in tensors), "the embedding and lm_head are the target's, not the drafter's"
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in tensors  # the layer's own K3 names
    assert all(torch.equal(t, _tensors(again)[n]) for n, t in tensors.items()), "not deterministic"
    config = DrafterConfig.from_dir(out)
    target = load_model(tiny_checkpoint)
    drafter = load_drafter(out, config, target, tiny_checkpoint, "cpu")
    hidden = target.config.hidden_size
    assert drafter.model.fc.weight.shape[1] == (2 * hidden if method == "eagle" else 3 * hidden)
    assert drafter.embed(torch.tensor([3])).shape == (1, hidden)


def test_a_drafter_without_a_target_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-checkpoint", "--drafter", "eagle", "--out", str(tmp_path / "d")]) == 2
    assert "--drafter needs --target" in capsys.readouterr().err
