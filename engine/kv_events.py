"""KV cache events for prefix-aware routers, in vLLM's `--kv-events-config` format (vllm/distributed/kv_events.py).

An engine whose `kv_events_config` enables them publishes, on a ZMQ PUB socket, one multipart message per change
of its prefix cache's MLA blocks:

    frame 0   topic (utf-8; "" by default)
    frame 1   sequence number, 8 bytes big-endian, from 0 (a gap means the subscriber missed batches)
    frame 2   msgpack KVEventBatch, as vLLM's msgspec encoder writes it: [ts, [event, ...], data_parallel_rank]
              event: {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                      "lora_id", "medium", "lora_name"} | {"type": "BlockRemoved", "block_hashes", "medium"}

A block is stored when a full prompt block gets its chained hash in the prefix cache (engine/prefix_cache.py
`insert`, with its tokens) and removed when its hash is dropped (block_pool.py: evicted for a new block, or by
`clear`, each block named: vLLM's AllBlocksCleared is never sent, as blocks in use keep their hashes). A hit in k3serve also needs the KDA checkpoint at the prefix's end (prefix_cache.py), so a stored block
says its tokens are cached, not that every prefix ending there resumes. Hashes are k3serve's chained hashes as
unsigned 64-bit integers. Each call publishes its own batch at once, from the engine's thread (the socket's
only user); a PUB socket never blocks: past `hwm` queued messages ZMQ drops them. No replay endpoint.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

if TYPE_CHECKING:
    from k3serve.engine.config import EngineArgs

_U64 = (1 << 64) - 1


def open_kv_events(args: "EngineArgs") -> "KVEventPublisher | None":
    """The publisher `args.kv_events_config` asks for, or None (none given, disabled, or the null publisher)."""
    if args.kv_events_config is None:
        return None
    config = KVEventsConfig.from_json(args.kv_events_config)
    if not config.publishes:
        return None
    return KVEventPublisher(config, args.tokens_per_block, "GPU" if args.device.startswith("cuda") else "CPU")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, the fields k3serve serves; `from_json` parses `--kv-events-config`."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    """None: "zmq" when enabled, else "null" (as vLLM)."""
    endpoint: str = "tcp://*:5557"
    """Bound when it has a wildcard (`*`) or is ipc:// / inproc://, else connected to (as vLLM)."""
    topic: str = ""
    hwm: int = 100_000
    """ZMQ's high-water mark of the PUB socket: queued messages past it are dropped."""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config.enable_kv_cache_events must be a boolean, got "
                             f"{self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string, got {getattr(self, name)!r}")
        if "://" not in self.endpoint:
            raise ValueError(f"kv_events_config.endpoint must be a ZMQ address (tcp://host:port, ipc://path), "
                             f"got {self.endpoint!r}")
        if type(self.hwm) is not int or self.hwm < 0:
            raise ValueError(f"kv_events_config.hwm must be an integer >= 0, got {self.hwm!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        """The config from vLLM's JSON form; ValueError naming what is wrong (not JSON, an unknown key)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_events_config must be JSON, as vLLM's --kv-events-config: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {text!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unsupported key(s) {unknown} (no replay endpoint); known: "
                             f"{sorted(known)}")
        return cls(**data)


class KVEventPublisher:
    """One engine's ZMQ PUB socket of KVEventBatches (module docstring). Thread: the engine's; `close` once."""

    def __init__(self, config: KVEventsConfig, block_size: int, medium: str, data_parallel_rank: int = 0,
                 clock: Callable[[], float] = time.time) -> None:
        """medium: vLLM's name of where the blocks live, "GPU" or "CPU"."""
        import msgpack
        import zmq

        self._pack = msgpack.Packer(use_bin_type=True).pack
        self.block_size, self.medium, self.data_parallel_rank, self.clock = block_size, medium, data_parallel_rank, clock
        self.topic = config.topic.encode()
        self._seq = 0
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(config.hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._socket.bind(endpoint)
            endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)  # the port, when bound to :0
        else:
            self._socket.connect(endpoint)
        self.endpoint = endpoint
        """Where subscribers connect (the bound address, its port resolved)."""

    def block_stored(self, block_hashes: Sequence[int], parent_block_hash: int | None,
                     token_ids: Sequence[int]) -> None:
        """Full blocks that got their hashes, in prefix order; `token_ids` their tokens (block_size each);
        `parent_block_hash` the hash of the block before the first (None: they start the sequence)."""
        self._publish({"type": "BlockStored", "block_hashes": [h & _U64 for h in block_hashes],
                       "parent_block_hash": None if parent_block_hash is None else parent_block_hash & _U64,
                       "token_ids": list(token_ids), "block_size": self.block_size, "lora_id": None,
                       "medium": self.medium, "lora_name": None})

    def block_removed(self, block_hashes: Sequence[int]) -> None:
        """Blocks whose hashes the cache dropped."""
        if block_hashes:
            self._publish({"type": "BlockRemoved", "block_hashes": [h & _U64 for h in block_hashes],
                           "medium": self.medium})

    def close(self) -> None:
        self._socket.close(linger=0)

    def _publish(self, event: dict[str, Any]) -> None:
        payload = self._pack([self.clock(), [event], self.data_parallel_rank])
        self._socket.send_multipart((self.topic, self._seq.to_bytes(8, "big"), payload))
        self._seq += 1
