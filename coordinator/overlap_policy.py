"""Decides per PSD step whether Verify(X) and Propose(Y) run at once or one after the other."""

from __future__ import annotations

from coordinator.measured_choice import MeasuredChoice

OVERLAP_CHOICES = ("auto", "always", "never")


class OverlapPolicy(MeasuredChoice):
    """Overlap pays on two GPUs; on one shared GPU, time-slicing between two processes can make the concurrent step
    slower than the two calls in sequence. Both ways verify one batch and draft the other per step, so their step
    times per verified sequence compare directly (`record(overlapped, seconds, verified sequences)`)."""

    def __init__(self, mode: str = "auto") -> None:
        if mode not in OVERLAP_CHOICES:
            raise ValueError(f"overlap must be one of {', '.join(OVERLAP_CHOICES)}")
        super().__init__(None if mode == "auto" else mode == "always")

    @property
    def never(self) -> bool:
        """`--overlap never`: PSD's two batches drafted and verified in turn, no proposal beside a verify."""
        return self.fixed is False
