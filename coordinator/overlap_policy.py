"""Decides per PSD step whether Verify(X) and Propose(Y) run at once or one after the other."""

from __future__ import annotations

# Overlap pays on two GPUs; on one shared GPU, time-slicing between two processes can make the concurrent step
# slower than the two calls in sequence. Both strategies verify one batch and draft the other per step, so their
# step times per verified sequence compare directly.
PROBE_EVERY = 64  # steps between trials of the strategy not in use
PROBE_STEPS = 4
SMOOTHING = 0.2


OVERLAP_CHOICES = ("auto", "always", "never")


class OverlapPolicy:
    def __init__(self, mode: str = "auto") -> None:
        if mode not in OVERLAP_CHOICES:
            raise ValueError(f"overlap must be one of {', '.join(OVERLAP_CHOICES)}")
        self.mode = mode
        self.cost: dict[bool, float | None] = {True: None, False: None}  # seconds per verified sequence
        self._steps = 0
        self._probing = 0

    @property
    def preferred(self) -> bool:
        overlap, sequential = self.cost[True], self.cost[False]
        return sequential is None or overlap is None or overlap <= sequential

    def choose(self) -> bool:
        """True: run the two calls concurrently."""
        if self.mode != "auto":
            return self.mode == "always"
        self._steps += 1
        if self._probing:
            self._probing -= 1
            return not self.preferred
        if self._steps % PROBE_EVERY == 0 or (self._steps == PROBE_STEPS + 1 and self.cost[False] is None):
            self._probing = PROBE_STEPS - 1
            return not self.preferred
        return self.preferred

    def record(self, overlapped: bool, step_seconds: float, verified: int) -> None:
        cost = step_seconds / max(verified, 1)
        old = self.cost[overlapped]
        self.cost[overlapped] = cost if old is None else (1 - SMOOTHING) * old + SMOOTHING * cost
