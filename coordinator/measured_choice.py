"""Chooses between two ways of running a step by what each measured recently, trying the other now and then."""

from __future__ import annotations

from collections import deque

PROBE_EVERY = 32  # steps between trials of the way not in use
PROBE_STEPS = 4
# A way that costs this much more than the one in use is tried four times less often: on two H200s a sequential
# PSD step took twice an overlapped one (run 7), and trying it 4 steps in 36 cost 11% of the throughput.
CLEARLY_WORSE = 1.25
# Each way's cost is the median of its recent steps: a step that captured a CUDA graph for a new shape, or ran while
# the GPU was busy with a prefill, can take ten times as long, and an average would let one such step decide for
# many (on an H200, PSD stayed overlapped at 0.88 of SD's throughput with a smoothed mean).
WINDOW = 9


class MeasuredChoice:
    """Two ways of running a step, True and False (True until measured slower); each costs the median of its recent
    steps' seconds per unit of work (`record`), so that steps of different sizes compare."""

    def __init__(self, fixed: bool | None = None, eager_trials: bool = True, margin: float = 0.0,
                 rare_above: float = CLEARLY_WORSE) -> None:
        """`fixed`: always that way, None: the cheaper one, as measured. `eager_trials`: until the other way has a
        full window of samples, try it every 2 x PROBE_STEPS steps, not every PROBE_EVERY. `margin`: the preferred
        way changes only for one that costs this share less (where changing has a cost of its own). `rare_above`:
        the other way is tried four times less often while it costs this many times the preferred one's or more."""
        self.fixed = fixed
        self.eager_trials = eager_trials
        self.margin = margin
        self.rare_above = rare_above
        self.preferred = True
        self.recent: dict[bool, deque[float]] = {True: deque(maxlen=WINDOW), False: deque(maxlen=WINDOW)}
        self._steps = 0
        self._probing = 0  # steps of the current trial still to run
        self._trial = False  # the way on trial

    def cost(self, way: bool) -> float | None:
        """Median seconds per unit of work of the recent steps run this way (None before the first)."""
        recent = sorted(self.recent[way])
        return recent[len(recent) // 2] if recent else None

    def choose(self) -> bool:
        """The way to run the next step."""
        if self.fixed is not None:
            return self.fixed
        if self._probing:
            self._probing -= 1
            return self._trial
        other = not self.preferred
        eager = self.eager_trials and len(self.recent[other]) < WINDOW
        interval = 2 * PROBE_STEPS if eager else PROBE_EVERY
        if interval == PROBE_EVERY and self._ratio(other) >= self.rare_above:
            interval *= 4
        self._steps += 1
        if self._steps >= interval:
            self._steps = 0
            self._probing, self._trial = PROBE_STEPS - 1, other
            return other
        return self.preferred

    def _ratio(self, way: bool) -> float:
        """How many times what a step run the other way costs a step run this way costs (0 before both have run)."""
        mine, theirs = self.cost(way), self.cost(not way)
        return mine / theirs if mine is not None and theirs else 0.0

    def record(self, way: bool, step_seconds: float, work: int) -> None:
        self.recent[way].append(step_seconds / max(work, 1))
        mine, other = self.cost(self.preferred), self.cost(not self.preferred)
        if mine is not None and other is not None and other < mine * (1 - self.margin):
            self.preferred = not self.preferred
