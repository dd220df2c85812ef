"""Moves the MLA latent KV and the KDA state between prefill and decode: layouts, TP mapping,
pin/lease manager, backends (mooncake, nixl, local), gRPC control plane."""
