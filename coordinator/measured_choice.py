"""Chooses among ways of running a step by what each measured recently, trying the others now and then."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

Way = TypeVar("Way", bound=Hashable)

PROBE_EVERY = 32  # steps between trials of the way not in use
PROBE_STEPS = 4
# A way that costs this much more than the one in use is tried four times less often: on two H200s a sequential
# PSD step took twice an overlapped one, and trying it 4 steps in 36 cost 11% of the throughput.
CLEARLY_WORSE = 1.25
# Each way's cost is the median of its recent steps: a step that captured a CUDA graph for a new shape, or ran while
# the GPU was busy with a prefill, can take ten times as long, and an average would let one such step decide for
# many (on an H200, PSD stayed overlapped at 0.88 of SD's throughput with a smoothed mean).
WINDOW = 9
# Pooled costs (`MeasuredChoice(pooled=True)`) leave out steps that took this many times the window's median.
OUTLIER = 3.0


class MeasuredChoice(Generic[Way]):
    """Ways of running a step, on a ring along which their costs change gradually (by default True and False; the
    first preferred until measured dearer); each costs its recent steps' seconds per unit of work (`record`: the
    median of their ratios, or pooled), so that steps of different sizes compare. Trials try a neighbour of the
    preferred way on the ring (two ways: the other one), so that a preference walks along it: after a turn between
    two ways next in the order, the next trial goes on in the same direction, soon (`first_trial_after`)."""

    def __init__(
        self,
        fixed: Way | None = None,
        eager_trials: bool = True,
        margin: float = 0.0,
        rare_above: float = CLEARLY_WORSE,
        preferred: Way | None = None,
        first_trial_after: int | None = None,
        backoff: int = 1,
        fresh_trials: bool = False,
        pooled: bool = False,
        ways: Sequence[Way] = (True, False),  # type: ignore[assignment]
    ) -> None:
        """`fixed`: always that way, None: the cheapest one, as measured, starting from `preferred` (default: the
        first way). `eager_trials`: until the way to try next has a full window of samples, try it every
        2 x PROBE_STEPS steps, not every PROBE_EVERY. `margin`: the preferred way changes only for one that costs
        this share less (where changing has a cost of its own). `rare_above`: a way is tried four times less often
        while it costs this many times the preferred one's or more. `first_trial_after`: steps before the first
        trial, and before the next after each turn, if not the rule's. `backoff`: each trial that leaves the
        preference as it was doubles the steps to the next, up to this many times the rule's (a turn starts again
        from the rule's). `fresh_trials`: the way on trial costs what its trial's steps cost (its older samples
        dropped as the trial starts), judged once they have all run: with trials hundreds of steps apart, a window
        spanning several would take as many to notice a change. `pooled`: a way costs its recent steps' seconds over
        their work, summed (steps `OUTLIER` times the median left out), not the median of each step's ratio: where a
        step's work varies (tokens emitted), the median of few ratios is biased (one sequence drafting 4 tokens at
        acceptance 0.7: by 39%)."""
        self.ways = tuple(ways)
        self.fixed = fixed
        self.eager_trials = eager_trials
        self.margin = margin
        self.rare_above = rare_above
        self.backoff = backoff
        self.fresh_trials = fresh_trials
        self.pooled = pooled
        self.preferred: Way = self.ways[0] if preferred is None else preferred
        # (step seconds, work) of each way's recent steps
        self.recent: dict[Way, deque[tuple[float, float]]] = {way: deque(maxlen=WINDOW) for way in self.ways}
        self._quick_trial_after = first_trial_after
        self._first_trial_after = first_trial_after
        self._spacing = 1  # the backoff's factor for the next trial
        self._steps = 0
        self._probing = 0  # steps of the current trial still to run
        self._trial: Way = self.preferred  # the way on trial
        self._unjudged = 0  # fresh trials: steps of the current trial not yet recorded
        self._toward: Way | None = None  # after a turn: the neighbour that goes on in its direction
        self._tried: dict[Way, int] = dict.fromkeys(self.ways, 0)  # trials so far (the least tried neighbour next)

    def cost(self, way: Way) -> float | None:
        """Seconds per unit of work of the recent steps run this way (None before the first): the median of their
        ratios, or pooled."""
        recent = self.recent[way]
        if not recent:
            return None
        if self.pooled:
            typical = sorted(seconds for seconds, _ in recent)[len(recent) // 2]
            kept = [(seconds, work) for seconds, work in recent if seconds <= OUTLIER * typical]
            return sum(seconds for seconds, _ in kept) / sum(work for _, work in kept)
        ratios = sorted(seconds / work for seconds, work in recent)
        return ratios[len(ratios) // 2]

    def measured(self) -> int:
        """How many ways have run."""
        return sum(1 for recent in self.recent.values() if recent)

    def choose(self) -> Way:
        """The way to run the next step."""
        if self.fixed is not None:
            return self.fixed
        if self._probing:
            self._probing -= 1
            return self._trial
        other = self._next_trial()
        eager = self.eager_trials and len(self.recent[other]) < WINDOW
        interval = 2 * PROBE_STEPS if eager else PROBE_EVERY
        if interval == PROBE_EVERY:
            interval *= self._spacing * (4 if self._ratio(other) >= self.rare_above else 1)
        if self._first_trial_after is not None:
            interval = self._first_trial_after
        self._steps += 1
        if self._steps >= interval:
            self._steps, self._first_trial_after, self._toward = 0, None, None
            self._spacing = min(2 * self._spacing, self.backoff)  # (back to 1 if this trial turns the preference)
            self._probing, self._trial = PROBE_STEPS - 1, other
            self._tried[other] += 1
            if self.fresh_trials:
                self.recent[other].clear()
                self._unjudged = PROBE_STEPS
            return other
        return self.preferred

    def _neighbours(self, way: Way) -> list[Way]:
        """The ways before and after `way`, the last way's after being the first."""
        i, n = self.ways.index(way), len(self.ways)
        return list(dict.fromkeys(self.ways[j % n] for j in (i - 1, i + 1) if j % n != i))

    def _next_trial(self) -> Way:
        """The neighbour of the preferred way to try next: on in the direction of the last turn, else the one tried
        fewest times, the cheaper-looking first (a way measured `rare_above` or dearer is tried four times less
        often)."""
        if self._toward is not None:
            return self._toward
        return min(
            self._neighbours(self.preferred) or [self.preferred],
            key=lambda way: (self._ratio(way) >= self.rare_above, self._tried[way]),
        )

    def _ratio(self, way: Way) -> float:
        """How many times what a step run `way` costs a step run the preferred way costs (0 before both have run)."""
        mine, theirs = self.cost(way), self.cost(self.preferred)
        return mine / theirs if mine is not None and theirs else 0.0

    def record(self, way: Way, step_seconds: float, work: float) -> None:
        if work <= 0:  # (a step that did nothing, its requests failed, tells nothing of its way's cost)
            return
        self.recent[way].append((step_seconds, work))
        if self._unjudged and way == self._trial:
            self._unjudged -= 1
            if self._unjudged:
                return
        mine = self.cost(self.preferred)
        costs = [(c, w) for w in self.ways if w != self.preferred and (c := self.cost(w)) is not None]
        if mine is None or not costs:
            return
        cheapest, way = min(costs, key=lambda cw: cw[0])
        if cheapest < mine * (1 - self.margin):
            before, self.preferred, self._spacing = self.preferred, way, 1
            # On along the order, not across the ring's seam: from the last way back to the first is a trial's.
            i, j = self.ways.index(before), self.ways.index(way)
            onward = 2 * j - i if abs(j - i) == 1 else -1
            self._toward = self.ways[onward] if 0 <= onward < len(self.ways) else None
            if self._toward is not None:
                self._first_trial_after = self._quick_trial_after
