"""KV events (engine/kv_events.py): vLLM's --kv-events-config, its wire format byte for byte, and the events a real
engine publishes as its prefix cache stores and evicts blocks."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from k3serve.engine.block_pool import compute_block_hashes
from k3serve.engine.config import EngineArgs
from k3serve.engine.kv_events import KVEventPublisher, KVEventsConfig
from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

U64 = (1 << 64) - 1

# vLLM 0.32's msgspec encoding (vllm.distributed.kv_events) of KVEventBatch(ts, [event], data_parallel_rank=0):
# BlockStored(block_hashes=[11, 2**64 - 5], parent_block_hash=7, token_ids=[1, 2, 3, 4], block_size=2, lora_id=None,
# medium="CPU", lora_name=None) at ts 1.5, and BlockRemoved(block_hashes=[11], medium="CPU") at ts 2.25.
VLLM_STORED = bytes.fromhex(
    "93cb3ff80000000000009188a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920bcffffffffffffffffb"
    "b1706172656e745f626c6f636b5f6861736807a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6502a76c6f72615f69"
    "64c0a66d656469756da3435055a96c6f72615f6e616d65c000")
VLLM_REMOVED = bytes.fromhex(
    "93cb40020000000000009183a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573910ba66d656469756da3"
    "43505500")


def subscriber(endpoint: str):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    time.sleep(0.3)  # a PUB socket drops what it sends before the subscription reaches it
    return sub


def test_config_reads_vllms_json_and_refuses_what_it_does_not_serve():
    on = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5600", "topic": "kv"}')
    assert (on.publisher, on.endpoint, on.topic, on.publishes) == ("zmq", "tcp://*:5600", "kv", True)
    assert KVEventsConfig.from_json("{}").publisher == "null" and not KVEventsConfig.from_json("{}").publishes
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    with pytest.raises(ValueError, match="must be JSON"):
        KVEventsConfig.from_json("enable_kv_cache_events=true")
    with pytest.raises(ValueError, match=r"unsupported key\(s\) \['replay_endpoint'\]"):
        KVEventsConfig.from_json('{"replay_endpoint": "tcp://*:5601"}')
    with pytest.raises(ValueError, match="publisher must be 'zmq' or 'null'"):
        KVEventsConfig.from_json('{"publisher": "kafka"}')
    with pytest.raises(ValueError, match="endpoint must be a ZMQ address"):
        EngineArgs(kv_events_config='{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}')


def test_the_wire_format_is_vllms_byte_for_byte(tmp_path: Path):
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/kv", topic="kv")
    times = iter([1.5, 2.25])
    publisher = KVEventPublisher(config, block_size=2, medium="CPU", clock=lambda: next(times))
    sub = subscriber(publisher.endpoint)
    try:
        publisher.block_stored([11, -5], 7, [1, 2, 3, 4])  # a negative hash goes out as its unsigned 64-bit value
        publisher.block_removed([11])
        assert sub.recv_multipart() == [b"kv", (0).to_bytes(8, "big"), VLLM_STORED]
        assert sub.recv_multipart() == [b"kv", (1).to_bytes(8, "big"), VLLM_REMOVED]
    finally:
        sub.close(linger=0)
        publisher.close()


def test_an_engine_publishes_blocks_stored_and_evicted(tiny_checkpoint: Path, tmp_path: Path):
    """8 blocks of 16 tokens. Prompt A (40 tokens) stores its 2 full blocks under one checkpoint; prompt B (100
    tokens) needs 7 blocks, so the LRU of A's cached blocks (its tail) is evicted; then B stores its 6."""
    endpoint = f"ipc://{tmp_path}/events"
    llm = LLM(model=str(tiny_checkpoint), dtype="float32", block_size=16, max_model_len=128, num_gpu_blocks_override=8,
              kv_events_config=json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint}))
    sub = subscriber(llm.engine.kv_events.endpoint)
    prompt_a, prompt_b = [(7 * i) % 500 + 1 for i in range(40)], [(11 * i) % 500 + 3 for i in range(100)]
    try:
        llm.generate([prompt_a], SamplingParams(max_tokens=1))
        llm.generate([prompt_b], SamplingParams(max_tokens=1))
        batches = [sub.recv_multipart() for _ in range(3)]
    finally:
        sub.close(linger=0)
        llm.engine.close()
    assert [int.from_bytes(seq, "big") for _, seq, _ in batches] == [0, 1, 2]
    events = []
    for topic, _, payload in batches:
        ts, batch_events, rank = msgpack.unpackb(payload)
        assert topic == b"" and ts > 0 and rank == 0 and len(batch_events) == 1
        events.append(batch_events[0])
    hashes_a = [h & U64 for h in compute_block_hashes(prompt_a[:32], 16)]
    hashes_b = [h & U64 for h in compute_block_hashes(prompt_b[:96], 16)]
    assert events == [
        {"type": "BlockStored", "block_hashes": hashes_a, "parent_block_hash": None, "token_ids": prompt_a[:32],
         "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": hashes_a[1:], "medium": "CPU"},
        {"type": "BlockStored", "block_hashes": hashes_b, "parent_block_hash": None, "token_ids": prompt_b[:96],
         "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None},
    ]


def test_events_are_off_by_default(tiny_checkpoint: Path):
    llm = LLM(model=str(tiny_checkpoint), dtype="float32", block_size=16, max_model_len=128)
    assert llm.engine.kv_events is None and llm.engine.scheduler.prefix_cache.events is None
