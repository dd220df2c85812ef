"""The checked-in generated modules are exactly what `bash scripts/gen_proto.sh` writes from
transfer/proto/transfer.proto: nobody edited them by hand, nobody forgot to regenerate."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed (the `test` extra installs it)")

REPO = Path(__file__).resolve().parents[2]
GENERATED = ("transfer_pb2.py", "transfer_pb2.pyi", "transfer_pb2_grpc.py")


def test_generated_modules_match_the_proto(tmp_path: Path) -> None:
    result = subprocess.run(["bash", str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)], cwd=REPO,
                            env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"gen_proto.sh failed:\n{result.stderr}"
    for name in GENERATED:
        fresh, checked_in = (tmp_path / name).read_bytes(), (REPO / "transfer" / "proto" / name).read_bytes()
        assert fresh == checked_in, f"transfer/proto/{name} is stale: run `bash scripts/gen_proto.sh` and check it in"


def test_generated_grpc_module_imports_from_the_k3serve_namespace() -> None:
    text = (REPO / "transfer" / "proto" / "transfer_pb2_grpc.py").read_text()
    assert "from k3serve.transfer.proto import transfer_pb2" in text
    from k3serve.transfer.proto import transfer_pb2, transfer_pb2_grpc

    assert transfer_pb2.DESCRIPTOR.package == "k3serve.transfer.v1"
    assert transfer_pb2_grpc.DecodeControlStub is not None
