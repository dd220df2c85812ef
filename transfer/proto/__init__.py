"""Generated gRPC/protobuf modules for the prefill -> decode control plane (`transfer.proto`).

Do not edit `transfer_pb2*.py*` by hand: change `transfer.proto`, run `bash scripts/gen_proto.sh`,
and check the regenerated files in (tests/transfer/test_proto_generated.py compares them).
"""
