"""Specification: `speculative_config` reaches the engines as vLLM's operators give it: the `--speculative-config
'<json>'` flag, the YAML key (a mapping), and only the decode pool's and a colocated engine's EngineArgs (a prefill
engine samples one token and never speculates). A bad config fails the start with a message naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from k3serve.cli import build_parser, serve_config
from k3serve.engine.spec.config import SpeculativeConfig

NGRAM_4 = SpeculativeConfig(method="ngram", num_speculative_tokens=4)


def _config(*argv: str):
    return serve_config(build_parser().parse_args(["serve", *argv]))


def test_the_json_flag_configures_the_decode_pool_and_not_the_prefill_pool() -> None:
    config = _config("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}')
    assert config.engine_args("decode").speculative_config == NGRAM_4
    assert config.engine_args("colocated").speculative_config == NGRAM_4
    assert config.engine_args("prefill").speculative_config is None


def test_the_yaml_key_takes_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("speculative_config:\n  method: ngram\n  num_speculative_tokens: 4\n  prompt_lookup_max: 3\n")
    spec = _config("--config", str(path)).engine_args("decode").speculative_config
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max) == (4, 3)


def test_a_bad_config_fails_naming_the_field() -> None:
    with pytest.raises(ValidationError, match=r"speculative_config\.num_speculative_tokens"):
        _config("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}')
    with pytest.raises(ValidationError, match="not valid JSON"):
        _config("--speculative-config", "ngram")
