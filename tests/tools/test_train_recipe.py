"""The corpus split and the recipe's edge: the stdlib split is a fixed function of file names and disjoint from the
held-out third-party set; a bad recipe field or override is refused with its name."""

from __future__ import annotations

import math

import pytest

from tools.train.corpus import HELD_OUT_PACKAGES, is_val, load_corpus
from tools.train.recipe import RECIPES, Recipe, parse_overrides
from tools.train.train import main


def test_the_split_is_disjoint_repeatable_and_keeps_third_party_code_out_of_training() -> None:
    corpus = load_corpus(val_percent=2.0)
    train, val = {f.name for f in corpus.train}, {f.name for f in corpus.val}
    assert train and val and not train & val
    assert all(is_val(name, 2.0) for name in val) and not any(is_val(name, 2.0) for name in train)
    assert not [n for n in train if "site-packages" in n]
    assert corpus.held_out_packages and set(corpus.held_out_packages) <= set(HELD_OUT_PACKAGES)
    assert {f.name.split("/")[0] for f in corpus.held_out} == set(corpus.held_out_packages)
    held_out_texts = {f.text for f in corpus.held_out}
    assert not [f.name for f in corpus.train if f.text in held_out_texts and len(f.text) > 200]


def test_the_default_recipe_is_a_k3_model_of_the_issues_size() -> None:
    from k3serve.model.checkpoint import checkpoint_shapes
    from k3serve.model.config import ModelConfig

    config = ModelConfig.from_hf_dict(RECIPES["k3-code"].hf_config(1, 2))
    assert config.experts_mxfp4 and config.attn_res_block_size and config.q_lora_rank and config.mla_use_output_gate
    assert config.kda.gate_lower_bound == -5.0 and config.kda.use_full_rank_gate and config.hidden_act == "situ"
    assert config.mla_layers[-2:] == (config.num_hidden_layers - 2, config.num_hidden_layers - 1)
    stored = sum(math.prod(shape) * dtype.itemsize for shape, dtype in checkpoint_shapes(config).values())
    assert stored < 25e6  # the issue's budget for the stored model (and its drafter)


@pytest.mark.parametrize(("changes", "message"), [
    ({"steps": 0}, "steps"), ({"experts_per_token": 64}, "experts_per_token"), ({"qat_steps": 10**6}, "qat_steps"),
    ({"lr": -1.0}, "lr"), ({"num_layers": 3}, "num_layers"),
])
def test_a_bad_recipe_is_refused_with_the_field_named(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Recipe(**changes)


def test_overrides_are_typed_and_unknown_fields_refused(capsys: pytest.CaptureFixture) -> None:
    assert parse_overrides(["steps=7", "lr=0.5", "max_files=none"]) == {"steps": 7, "lr": 0.5, "max_files": None}
    with pytest.raises(ValueError, match="steps wants int"):
        parse_overrides(["steps=many"])
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", "/nonexistent-never-written", "--set", "stepz=3"])
    assert exit_info.value.code == 2 and "stepz" in capsys.readouterr().err
