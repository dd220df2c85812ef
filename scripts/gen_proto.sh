#!/usr/bin/env bash
# Regenerate transfer/proto/transfer_pb2.py, transfer_pb2.pyi and transfer_pb2_grpc.py from
# transfer/proto/transfer.proto. Usage: bash scripts/gen_proto.sh [OUT_DIR]   (default: transfer/proto)
#
# The proto is staged as k3serve/transfer/proto/transfer.proto before protoc runs, so the generated
# gRPC module imports `from k3serve.transfer.proto import transfer_pb2` (right both installed and in
# the source checkout) and the descriptor is registered under a name no other package uses.
# Needs grpcio-tools==1.84.0 (the `test` extra): another version writes different files.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT=${1:-transfer/proto}
"$PYTHON" -c "import grpc_tools" 2>/dev/null || {
  echo "gen_proto.sh: $PYTHON cannot import grpc_tools; pip install grpcio-tools==1.84.0" >&2
  exit 1
}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/src/k3serve/transfer/proto" "$stage/out" "$OUT"
cp transfer/proto/transfer.proto "$stage/src/k3serve/transfer/proto/transfer.proto"
"$PYTHON" -m grpc_tools.protoc -I "$stage/src" \
  --python_out="$stage/out" --pyi_out="$stage/out" --grpc_python_out="$stage/out" \
  k3serve/transfer/proto/transfer.proto
cp "$stage/out/k3serve/transfer/proto/transfer_pb2.py" "$stage/out/k3serve/transfer/proto/transfer_pb2.pyi" \
  "$stage/out/k3serve/transfer/proto/transfer_pb2_grpc.py" "$OUT/"
