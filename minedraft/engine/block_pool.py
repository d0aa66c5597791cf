"""KV blocks of a worker: a free list, reference counts, and a prefix cache of full blocks keyed by their tokens."""

from __future__ import annotations

import array
import collections
import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from minedraft.errors import CapacityError

# Block 0 is never handed out: table entries of positions a sequence does not own point at it, so the garbage that
# padding rows and padded positions write lands somewhere no sequence reads.
TRASH_BLOCK = 0


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The key of each full block of `tokens`: a digest of its tokens and of the key before it, so that two
    sequences share a block only when everything up to its end is equal (a digest, not `hash()`: a collision would
    hand one prompt another's K/V)."""
    ids = array.array("i", tokens)  # 4-byte signed ints, packed at once: per-token packing cost 0.6 ms a 2k prompt
    if sys.byteorder == "big":
        ids.byteswap()  # the same keys on every host: the coordinator mirrors the workers' keys
    data, width = ids.tobytes(), block_size * ids.itemsize
    keys, parent = [], b""
    for start in range(0, len(data) - width + 1, width):
        parent = hashlib.blake2b(parent + data[start : start + width], digest_size=16).digest()
        keys.append(parent)
    return keys


@dataclass
class PoolStats:
    """Counters since start-up: prefix cache lookups and hits (in tokens), blocks evicted from it."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0


class BlockPool:
    """`num_blocks` blocks (block 0 the trash block) handed out by reference count.

    A full block of a prompt is registered under its key (`block_hashes`); while anyone holds it, a new prompt
    starting with the same tokens shares it (`share_prefix`). A cached block no one holds stays cached, evictable,
    least recently freed first, until a block is wanted and none is free."""

    def __init__(self, num_blocks: int, prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks (one is the trash block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self._free = collections.deque(range(1, num_blocks))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self.stats = PoolStats()

    @property
    def usable(self) -> int:
        """Blocks that sequences can hold (all but the trash block)."""
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks a sequence can take now: free, or cached and held by no one."""
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        """Blocks some sequence holds."""
        return self.usable - self.available

    @property
    def cached(self) -> int:
        """Blocks in the prefix cache, held or not."""
        return len(self._key_of)

    def take(self, count: int) -> list[int]:
        """`count` blocks, each held once: free ones first, then the least recently freed cached ones."""
        if count > self.available:
            raise CapacityError(f"need {count} KV blocks, {self.available} free of {self.usable}")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
                self.stats.evicted_blocks += 1
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one hold of each block; a block no one holds goes back (a cached one stays cached, evictable)."""
        for block in blocks:
            assert self._refs[block] > 0, f"block {block} freed more often than taken"
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def share_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of `keys` from the start, each now held once more."""
        blocks = []
        if self.prefix_caching:
            for key in keys:
                block = self._block_of.get(key)
                if block is None:
                    break
                if self._refs[block] == 0:
                    del self._evictable[block]
                self._refs[block] += 1
                blocks.append(block)
        return blocks

    def register(self, blocks: Sequence[int], keys: Sequence[bytes]) -> None:
        """Cache full blocks under their keys (blocks already cached, or keys another block holds, stay as they
        are)."""
        if not self.prefix_caching:
            return
        for block, key in zip(blocks, keys):
            if block not in self._key_of and key not in self._block_of:
                self._key_of[block] = key
                self._block_of[key] = block

    def record_lookup(self, queried: int, hit: int) -> None:
        self.stats.queried_tokens += queried
        self.stats.hit_tokens += hit
