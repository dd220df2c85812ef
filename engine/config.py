"""Engine arguments: validated once, here, with errors that quote the bad value."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from k3serve.engine.spec.config import SpeculativeConfig
from k3serve.model.packaged import DEFAULT_MODEL

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names (torch is imported where a dtype is made)
DEFAULT_CPU_BLOCK_BYTES = 64 * 2**20  # the CPU default cache's MLA blocks, beside its KDA slots
DEFAULT_MODEL_CACHE_DIR = Path.home() / ".cache" / "k3serve" / "checkpoints"


@dataclass(frozen=True)
class EngineArgs:
    model: str = DEFAULT_MODEL
    """Checkpoint directory, a shipped model (`model/packaged.py`: the trained k3-code), or a small preset name
    (random weights, written once under model_cache_dir)."""
    tensor_parallel_size: int = 1
    """Ranks one engine's weights and KDA heads are sharded over."""
    decode_context_parallel_size: int = 1
    """Ranks of the TP group that split every request's MLA latent KV by sequence (vLLM's name): each holds 1/N
    of it, a page of block_size tokens of every block of N pages, and attends over its part (docs/design/dcp.md).
    Must divide tensor_parallel_size; 1: the latent KV replicated on every rank."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and caches; auto: float32 on CPU (exact reference path), bfloat16 on CUDA."""
    device: str = "cpu"
    """'cpu' or 'cuda' (a TP engine's rank r on GPU r)."""
    seed: int = 0
    """Seeds the weights of a preset checkpoint and the engine's global RNG."""
    block_size: int = 64
    """Tokens per MLA KV block on a rank; a block id holds decode_context_parallel_size of them (the scheduler's
    block, and the prefix cache's and KDA checkpoints' granularity: `tokens_per_block`)."""
    max_model_len: int = 4096
    """Prompt + output tokens per request."""
    max_num_seqs: int = 64
    """Running requests per engine (each holds a KDA working slot)."""
    max_num_batched_tokens: int | None = None
    """Base per-step token budget; None = 16384 on >= 80 GiB GPUs, 8192 elsewhere."""
    max_adaptive_batched_tokens: int | None = None
    """Budget ceiling while few requests run (adaptive budget); None = 2x the base."""
    adaptive_token_budget: bool = True
    """Raise the step's token budget up to max_adaptive_batched_tokens while few requests run (False: a static
    max_num_batched_tokens, the adaptive budget's baseline)."""
    long_prefill_token_threshold: int | None = None
    """Cap on one request's prefill chunk per step; None = the budget only."""
    enable_prefix_caching: bool = True
    """Reuse cached prompt prefixes (MLA blocks + a KDA state checkpoint at their end)."""
    kda_checkpoint_mode: Literal["in_pass", "align", "none"] = "in_pass"
    """How a prompt's KDA checkpoint is taken: within the forward pass, by a chunk clipped to it, or not at all."""
    kernels: Literal["ours", "reference"] = "ours"
    """'ours': each op's GPU kernel on CUDA (CPU: the torch reference anyway); 'reference': the torch reference
    of every op, also on CUDA, and no CUDA graphs (the kernels' baseline)."""
    moe_finalize: Literal["fused", "unfused"] = "fused"
    """The routed experts' weighted top-k sum: fused into their kernels, or 'unfused' (per-pair rows, then a
    separate sum: the fused finalize's baseline)."""
    cache_memory_bytes: int | None = None
    """Bytes for MLA blocks + KDA slots; None = 64 MiB on CPU, on CUDA what gpu_memory_utilization leaves."""
    gpu_memory_utilization: float = 0.9
    """CUDA: fraction of the device's memory the engine may fill (weights, graphs, activations, caches)."""
    num_kda_slots: int | None = None
    """KDA state slots; None = max_num_seqs working slots + as many for prefix checkpoints."""
    num_gpu_blocks_override: int | None = None
    """MLA KV blocks to make, whatever the budget would hold (at most that; as vLLM's); None = all it holds."""
    model_cache_dir: str = str(DEFAULT_MODEL_CACHE_DIR)
    """Where preset checkpoints are written."""
    served_model_name: str | None = None
    """The model id clients see (`/v1/models`); None = the preset name or the directory name."""
    enforce_eager: bool = False
    """True: every step runs eagerly. False: on CUDA (bf16; at TP > 1 on NCCL) decode-only steps replay CUDA graphs."""
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    """Decode batch sizes captured as CUDA graphs (a batch is padded up to the next one), strictly
    increasing, each <= max_num_seqs; None = 1, 2, 4, 8, then multiples of 16, up to min(max_num_seqs, 512)."""
    kv_events_config: str | None = None
    """JSON as vLLM's --kv-events-config (enable_kv_cache_events, publisher, endpoint, topic, hwm): publish the prefix
    cache's block stored / removed events over ZMQ for prefix-aware routers (engine/kv_events.py); None = off."""

    kv_offload: Literal["none", "host", "mooncake"] = "none"
    """Where prefix units (MLA blocks + the KDA checkpoint at their end) go beside the device prefix cache: 'host'
    memory of this engine (pinned on CUDA, LRU), 'mooncake' (Mooncake Store, shared by every replica that names the
    same master), or 'none'. Needs enable_prefix_caching (docs/design/offload.md)."""
    kv_offload_host_bytes: int | None = None
    """Bytes of the host tier (kv_offload='host'), on every TP rank; None = twice the device's MLA blocks + KDA
    slots, at most half the host's memory shared by the TP ranks."""
    kv_offload_mooncake_config: str | None = None
    """kv_offload='mooncake': JSON with the store's master_server_addr and metadata_server (needed),
    global_segment_size and local_buffer_size (bytes this client gives the store / stages in), protocol (tcp),
    device_name, local_hostname and timeout_s (a slower store call is a miss); read only with kv_offload='mooncake'."""

    # ---- speculative decoding ----
    speculative_config: SpeculativeConfig | None = None
    """vLLM's speculative_config, e.g. '{"method": "ngram", "num_speculative_tokens": 4}' (a JSON object or its
    dict): method, num_speculative_tokens (1..8), prompt_lookup_min/max, ...; None: no speculation. Serving: the
    decode pool's and a colocated engine's (a prefill engine samples one token)."""

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        for name in ("tensor_parallel_size", "block_size", "max_model_len", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        dcp = self.decode_context_parallel_size
        if not isinstance(dcp, int) or dcp < 1 or self.tensor_parallel_size % dcp:
            raise ValueError(f"decode_context_parallel_size must be an integer >= 1 dividing tensor_parallel_size="
                             f"{self.tensor_parallel_size}, got {dcp!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kda_checkpoint_mode not in ("in_pass", "align", "none"):
            raise ValueError(f"kda_checkpoint_mode must be 'in_pass', 'align' or 'none', got {self.kda_checkpoint_mode!r}")
        if self.kernels not in ("ours", "reference"):
            raise ValueError(f"kernels must be 'ours' or 'reference', got {self.kernels!r}")
        if self.moe_finalize not in ("fused", "unfused"):
            raise ValueError(f"moe_finalize must be 'fused' or 'unfused', got {self.moe_finalize!r}")
        if not self.adaptive_token_budget and self.max_adaptive_batched_tokens is not None:
            raise ValueError(f"max_adaptive_batched_tokens={self.max_adaptive_batched_tokens} with "
                             "adaptive_token_budget=False: a static budget has no ceiling (give one or the other)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kda_slots is not None and self.num_kda_slots < self.max_num_seqs:
            raise ValueError(
                f"num_kda_slots={self.num_kda_slots} < max_num_seqs={self.max_num_seqs}: every running request needs a slot"
            )
        for name in ("max_num_batched_tokens", "max_adaptive_batched_tokens", "long_prefill_token_threshold",
                     "cache_memory_bytes", "num_gpu_blocks_override"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if (self.max_adaptive_batched_tokens is not None and self.max_num_batched_tokens is not None
                and self.max_adaptive_batched_tokens < self.max_num_batched_tokens):
            raise ValueError(f"max_adaptive_batched_tokens={self.max_adaptive_batched_tokens} < max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}: the adaptive budget's ceiling is below its base")
        if self.cuda_graph_batch_sizes is not None:
            sizes = self.cuda_graph_batch_sizes
            if (not isinstance(sizes, (tuple, list)) or not sizes
                    or not all(type(b) is int and 1 <= b <= self.max_num_seqs for b in sizes)
                    or any(a >= b for a, b in zip(sizes, sizes[1:]))):
                raise ValueError(
                    f"cuda_graph_batch_sizes must be strictly increasing integers in [1, max_num_seqs="
                    f"{self.max_num_seqs}], got {sizes!r}"
                )
            if self.enforce_eager:
                raise ValueError(f"cuda_graph_batch_sizes={sizes!r} with enforce_eager=True: an eager engine "
                                 "captures no graphs (give one or the other)")
            object.__setattr__(self, "cuda_graph_batch_sizes", tuple(sizes))

        if self.kv_offload not in ("none", "host", "mooncake"):
            raise ValueError(f"kv_offload must be 'none', 'host' or 'mooncake', got {self.kv_offload!r}")
        if self.kv_offload == "mooncake" and self.kv_offload_mooncake_config is None:
            raise ValueError("kv_offload='mooncake' needs kv_offload_mooncake_config (the store's master and metadata "
                             "server)")
        if self.kv_offload_mooncake_config is not None:
            from k3serve.engine.offload.mooncake_config import MooncakeStoreConfig

            MooncakeStoreConfig.from_json(self.kv_offload_mooncake_config)  # refused here, before any engine starts
        if self.kv_offload != "none" and not self.enable_prefix_caching:
            raise ValueError(f"kv_offload={self.kv_offload!r} needs enable_prefix_caching=True: the tiers hold the "
                             "prefix cache's units")
        if self.kv_offload_host_bytes is not None and (
                not isinstance(self.kv_offload_host_bytes, int) or self.kv_offload_host_bytes < 1):
            raise ValueError(f"kv_offload_host_bytes must be an integer >= 1 or None, got {self.kv_offload_host_bytes!r}")
        if self.kv_events_config is not None:
            from k3serve.engine.kv_events import KVEventsConfig

            KVEventsConfig.from_json(self.kv_events_config)  # refused here, before any engine starts

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        """Like the constructor, but names the unknown argument instead of a bare TypeError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)

    @property
    def tokens_per_block(self) -> int:
        """Tokens one block id holds: the scheduler's block (`block_size` a DCP rank, times the DCP ranks)."""
        return self.block_size * self.decode_context_parallel_size

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes to capture (`cuda_graph_batch_sizes` or its default)."""
        if self.cuda_graph_batch_sizes is not None:
            return self.cuda_graph_batch_sizes
        cap = min(self.max_num_seqs, 512)
        return tuple(sorted({b for b in (1, 2, 4, 8, *range(16, cap + 1, 16)) if b <= cap} | {cap}))

    @property
    def kda_slots(self) -> int:
        if self.num_kda_slots is not None:
            return self.num_kda_slots
        return self.max_num_seqs * (2 if self.enable_prefix_caching else 1)


@cache
def engine_arg_docs() -> dict[str, str]:
    """Each EngineArgs field's docstring (the string under it in the class body) by field name, on one line:
    the description `k3serve serve --help` shows for the field."""
    (cls,) = ast.parse(inspect.getsource(EngineArgs)).body
    docs = {}
    for node, after in zip(cls.body, cls.body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
