"""The offload tiers of the prefix cache: prefix units (MLA blocks to a boundary + the KDA checkpoint there) kept
in host memory or Mooncake Store once the device evicts them. Design: docs/design/offload.md."""
