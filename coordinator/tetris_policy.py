"""How many extra drafts a TETRIS step proposes (design section 14): a fixed count, or the most the draft hides."""

from __future__ import annotations

AUTO_CHOICES = (0, 2, 4)  # auto's counts: each a proposal and verify length the workers precapture
SMOOTHING = 0.2  # weight of a new measurement in the running averages


def parse_extra_proposals(text: str) -> int | None:
    """--tetris-extra-proposals: a count >= 0, or auto (None)."""
    if text == "auto":
        return None
    try:
        extra = int(text)
    except ValueError:
        extra = -1
    if extra < 0:
        raise ValueError(f"--tetris-extra-proposals {text!r}: give a count of 0 or more, or auto")
    return extra


def hidden_extra(draft_s_per_token: float, verify_s: float, k: int, choices: tuple[int, ...]) -> int:
    """The most extra drafts whose proposal of k + e tokens still fits in the verify it hides behind (the draft's
    step costs about one forward a token); the fewest of `choices` when none fits."""
    fitting = [e for e in choices if draft_s_per_token * (k + e) <= verify_s]
    return max(fitting) if fitting else min(choices)


class ExtraProposals:
    """The extra drafts of each TETRIS step: fixed, or under auto the most that `hidden_extra` finds hidden from the
    running averages of the draft's seconds per drafted token and the verify's seconds (the workers' reported
    compute time, `record_propose` and `record_verify`); the largest of AUTO_CHOICES until both are measured. Where
    no verify hides the proposal (sd, or psd run as one batch on a GPU both workers share), auto takes none: each
    extra draft then adds its time to the step (one H100: E=2 0.83x plain psd where acceptance does not vary)."""

    def __init__(self, setting: str) -> None:
        self.fixed = parse_extra_proposals(setting)
        self.choices = AUTO_CHOICES if self.fixed is None else (self.fixed,)
        self.draft_s_per_token: float | None = None
        self.verify_s: float | None = None

    def record_propose(self, seconds: float, tokens: int) -> None:
        if tokens > 0 and seconds > 0:
            self.draft_s_per_token = _averaged(self.draft_s_per_token, seconds / tokens)

    def record_verify(self, seconds: float) -> None:
        if seconds > 0:
            self.verify_s = _averaged(self.verify_s, seconds)

    def choose(self, k: int, hidden: bool = True) -> int:
        """Extra drafts for a step of k; `hidden`: whether the proposal runs beside the other batch's verify."""
        if self.fixed is not None:
            return self.fixed
        if not hidden:
            return min(self.choices)
        if self.draft_s_per_token is None or self.verify_s is None:
            return max(self.choices)
        return hidden_extra(self.draft_s_per_token, self.verify_s, k, self.choices)


def checked_budget(verify_token_budget: int) -> int:
    """`--verify-token-budget`, refused below 0 (0: k a row)."""
    if verify_token_budget < 0:
        raise ValueError(f"--verify-token-budget {verify_token_budget}: give 0 (k a row) or more")
    return verify_token_budget


def prepared_lengths(draft_lengths: tuple[int, ...], extra: ExtraProposals | None) -> tuple[int, ...]:
    """The lengths proposals and verifies may take, each precaptured: with TETRIS each draft length plus extras, and
    alone (a verify whose selected drafts fit it is cut to it: `selected_verify.cut_to_width`)."""
    extras = {0, *extra.choices} if extra is not None else {0}
    return tuple(sorted({n + e for n in draft_lengths for e in extras}, reverse=True))


def _averaged(average: float | None, value: float) -> float:
    return value if average is None else (1 - SMOOTHING) * average + SMOOTHING * value
