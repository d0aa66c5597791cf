"""What the coordinator knows of each worker's free KV blocks: admission and preemption decide by it."""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Sequence
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
    prefix_caching: bool = False  # as the worker reported it (False also from a worker older than the report)

    def reset(self, block_size: int, num_blocks: int, free: int, prefix_caching: bool = False) -> None:
        self.block_size, self.num_blocks, self.reported, self.pending = block_size, num_blocks, free, 0
        self.prefix_caching = prefix_caching

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
    finds cached. Active from the start where the target reports its prefix caching on, else once it reports a hit
    (a worker older than that report); an estimate either way: the target may have evicted a block, or compute a
    block in common with an earlier prompt of the same prefill where sharing it would save less than a forward
    costs (`SequenceTable.prefill`), which costs one prefill a little over the budget."""

    def __init__(self, ledger: BlockLedger) -> None:
        self._ledger = ledger  # the target's: its block size, block count and whether it caches prefixes
        self._keys: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # least recently used first
        self._hit = False
        # Each waiting request's prompt keys and how many tokens they were made from: admission asks for them at
        # every step while it waits; an entry goes with its request.
        self._prompt_key_cache: weakref.WeakKeyDictionary[RequestState, tuple[int, list[bytes]]] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def active(self) -> bool:
        return bool(self._ledger.block_size) and (self._ledger.prefix_caching or self._hit)

    def admission_cost(self) -> Callable[[RequestState], int]:
        """The cost of each request of one admitted group, asked in order (`BatchManager.take_admissions`): the
        tokens its prefill likely computes, where the blocks of the requests asked before it count as cached (the
        target prefills one prompt of a family first and the others share its blocks)."""
        group: set[bytes] = set()

        def cost(request: RequestState) -> int:
            tokens = request.prefill_ids
            if not self.active:
                return len(tokens)
            keys = self._prompt_keys(request)
            hits = 0
            for key in keys:
                if key not in self._keys and key not in group:
                    break
                hits += 1
            group.update(keys[hits:])
            return len(tokens) - hits * self._ledger.block_size

        return cost

    def uncached_tokens(self, request: RequestState) -> int:
        """The tokens of a waiting request's prefill the target likely computes, alone."""
        return self.admission_cost()(request)

    def _prompt_keys(self, request: RequestState) -> list[bytes]:
        """The keys of the blocks of a request's prompt that its prefill can find cached (its last token aside)."""
        tokens = request.prefill_ids
        made_from, keys = self._prompt_key_cache.get(request, (-1, []))
        if made_from != len(tokens):
            keys = block_hashes(tokens[: len(tokens) - 1], self._ledger.block_size)
            self._prompt_key_cache[request] = (len(tokens), keys)
        return keys

    def prefilled(self, prompts: Sequence[Sequence[int]], cached: Sequence[int]) -> None:
        """The target prefilled `prompts`, finding `cached` tokens of each in its cache: their full blocks are
        cached now."""
        self._hit = self._hit or any(cached)
        if not self.active:
            return
        for prompt in prompts:
            for key in block_hashes(prompt, self._ledger.block_size):
                self._keys[key] = None
                self._keys.move_to_end(key)
        while len(self._keys) > max(self._ledger.num_blocks, 1):
            self._keys.popitem(last=False)
