"""The deployment's control-plane secret (cluster/config.py `internal_secret`, cluster/serve.py): from the flag or
the file, else $K3SERVE_INTERNAL_SECRET (a Kubernetes Secret), else a fresh one at every start; the same for both
pools; never in a repr or an error; one no metadata can carry, or one short enough to guess, fails at start."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from k3serve.cli import build_parser, serve_config
from k3serve.cluster.config import INTERNAL_SECRET_ENV
from k3serve.cluster.serve import _worker_kwargs
from k3serve.transfer.auth import ControlAuth

SECRET = "k3-internal-secret-0123456789abcdef"


def _config(*argv: str):
    return serve_config(build_parser().parse_args(["serve", *argv]))


def test_the_secret_comes_from_the_flag_or_the_file_else_the_environment(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INTERNAL_SECRET_ENV, raising=False)
    assert _config().internal_secret is None
    assert _config("--internal-secret", SECRET).internal_secret.get_secret_value() == SECRET
    monkeypatch.setenv(INTERNAL_SECRET_ENV, SECRET + "-env")
    assert _config().internal_secret.get_secret_value() == SECRET + "-env"
    path = tmp_path / "serve.yaml"
    path.write_text(f"internal_secret: {SECRET}\n")
    assert _config("--config", str(path)).internal_secret.get_secret_value() == SECRET


def test_both_pools_get_the_configured_secret_or_one_fresh_per_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INTERNAL_SECRET_ENV, raising=False)
    prefill, decode = _worker_kwargs(_config("--internal-secret", SECRET))
    assert prefill["control_auth"] == decode["control_auth"] == ControlAuth(SECRET)
    first, second = (_worker_kwargs(_config()) for _ in range(2))
    assert first[0]["control_auth"] == first[1]["control_auth"] != second[0]["control_auth"]
    assert len(first[0]["control_auth"].secret) >= 32
    tls = _worker_kwargs(_config("--internal-secret", SECRET, "--internal-tls-dir", "/etc/k3serve/tls"))[1]
    assert tls["control_auth"] == ControlAuth(SECRET, "/etc/k3serve/tls")


def test_the_secret_shows_in_no_repr_and_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INTERNAL_SECRET_ENV, raising=False)
    assert SECRET not in repr(_config("--internal-secret", SECRET))
    with pytest.raises(ValidationError, match="colocated") as failed:
        _config("--internal-secret", SECRET, "--mode", "colocated", "--prefill-tp", "2")
    assert SECRET not in str(failed.value)


@pytest.mark.parametrize("secret, problem", [
    ("short", "at least 16 characters"),
    (SECRET + "\n", "white space"),  # a Secret written with `echo`
    ("s\u00e9cret-0123456789abcdef", "printable ASCII"),
])
def test_a_secret_no_metadata_can_carry_fails_at_start(secret: str, problem: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERNAL_SECRET_ENV, secret)
    with pytest.raises(ValidationError, match=problem) as failed:
        _config()
    assert "internal_secret" in str(failed.value) and secret.strip() not in str(failed.value)
