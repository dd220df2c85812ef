"""The shipped trained model, k3-code (`model/packaged.py`, `model/assets/k3-code`): the embedded default, read by
the published checkpoint's loader, and trained (it predicts Python; a random model's perplexity is its vocabulary,
4,096). Its EAGLE drafter, k3-code-eagle, is named by `speculative_config.model`, and its drafts are accepted
(a random drafter's almost never are), with the target's greedy tokens unchanged; the two fit in 25 MB."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors import safe_open

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.config import ModelConfig
from k3serve.model.draft.config import DrafterConfig
from k3serve.model.packaged import ASSETS, DEFAULT_MODEL, PACKAGED_DRAFTERS, PACKAGED_MODELS, resolve_model_dir

# Not in the training corpus: written for this test
CODE = textwrap.dedent('''
    def read_lines(path, encoding="utf-8"):
        """Return the lines of the file at path, without their line endings."""
        with open(path, encoding=encoding) as f:
            return [line.rstrip("\\n") for line in f]


    class Counter:
        def __init__(self):
            self.counts = {}

        def add(self, key):
            self.counts[key] = self.counts.get(key, 0) + 1
            return self.counts[key]
''')


@pytest.fixture(scope="module")
def default_llm() -> Iterator[LLM]:
    llm = LLM(max_model_len=1024)
    yield llm
    llm.engine.close()


def test_the_embedded_default_is_the_shipped_model_and_writes_nothing(tmp_path: Path) -> None:
    assert EngineArgs().model == DEFAULT_MODEL == "k3-code"
    assert resolve_model_dir("k3-code", seed=0, cache_dir=str(tmp_path)) == ASSETS / "k3-code"
    assert list(tmp_path.iterdir()) == []


def test_a_shipped_model_whose_files_are_missing_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PACKAGED_MODELS, "k3-code", tmp_path / "absent")
    with pytest.raises(ValueError, match="shipped model 'k3-code' has no config.json .* missing from this checkout"):
        resolve_model_dir("k3-code", seed=0, cache_dir=str(tmp_path))


def test_it_is_stored_in_the_published_format_with_packed_mxfp4_experts() -> None:
    folder = ASSETS / "k3-code"
    config = ModelConfig.from_dir(folder)
    assert config.kda_layers and config.mla_layers and config.num_experts == 40
    shards = sorted(folder.glob("*.safetensors"))
    names = [name for shard in shards for name in safe_open(shard, "pt").keys()]
    assert any(name.endswith("experts.0.w1.weight_packed") for name in names)
    assert sum(f.stat().st_size for shipped in ("k3-code", "k3-code-eagle")
               for f in (ASSETS / shipped).iterdir()) < 25e6  # the model and its drafter together


def test_it_predicts_python_it_never_saw(default_llm: LLM) -> None:
    ids = default_llm.engine.tokenizer.encode(CODE)
    out = default_llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    nll = [-next(iter(scores.values())).logprob for scores in out.prompt_logprobs[1:]]
    assert math.exp(sum(nll) / len(nll)) < 20  # 8.4 as shipped


def test_a_greedy_completion_is_python_shaped(default_llm: LLM) -> None:
    out = default_llm.generate(["def add(a, b):\n"], SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert out.outputs[0].text.startswith("    ")  # the body is indented


def test_its_drafter_is_named_by_speculative_config_and_its_drafts_are_accepted(default_llm: LLM) -> None:
    assert PACKAGED_DRAFTERS["k3-code-eagle"] == ASSETS / "k3-code-eagle"
    DrafterConfig.from_dir(ASSETS / "k3-code-eagle").check_fits(ModelConfig.from_dir(ASSETS / "k3-code"), "eagle", 8)
    spec = LLM(max_model_len=1024, speculative_config={"method": "eagle", "model": "k3-code-eagle",
                                                       "num_speculative_tokens": 4})
    prompts, params = [CODE[:200], "import os\n\n\ndef main():\n"], SamplingParams(temperature=0.0, max_tokens=32)
    try:
        got = spec.generate(prompts, params)
        stats = spec.engine.spec_stats
    finally:
        spec.engine.close()
    want = default_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert stats.num_drafts > 0 and stats.mean_acceptance_length > 1.5, stats.mean_acceptance_length
