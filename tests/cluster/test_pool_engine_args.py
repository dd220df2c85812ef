"""Each pool's engine arguments (cluster/config.py `ServeConfig.engine_args`), from `k3serve serve`'s flags and
its --config file (keys: the flags' names with underscores).

Spec:
- with no flag and no file, every engine gets EngineArgs' defaults (a prefill engine eager), as before;
- every EngineArgs field but tensor_parallel_size (prefill_tp / decode_tp) is a flag and a key; vLLM's names
  where vLLM has the knob (`--[no-]enable-prefix-caching`, `--gpu-memory-utilization`, `--enforce-eager`,
  `--max-num-batched-tokens`, `--num-gpu-blocks-override`);
- each per-pool knob's `--prefill-NAME` / `--decode-NAME` (`prefill_NAME` / `decode_NAME`) sets it for that pool
  alone, the shared value for the other; a flag wins over the file;
- CUDA graphs are the decode pool's: a prefill engine never runs a decode step, so it stays eager;
- unknown or contradictory settings fail at start, naming the field (and the pool).
"""

from __future__ import annotations

import json

from dataclasses import fields
from pathlib import Path

import pytest
from pydantic import ValidationError

from k3serve.cli import build_parser, serve_config
from k3serve.cluster.config import (DECODE_ENGINE_ARGS, DEPLOYMENT_ENGINE_ARGS, POOL_ENGINE_ARGS, QUEUE_ROUNDS,
                                    ServeConfig)
from k3serve.engine.config import EngineArgs


def _config(*argv: str) -> ServeConfig:
    return serve_config(build_parser().parse_args(["serve", *argv]))


def test_no_flags_and_no_file_serve_engine_args_defaults() -> None:
    config = _config()
    assert config.engine_args("decode") == EngineArgs()
    assert config.engine_args("prefill") == EngineArgs(enforce_eager=True)
    assert _config("--mode", "colocated").engine_args("colocated") == EngineArgs()


def test_every_engine_argument_is_a_serve_option_once() -> None:
    reaches = DEPLOYMENT_ENGINE_ARGS + POOL_ENGINE_ARGS + DECODE_ENGINE_ARGS
    assert sorted(reaches + ("tensor_parallel_size",)) == sorted(f.name for f in fields(EngineArgs))
    per_pool = {f"{pool}_{name}" for pool in ("prefill", "decode") for name in POOL_ENGINE_ARGS}
    assert set(reaches) | per_pool <= set(ServeConfig.model_fields)


def test_vllms_flag_names_reach_the_engines() -> None:
    config = _config("--no-enable-prefix-caching", "--gpu-memory-utilization", "0.8", "--enforce-eager",
                     "--max-num-batched-tokens", "512", "--num-gpu-blocks-override", "100")
    args = config.engine_args("decode")
    assert (args.enable_prefix_caching, args.gpu_memory_utilization, args.enforce_eager) == (False, 0.8, True)
    assert (args.max_num_batched_tokens, args.num_gpu_blocks_override) == (512, 100)
    assert _config("--enable-prefix-caching").engine_args("prefill").enable_prefix_caching is True


_STORE = '{"master_server_addr": "store:50051", "metadata_server": "http://store:8080/metadata"}'
# Each per-pool knob: a value that is not its default, as a flag's text and as the engine's value.
POOL_VALUES = {
    "max_num_seqs": ("8", 8),
    "max_num_batched_tokens": ("512", 512),
    "max_adaptive_batched_tokens": ("20000", 20000),
    "long_prefill_token_threshold": ("256", 256),
    "enable_prefix_caching": (None, False),  # --no-<pool>-enable-prefix-caching
    "kda_checkpoint_mode": ("align", "align"),
    "adaptive_token_budget": (None, False),  # --no-<pool>-adaptive-token-budget
    "kernels": ("reference", "reference"),
    "moe_finalize": ("unfused", "unfused"),
    "cache_memory_bytes": ("1048576", 1048576),
    "gpu_memory_utilization": ("0.5", 0.5),
    "num_kda_slots": ("200", 200),
    "num_gpu_blocks_override": ("100", 100),
    "kv_events_config": ('{"topic": "k3"}', '{"topic": "k3"}'),
    "kv_offload": ("host", "host"),
    "kv_offload_host_bytes": ("1048576", 1048576),
    "kv_offload_mooncake_config": (_STORE, _STORE),
}


def test_the_table_covers_every_per_pool_knob() -> None:
    assert set(POOL_VALUES) == set(POOL_ENGINE_ARGS)


def _flag(pool: str, name: str) -> list[str]:
    text, _ = POOL_VALUES[name]
    if text is None:
        return [f"--no-{pool}-{name.replace('_', '-')}"]
    return [f"--{pool}-{name.replace('_', '-')}", text]


@pytest.mark.parametrize("pool, other", [("decode", "prefill"), ("prefill", "decode")])
@pytest.mark.parametrize("name", POOL_ENGINE_ARGS)
def test_a_pools_flag_sets_its_engines_alone(name: str, pool: str, other: str) -> None:
    config = _config(*_flag(pool, name))
    assert getattr(config.engine_args(pool), name) == POOL_VALUES[name][1]
    assert getattr(config.engine_args(other), name) == getattr(EngineArgs(), name)


@pytest.mark.parametrize("name", POOL_ENGINE_ARGS)
def test_a_pools_key_in_the_file_sets_its_engines_alone_and_a_flag_wins(name: str, tmp_path: Path) -> None:
    value = POOL_VALUES[name][1]
    path = tmp_path / "serve.yaml"
    text = str(value).lower() if isinstance(value, bool) else json.dumps(value) if isinstance(value, str) else value
    path.write_text(f"decode_{name}: {text}\n")  # a string quoted: YAML would read a JSON object as a mapping
    config = _config("--config", str(path))
    assert getattr(config.engine_args("decode"), name) == value
    assert getattr(config.engine_args("prefill"), name) == getattr(EngineArgs(), name)
    shared = _config("--config", str(path), "--max-num-seqs", "16")  # the shared value, under the pool's own
    assert shared.engine_args("prefill").max_num_seqs == 16
    assert shared.engine_args("decode").max_num_seqs == (8 if name == "max_num_seqs" else 16)


def test_a_pools_flag_wins_over_its_key_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("max_num_seqs: 32\ndecode_max_num_seqs: 8\ndecode_enable_prefix_caching: false\n")
    config = _config("--config", str(path), "--decode-max-num-seqs", "4", "--decode-enable-prefix-caching")
    assert (config.engine_args("decode").max_num_seqs, config.engine_args("decode").enable_prefix_caching) == (4, True)
    assert config.engine_args("prefill").max_num_seqs == 32


def test_cuda_graphs_are_the_decode_pools_and_a_prefill_engine_stays_eager() -> None:
    config = _config("--cuda-graph-batch-sizes", "1,2,4", "--max-num-seqs", "8", "--prefill-max-num-seqs", "2")
    assert config.engine_args("decode").cuda_graph_batch_sizes == (1, 2, 4)
    prefill = config.engine_args("prefill")
    assert (prefill.enforce_eager, prefill.cuda_graph_batch_sizes, prefill.max_num_seqs) == (True, None, 2)


def test_the_admission_queue_holds_rounds_of_the_decode_pool() -> None:
    config = _config("--decode-replicas", "2", "--max-num-seqs", "32", "--decode-max-num-seqs", "8")
    assert config.queue_capacity == QUEUE_ROUNDS * 2 * 8


@pytest.mark.parametrize("argv, named", [
    (("--decode-max-num-seqs", "8", "--decode-num-kda-slots", "4"),
     r"the decode pool's engine arguments \(decode_max_num_seqs=8, decode_num_kda_slots=4\): num_kda_slots=4 < "
     r"max_num_seqs=8"),
    (("--max-num-batched-tokens", "512", "--prefill-max-adaptive-batched-tokens", "100"),
     r"the prefill pool's engine arguments \(prefill_max_adaptive_batched_tokens=100\): "
     r"max_adaptive_batched_tokens=100 < max_num_batched_tokens=512"),
    (("--cuda-graph-batch-sizes", "1,2,16", "--decode-max-num-seqs", "8"),
     r"the decode pool's .*cuda_graph_batch_sizes must be strictly increasing integers in \[1, max_num_seqs=8\]"),
    (("--cuda-graph-batch-sizes", "1,2", "--enforce-eager"), r"cuda_graph_batch_sizes=\(1, 2\) with enforce_eager"),
    (("--mode", "colocated", "--decode-max-num-seqs", "8"), r"decode_max_num_seqs=8: colocated mode runs one engine"),
    (("--prefill-gpu-memory-utilization", "1.5",), r"gpu_memory_utilization must lie in \(0, 1\], got 1.5"),
])
def test_contradictory_settings_fail_at_start_naming_the_field(argv: tuple[str, ...], named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        _config(*argv)


@pytest.mark.parametrize("line, key", [
    ("decode_max_num_seq: 8", "decode_max_num_seq"),  # misspelt
    ("decode_block_size: 32", "decode_block_size"),  # one block size for both pools: the handoff copies blocks
    ("prefill_kda_checkpoint_mode: sometimes", "prefill_kda_checkpoint_mode"),
    ("decode_max_num_seqs: many", "decode_max_num_seqs"),
])
def test_an_unknown_or_bad_key_in_the_file_fails_naming_it(line: str, key: str, tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(line + "\n")
    with pytest.raises(ValidationError, match=key):
        _config("--config", str(path))


def test_an_unknown_or_bad_flag_is_refused_by_the_parser() -> None:
    for argv in (["--decode-block-size", "32"], ["--decode-max-num-seqs", "many"], ["--cuda-graph-batch-sizes", "1,x"]):
        with pytest.raises(SystemExit):
            _config(*argv)
