"""Specification: `decode_context_parallel_size` reaches the decode pool's engines as vLLM's flag
(`--decode-context-parallel-size N`), the YAML key and the Helm value `engine.decodeContextParallelSize`, never
a prefill engine's (which holds whole blocks); a size that does not divide decode_tp fails the start naming both."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from k3serve.cli import build_parser, serve_config


def _config(*argv: str):
    return serve_config(build_parser().parse_args(["serve", *argv]))


def test_the_flag_configures_the_decode_pool_and_not_the_prefill_pool() -> None:
    config = _config("--decode-tp", "4", "--prefill-tp", "2", "--transfer", "mooncake",
                     "--decode-context-parallel-size", "4")
    decode, prefill = config.engine_args("decode"), config.engine_args("prefill")
    assert (decode.decode_context_parallel_size, decode.tensor_parallel_size, decode.tokens_per_block) == (4, 4, 256)
    assert (prefill.decode_context_parallel_size, prefill.tokens_per_block) == (1, 64)


def test_the_yaml_key_sets_it(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("decode_tp: 2\ndecode_context_parallel_size: 2\n")
    assert _config("--config", str(path)).engine_args("decode").decode_context_parallel_size == 2


@pytest.mark.parametrize("argv", [("--decode-tp", "4", "--decode-context-parallel-size", "3"),
                                  ("--decode-context-parallel-size", "2"),
                                  ("--decode-tp", "2", "--decode-context-parallel-size", "0")])
def test_a_size_that_does_not_divide_decode_tp_fails_naming_both(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError, match=r"decode_context_parallel_size=-?\d+ must be >= 1 and divide decode_tp="):
        _config(*argv)
