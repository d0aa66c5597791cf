"""Step calls' deadlines from their measured times: a hung worker is noticed in steps, not in its full timeout."""

from __future__ import annotations

import collections
import statistics


class CallDeadline:
    """The deadline of a worker's next step call: `factor` times the median of its last `window` calls, at least
    `floor` seconds, at most `ceiling` (the configured timeout; None: none). Until `warm` calls were measured (the
    first steps capture CUDA graphs and warm caches), the ceiling."""

    def __init__(self, factor: float, floor: float, ceiling: float | None, window: int = 64, warm: int = 8) -> None:
        self.factor, self.floor, self.ceiling, self.warm = factor, floor, ceiling, warm
        self._times: collections.deque[float] = collections.deque(maxlen=window)
        self._median: float | None = None

    def record(self, seconds: float) -> None:
        """A call that answered in `seconds`."""
        self._times.append(seconds)
        if len(self._times) >= self.warm:
            self._median = statistics.median(self._times)

    def timeout(self) -> float | None:
        if self._median is None:
            return self.ceiling
        deadline = max(self.factor * self._median, self.floor)
        return deadline if self.ceiling is None else min(deadline, self.ceiling)
