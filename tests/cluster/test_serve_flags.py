"""`k3serve serve`'s flags and its --config file (k3serve/cli.py `serve_config`, cluster/config.py
`ServeConfig.load`): the file's values, then the flags given on top; a flag not given leaves the
file's value, and neither leaves ServeConfig's default. Shown on the admission queue's bounds
(`--max-queued-requests`, `--queue-timeout-seconds`), which are checked like the file's keys
(0 is a value: never wait; colocated mode refuses them); and on
the chat route's reasoning parser (`--reasoning-parser`); and on the API key (`--api-key`), which, given by
neither, comes from $K3SERVE_API_KEY (as vLLM's $VLLM_API_KEY) and shows in no repr and no error. Every ServeConfig field is
a flag by the same name, whose --help shows the field's default (none where the field's is None), its
choices the field's; a boolean is a --NAME / --no-NAME pair."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest
from pydantic import ValidationError

from k3serve.cli import build_parser, serve_config
from k3serve.cluster.config import API_KEY_ENV, QUEUE_ROUNDS, ServeConfig


def _config(*argv: str):
    return serve_config(build_parser().parse_args(["serve", *argv]))


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text("decode_replicas: 2\nmax_num_seqs: 4\nmax_queued_requests: 16\nqueue_timeout_seconds: 30\n")
    return path


def test_the_file_sets_the_queue_bounds(config_file: Path) -> None:
    config = _config("--config", str(config_file))
    assert (config.max_queued_requests, config.queue_timeout_seconds, config.queue_capacity) == (16, 30.0, 16)


def test_flags_given_win_over_the_file(config_file: Path) -> None:
    config = _config("--config", str(config_file), "--max-queued-requests", "0", "--queue-timeout-seconds", "2.5")
    assert (config.queue_capacity, config.queue_timeout_seconds) == (0, 2.5)  # 0: 503 at once, as before the queue
    config = _config("--config", str(config_file), "--queue-timeout-seconds", "90")
    assert (config.max_queued_requests, config.queue_timeout_seconds) == (16, 90.0)  # the file's, for the flag not given


def test_neither_given_leaves_the_defaults() -> None:
    config = _config("--decode-replicas", "3", "--max-num-seqs", "2")
    assert "max_queued_requests" not in config.model_fields_set
    assert config.queue_capacity == QUEUE_ROUNDS * 3 * 2
    assert config.queue_timeout_seconds == ServeConfig.model_fields["queue_timeout_seconds"].default


@pytest.mark.parametrize("argv, field", [
    (("--max-queued-requests", "-1"), "max_queued_requests"),
    (("--queue-timeout-seconds", "0"), "queue_timeout_seconds"),
    (("--mode", "colocated", "--max-queued-requests", "4"), "max_queued_requests"),
])
def test_bad_bounds_fail_naming_the_field(argv: tuple[str, ...], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        _config(*argv)


def _serve_flags() -> dict[str, argparse.Action]:
    """`k3serve serve`'s flags by destination, --help and --config aside."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in commands.choices["serve"]._actions if a.dest not in ("help", "config")}


def test_every_serve_config_field_is_a_flag() -> None:
    assert set(_serve_flags()) == set(ServeConfig.model_fields)


@pytest.mark.parametrize("name", _serve_flags())
def test_a_flags_help_shows_serve_configs_default_and_choices(name: str) -> None:
    flag, field = _serve_flags()[name], ServeConfig.model_fields[name]
    shown = re.findall(r"\(default: ([^)]*)\)", flag.help)
    if field.default is None:  # told in words (max_queued_requests: a rule), never as a value
        assert shown == [], flag.help
    elif isinstance(field.default, bool):  # a --NAME / --no-NAME pair
        assert isinstance(flag, argparse.BooleanOptionalAction) and shown == [str(field.default)], flag.help
    else:
        assert len(shown) == 1 and flag.type(shown[0]) == field.default, (flag.help, field.default)
    literal = [t for t in (field.annotation, *get_args(field.annotation)) if get_origin(t) is Literal]
    if literal:  # `Literal[...]` or `Literal[...] | None`
        assert flag.choices == get_args(literal[0])


def test_help_states_the_queue_default_rule(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"default {QUEUE_ROUNDS} x decode_replicas x the decode pool's max_num_seqs" in text
    timeout = ServeConfig.model_fields["queue_timeout_seconds"].default
    assert "--queue-timeout-seconds QUEUE_TIMEOUT_SECONDS disaggregated: longest a request waits" in text
    assert f"SDK's 600 s) (default: {timeout:g})" in text


def test_the_reasoning_parser_is_auto_unless_a_flag_or_the_file_says_none(tmp_path: Path) -> None:
    assert _config().reasoning_parser == "auto"  # the checkpoint's format; output without its markers is untouched
    assert _config("--reasoning-parser", "none").reasoning_parser == "none"
    path = tmp_path / "serve.yaml"
    path.write_text("reasoning_parser: none\n")
    assert _config("--config", str(path)).reasoning_parser == "none"
    assert _config("--config", str(path), "--reasoning-parser", "kimi").reasoning_parser == "kimi"


def test_vllms_k3_parser_flags_map_onto_serve_flags() -> None:
    config = _config("--reasoning-parser", "kimi_k3", "--tool-call-parser", "kimi_k3", "--enable-auto-tool-choice")
    assert (config.reasoning_parser, config.tool_call_parser, config.enable_auto_tool_choice) == (
        "kimi_k3", "kimi_k3", True)
    assert (_config().tool_call_parser, _config().enable_auto_tool_choice) == ("auto", True)
    assert _config("--no-enable-auto-tool-choice").enable_auto_tool_choice is False
    with pytest.raises(SystemExit):
        _config("--tool-call-parser", "hermes")


def test_an_unknown_reasoning_parser_fails(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        _config("--reasoning-parser", "deepseek_r1")
    path = tmp_path / "serve.yaml"
    path.write_text("reasoning_parser: deepseek_r1\n")
    with pytest.raises(ValidationError, match="reasoning_parser"):
        _config("--config", str(path))


KEY = "k3-flag-test-key-42"


def test_the_api_key_comes_from_the_flag_or_the_file_else_the_environment(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert _config().api_key is None  # no key: every route open
    assert _config("--api-key", KEY).api_key.get_secret_value() == KEY
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert _config().api_key.get_secret_value() == "from-env"
    assert _config("--api-key", KEY).api_key.get_secret_value() == KEY
    path = tmp_path / "serve.yaml"
    path.write_text(f"api_key: {KEY}\n")
    assert _config("--config", str(path)).api_key.get_secret_value() == KEY


def test_the_api_key_shows_in_no_repr_and_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert KEY not in repr(_config("--api-key", KEY)) and KEY not in str(_config("--api-key", KEY).model_dump())
    with pytest.raises(ValidationError, match="colocated") as failed:  # any field's error would echo the input
        _config("--api-key", KEY, "--mode", "colocated", "--prefill-tp", "2")
    assert KEY not in str(failed.value)


@pytest.mark.parametrize("key, problem", [
    ("", "is empty"),
    (KEY + "\n", "white space"),  # a Secret written with `echo`
    ("kéy", "printable ASCII"),
])
def test_a_key_no_client_can_send_fails_at_start(key: str, problem: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, key)
    with pytest.raises(ValidationError, match=problem) as failed:
        _config()
    assert "api_key" in str(failed.value) and (not key or key not in str(failed.value))


def test_the_drain_timeout_is_30_s_unless_a_flag_or_the_file_says_otherwise(tmp_path: Path) -> None:
    assert _config().drain_timeout_seconds == 30.0
    path = tmp_path / "serve.yaml"
    path.write_text("drain_timeout_seconds: 120\n")
    assert _config("--config", str(path)).drain_timeout_seconds == 120.0
    assert _config("--config", str(path), "--drain-timeout-seconds", "0").drain_timeout_seconds == 0.0  # abort at once
    with pytest.raises(ValidationError, match="drain_timeout_seconds"):
        _config("--drain-timeout-seconds", "-1")
