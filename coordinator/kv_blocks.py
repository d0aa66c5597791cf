"""What the coordinator knows of each worker's free KV blocks: admission and preemption decide by it."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.request_state import RequestState
from minedraft.engine.block_pool import block_hashes


@dataclass
class BlockLedger:
    """One worker's free blocks as its last reply reported them, less the most that calls sent since may take.

    Estimates are upper bounds on what calls take (a call may take fewer, or give back what a rollback left empty),
    so the coordinator errs toward preempting a little early rather than a worker refusing a step."""

    block_size: int = 0  # 0: a worker that reports no blocks (older than the paged cache): nothing is accounted
    num_blocks: int = 0
    reported: int = 0
    pending: int = 0

    def reset(self, block_size: int, num_blocks: int, free: int) -> None:
        self.block_size, self.num_blocks, self.reported, self.pending = block_size, num_blocks, free, 0

    @property
    def accounted(self) -> bool:
        return self.block_size > 0

    @property
    def free(self) -> int:
        return self.reported - self.pending

    def sent(self, blocks: int) -> int:
        """A call that may take `blocks` went out; returns what to give `answered`."""
        self.pending += blocks
        return blocks

    def answered(self, blocks: int, free: int | None) -> None:
        """Its reply came (`free`: the blocks it reported free, None for a failed call)."""
        self.pending -= blocks
        if free is not None:
            self.reported = free

    def for_tokens(self, tokens: int) -> int:
        """Blocks that `tokens` new tokens of one sequence may take (a partly filled block first)."""
        return -(-tokens // self.block_size) + 1 if self.accounted else 0

    def for_prompt(self, tokens: int) -> int:
        """Blocks a prompt of `tokens` takes without the prefix cache."""
        return -(-tokens // self.block_size) if self.accounted else 0


class PrefixMemory:
    """The full prompt blocks the target prefilled lately, as the coordinator saw them: what its prefix cache likely
    holds, so that the prefill budget (`--max-prefill-tokens`) counts the tokens a prefill computes, not those it
    finds cached. Off until the target reports a hit (its prefix caching may be off); an estimate either way: the
    target may have evicted a block, which costs one prefill a little over the budget."""

    def __init__(self, ledger: BlockLedger) -> None:
        self._ledger = ledger  # the target's: its block size and block count
        self._keys: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # least recently used first
        self.active = False

    def uncached_tokens(self, request: RequestState) -> int:
        """The tokens of a waiting request's prefill the target likely computes."""
        tokens = request.prefill_ids
        size = self._ledger.block_size
        if not (self.active and size):
            return len(tokens)
        made_from, keys = request.block_keys
        if made_from != len(tokens):
            keys = block_hashes(tokens[: len(tokens) - 1], size)
            request.block_keys = (len(tokens), keys)
        hits = 0
        for key in keys:
            if key not in self._keys:
                break
            hits += 1
        return len(tokens) - hits * size

    def prefilled(self, prompts: Sequence[Sequence[int]], cached: Sequence[int]) -> None:
        """The target prefilled `prompts`, finding `cached` tokens of each in its cache: their full blocks are
        cached now."""
        self.active = self.active or any(cached)
        size = self._ledger.block_size
        if not (self.active and size):
            return
        for prompt in prompts:
            for key in block_hashes(prompt, size):
                self._keys[key] = None
                self._keys.move_to_end(key)
        while len(self._keys) > max(self._ledger.num_blocks, 1):
            self._keys.popitem(last=False)
