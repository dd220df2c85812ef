"""`EngineArgs.kv_offload_mooncake_config`: where a Mooncake Store client finds the store, validated at the edge."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class MooncakeStoreConfig:
    """A client's setup (`MooncakeDistributedStore.setup`), as vLLM's Mooncake store connector reads it."""

    master_server_addr: str  # host:port of `mooncake_master`'s RPC
    metadata_server: str  # e.g. http://host:8080/metadata (the master's HTTP metadata server)
    global_segment_size: int = 256 * 2**20  # bytes this client lends the store
    local_buffer_size: int = 64 * 2**20  # bytes this client stages transfers in
    protocol: str = "tcp"
    device_name: str = ""  # RDMA devices; "" for tcp
    local_hostname: str = ""  # the address peers reach this client at; "" = $K3SERVE_HOST_IP or 127.0.0.1
    timeout_s: float = 2.0  # a lookup, put or get slower than this is a miss (the call is abandoned)

    def __post_init__(self) -> None:
        for name in ("master_server_addr", "metadata_server"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"kv_offload_mooncake_config needs {name} (a non-empty string)")
        for name in ("global_segment_size", "local_buffer_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_offload_mooncake_config {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool) or not self.timeout_s > 0:
            raise ValueError(f"kv_offload_mooncake_config timeout_s must be > 0, got {self.timeout_s!r}")
        for name in ("protocol", "device_name", "local_hostname"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_offload_mooncake_config {name} must be a string, got {getattr(self, name)!r}")

    @classmethod
    def from_json(cls, text: str) -> "MooncakeStoreConfig":
        try:
            data: Any = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"kv_offload_mooncake_config is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"kv_offload_mooncake_config must be a JSON object, got {text!r}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"kv_offload_mooncake_config: unknown key(s) {unknown}")
        missing = [name for name in ("master_server_addr", "metadata_server") if name not in data]
        if missing:
            raise ValueError(f"kv_offload_mooncake_config needs {', '.join(missing)}")
        return cls(**data)
