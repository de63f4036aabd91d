"""The KV cache's use at one moment (LLMEngine.kv_usage, for stats and benchmarks), reached
through block_manager.KV_USAGE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanovllm.core.block_manager import BlockManager


@dataclass(frozen=True)
class KVUsage:
    """The KV cache at one moment, in tokens. used_blocks: blocks held (reserved ones included);
    live_tokens: K/V the running sequences hold that launched steps compute, a shared block once;
    the rest (fragmentation_tokens): unfilled block tails, blocks allocated ahead of a chunked
    prefill, reserved blocks."""

    block_size: int
    num_blocks: int
    used_blocks: int
    live_tokens: int
    running_seqs: int

    @property
    def allocated_tokens(self) -> int:
        return self.used_blocks * self.block_size

    @property
    def fragmentation_tokens(self) -> int:
        return self.allocated_tokens - self.live_tokens


def usage(bm: BlockManager, running) -> KVUsage:
    """The cache's use now, given the running sequences (a shared block is full and computed in
    each holder: each extra reference takes block_size tokens off)."""
    computed = sum(s.num_cached_tokens for s in running)
    return KVUsage(bm.block_size, bm.num_blocks, bm.num_blocks - len(bm.free_blocks),
                   computed - bm.num_shared_refs * bm.block_size, len(running))
