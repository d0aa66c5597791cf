"""What the coordinator knows of each worker's free KV blocks: admission and preemption decide by it."""

from __future__ import annotations

from dataclasses import dataclass


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
