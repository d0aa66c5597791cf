"""Decides per PSD step whether Verify(X) and Propose(Y) run at once or one after the other."""

from __future__ import annotations

from collections import deque

# Overlap pays on two GPUs; on one shared GPU, time-slicing between two processes can make the concurrent step
# slower than the two calls in sequence. Both strategies verify one batch and draft the other per step, so their
# step times per verified sequence compare directly.
PROBE_EVERY = 32  # steps between trials of the strategy not in use
PROBE_STEPS = 4
# A strategy that costs this much more than the one in use is tried four times less often: on two H200s a
# sequential step took twice an overlapped one (run 7), and trying it 4 steps in 36 cost 11% of the throughput.
CLEARLY_WORSE = 1.25
# Each strategy's cost is the median of its recent steps: a step that captured a CUDA graph for a new shape, or ran
# while the GPU was busy with a prefill, can take ten times as long, and an average would let one such step decide
# for many (on an H200, PSD stayed overlapped at 0.88 of SD's throughput with a smoothed mean).
WINDOW = 9


OVERLAP_CHOICES = ("auto", "always", "never")


class OverlapPolicy:
    def __init__(self, mode: str = "auto") -> None:
        if mode not in OVERLAP_CHOICES:
            raise ValueError(f"overlap must be one of {', '.join(OVERLAP_CHOICES)}")
        self.mode = mode
        self.recent: dict[bool, deque[float]] = {True: deque(maxlen=WINDOW), False: deque(maxlen=WINDOW)}
        self._steps = 0
        self._probing = 0  # steps of the current trial still to run
        self._trial = False  # the strategy on trial

    def cost(self, overlapped: bool) -> float | None:
        """Median seconds per verified sequence of the recent steps run this way (None before the first)."""
        recent = sorted(self.recent[overlapped])
        return recent[len(recent) // 2] if recent else None

    @property
    def preferred(self) -> bool:
        overlap, sequential = self.cost(True), self.cost(False)
        return sequential is None or overlap is None or overlap <= sequential

    def choose(self) -> bool:
        """True: run the two calls concurrently."""
        if self.mode != "auto":
            return self.mode == "always"
        if self._probing:
            self._probing -= 1
            return self._trial
        other = not self.preferred
        # Until the other strategy has a full window of samples, try it more often.
        interval = PROBE_EVERY if len(self.recent[other]) >= WINDOW else 2 * PROBE_STEPS
        if interval == PROBE_EVERY and self._ratio(other) >= CLEARLY_WORSE:
            interval *= 4
        self._steps += 1
        if self._steps >= interval:
            self._steps = 0
            self._probing, self._trial = PROBE_STEPS - 1, other
            return other
        return self.preferred

    def _ratio(self, overlapped: bool) -> float:
        """How much more a step run this way costs than one run the other way."""
        mine, theirs = self.cost(overlapped), self.cost(not overlapped)
        return mine / theirs if mine is not None and theirs else 1.0

    def record(self, overlapped: bool, step_seconds: float, verified: int) -> None:
        self.recent[overlapped].append(step_seconds / max(verified, 1))
