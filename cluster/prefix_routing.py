"""Prefix-aware choice of a prefill replica: the longest prefix unit a replica holds, weighed against its load.

The router records where it sent each prompt: a prefill replica that ran a prompt holds its prefix unit (the MLA
blocks to the prompt's last block boundary and the KDA checkpoint there), in its device prefix cache or its host
tier, until it evicts it. So per replica an LRU of unit keys (the chained hash of a unit's last block) stands for
what it holds, approximately, as SGLang's cache-aware router keeps an approximate tree of the prompts it routed.
When the pool offloads to a shared store (kv_offload="mooncake") every replica wrote its units through to it, and
any replica can load any of them: the store's units count for every replica.

A replica's cost for a prompt is what it must compute before this prompt's first token, in prompt tokens:

    cost(r) = prompt tokens in flight on r (from here)  +  len(prompt) - hit(r)

and the cheapest replica goes first (ties: the rendezvous order the caller gives, which spreads new prefixes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from k3serve.engine.block_pool import compute_block_hashes

MAX_UNITS = 65536  # unit keys remembered per replica (and for the store): 8 bytes each plus the dict's


class PrefixRouting:
    def __init__(self, block_size: int, shared_store: bool = False, max_units: int = MAX_UNITS) -> None:
        if block_size < 1 or max_units < 1:
            raise ValueError(f"need block_size >= 1 and max_units >= 1, got {block_size}, {max_units}")
        self.block_size, self.shared_store, self.max_units = block_size, shared_store, max_units
        self._units: dict[str, OrderedDict[int, None]] = {}  # replica name -> unit keys, oldest first
        self._store: OrderedDict[int, None] = OrderedDict()

    def hashes(self, prompt_ids: Sequence[int]) -> list[int]:
        """The chained hashes of the blocks a hit may cover (strictly shorter than the prompt)."""
        num_blocks = (len(prompt_ids) - 1) // self.block_size
        return compute_block_hashes(prompt_ids[: num_blocks * self.block_size], self.block_size)

    def hit_tokens(self, replica: str, hashes: Sequence[int]) -> int:
        """Prompt tokens of the longest unit `replica` (or, with a shared store, the store) was seen to hold."""
        units = self._units.get(replica, {})
        for i in range(len(hashes), 0, -1):
            if hashes[i - 1] in units or (self.shared_store and hashes[i - 1] in self._store):
                return i * self.block_size
        return 0

    def order(self, replicas: Sequence[str], prompt_ids: Sequence[int], load_tokens: Mapping[str, int]) -> list[str]:
        """`replicas` (in tie-break order) by cost, cheapest first."""
        hashes = self.hashes(prompt_ids)
        cost = {r: load_tokens.get(r, 0) + len(prompt_ids) - self.hit_tokens(r, hashes) for r in replicas}
        rank = {r: i for i, r in enumerate(replicas)}
        return sorted(replicas, key=lambda r: (cost[r], rank[r]))

    def record(self, replica: str, prompt_ids: Sequence[int]) -> None:
        """`replica` ran `prompt_ids`: it holds the unit at the prompt's last block boundary (and the store does)."""
        hashes = self.hashes(prompt_ids)
        if not hashes:
            return
        for units in (self._units.setdefault(replica, OrderedDict()), self._store):
            units[hashes[-1]] = None
            units.move_to_end(hashes[-1])
            while len(units) > self.max_units:
                units.popitem(last=False)

    def forget(self, replica: str) -> None:
        """`replica` is gone (or restarted): it holds nothing."""
        self._units.pop(replica, None)
