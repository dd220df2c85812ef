"""The trainable K3 (tools/train/model.py) is the engine's model: its delta rule equals the recurrent reference,
its logits equal the engine's on the checkpoint it writes, that checkpoint reads back into it exactly, and every
parameter it trains gets a gradient."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from k3serve.kernels.kda.naive import recurrent_kda
from k3serve.model.config import ModelConfig
from k3serve.model.loader import load_model
from k3serve.model.score import score_tokens
from k3serve.model.tokenizer import Tokenizer, train_tiny_tokenizer
from tools.train.export import load_trainable, round_to_checkpoint, write_checkpoint
from tools.train.model import TrainableK3, chunk_delta_rule
from tools.train.recipe import RECIPES

MICRO = RECIPES["micro"]


@pytest.mark.parametrize("chunk", [16, 32])
def test_the_chunked_delta_rule_equals_the_recurrent_reference_over_awkward_lengths(chunk: int) -> None:
    B, H, T, K, V = 2, 3, 37, 12, 10
    q, k = (F.normalize(torch.randn(B, H, T, K), dim=-1) for _ in range(2))
    v, beta = torch.randn(B, H, T, V), torch.rand(B, H, T)
    g = -5.0 * torch.sigmoid(torch.randn(B, H, T, K))  # K3's bounded gate
    got = chunk_delta_rule(q, k, v, g, beta, chunk)
    as_btk = lambda t: t.transpose(1, 2)  # noqa: E731  [B, T, H, ...]
    ref, _, _ = recurrent_kda(as_btk(q), as_btk(k), as_btk(v), as_btk(g), beta.transpose(1, 2), scale=1.0)
    torch.testing.assert_close(got, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainableK3, Path]:
    """A micro K3 with every weight perturbed (the attention-residual scores and the router's bias included,
    which start at zero) and its written checkpoint."""
    root = tmp_path_factory.mktemp("micro")
    train_tiny_tokenizer(root / "tokenizer", vocab_size=MICRO.vocab_size)
    tokenizer = Tokenizer.from_dir(root / "tokenizer")
    hf = MICRO.hf_config(tokenizer.bos_token_id, tokenizer.eos_token_id)
    model = TrainableK3(ModelConfig.from_hf_dict(hf), chunk=16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p) * (p.std() if p.numel() > 1 and p.std() > 0 else 1.0))
    return model, write_checkpoint(model, hf, root / "tokenizer", root / "checkpoint")


def test_the_training_forward_equals_the_engine_forward_on_the_written_checkpoint(micro_model) -> None:
    model, checkpoint = micro_model
    token_ids = torch.randint(0, MICRO.vocab_size, (50,))  # chunks of 16: three boundaries
    with torch.no_grad():
        trained = round_to_checkpoint(model)(token_ids[None])[0]
    served = score_tokens(load_model(checkpoint), token_ids.tolist())
    torch.testing.assert_close(trained, served, rtol=1e-4, atol=1e-4)


def test_a_written_checkpoint_reads_back_as_the_values_it_stores(micro_model) -> None:
    model, checkpoint = micro_model
    loaded, stored = load_trainable(checkpoint).state_dict(), round_to_checkpoint(model).state_dict()
    assert loaded.keys() == stored.keys()
    assert all(torch.equal(loaded[n], stored[n]) for n in stored), "a value changed on the way back"


def test_the_checkpoint_holds_mxfp4_experts_and_k3s_padded_a_log(micro_model) -> None:
    from safetensors import safe_open

    _, checkpoint = micro_model
    names: dict[str, tuple] = {}
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names |= {n: (f.get_slice(n).get_dtype(), f.get_slice(n).get_shape()) for n in f.keys()}
    assert names["language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed"][0] == "U8"
    assert not [n for n in names if n.endswith("experts.0.w1.weight")]
    assert names["language_model.model.layers.0.self_attn.A_log"] == ("F32", [128])
    assert names["language_model.model.layers.0.self_attn.q_proj.weight"][0] == "BF16"


def test_every_trained_parameter_but_the_first_mixs_score_gets_a_gradient(micro_model) -> None:
    model, _ = micro_model
    model.zero_grad()
    model.set_fake_quant(True)  # QAT: the straight-through estimator still reaches the experts
    try:
        token_ids = torch.randint(0, MICRO.vocab_size, (2, 24))
        F.cross_entropy(model(token_ids[:, :-1]).flatten(0, 1), token_ids[:, 1:].flatten()).backward()
    finally:
        model.set_fake_quant(False)
    dead = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.abs().sum())]
    # layer 0's first mix has one source (the embedding): a softmax over one, its score weights unused (as in K3)
    assert dead == ["model.layers.0.self_attention_res_proj.weight", "model.layers.0.self_attention_res_norm.weight"]
