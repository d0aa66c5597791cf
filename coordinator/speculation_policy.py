"""Decides per step how many tokens the coordinator drafts (speculative decoding), if any: 0, the target alone."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from coordinator.measured_choice import MeasuredChoice

log = logging.getLogger(__name__)

SPECULATION_CHOICES = ("auto", "always")
# Changing ways costs the draft a catch-up forward (a few ms to tens of ms at 64 sequences), and trials of the way not
# in use cost a few percent of the steps: near parity, switching loses (a 1B-shaped draft measured 4% dearer
# per token than the target alone at 64 sequences, and trials and catch-ups cost the load 7%).
SWITCH_MARGIN = 0.1
# A way that measured no SWITCH_MARGIN cheaper is tried 4x less often (every 128 steps), since a trial could not have
# it chosen unless costs move: trials every 32 steps cost 4.8%, each ending in a 20-45 ms catch-up. Each
# trial that changes nothing doubles the steps to the next, up to BACKOFF times that (512 steps: seconds at 64
# sequences on an H200, the longest a change of acceptance goes unnoticed).
BACKOFF = 4
# A new size class starts from the way the next class above or below prefers, if measured. From EARLY_TRIAL_SIZE
# sequences, where drafts are most often in question on a shared GPU, it tries the other way after FIRST_TRIAL_AFTER
# steps, not PROBE_EVERY: at acceptance 0.3 a load of 64 drafted its first 32 steps where the target alone was 1.6x
# cheaper per token. Smaller batches wait the usual PROBE_EVERY, so that short requests there pay for no
# trial.
FIRST_TRIAL_AFTER = 8
EARLY_TRIAL_SIZE = 32


class SpeculationPolicy:
    """How many tokens a step drafts: one of `draft_lengths` (the longest first), or none (the target decodes
    alone).

    Drafting pays when the drafts a verify accepts outweigh the draft's time and the verify's extra positions. At
    a large batch on a GPU that target and draft share it may not: on one H200 at 64 sequences a compiled 1B-shaped
    draft served 0.915x the tokens of the target alone, a 68M-shaped one 1.11x.

    Both ways cost their recent steps' seconds over the tokens they emitted for each sequence decoding, summed
    (`MeasuredChoice(pooled=True)`: so the batch's acceptance decides with the step times), kept per batch size
    (`size_class`: the sequences decoding, up to a power of two or 1.5 times one), since a step's time grows with
    its batch, differently for a verify of k+1 positions a row and a step of one. Per sequence rather than per
    token, since a size class spans sizes up to 1.5x apart, and a step's time grows much less than its batch: per
    token, a load draining from 64 sequences to 33 had each way's cost rise by up to 2x within one class, and
    compared one way's recent steps with the other's older ones.

    A size class starts from the way a measured class next to it prefers (else drafting), and tries the other
    way after `FIRST_TRIAL_AFTER` steps from `EARLY_TRIAL_SIZE` sequences, then as `MeasuredChoice` says (no eager
    trials: a load of short requests would spend a third of its first steps on them). Rows that a trial of the
    target alone left behind catch up at their next proposal, in one forward on the draft (`Proposer._catch_up`).

    With several draft lengths the ways lie on a ring, the longest first and none last (`MeasuredChoice`): from
    the longest, the first trial is of the target alone, as with one length, and a preference walks on along the
    lengths soon after each turn between two of them, but not from none on to drafting (that trial costs the draft
    its catch-up: it waits for the usual spacing). Where the verify's extra positions cost more than their accepted
    tokens save (a large batch, a verify bound by compute, middling acceptance), a shorter draft can beat both the
    longest and none."""

    def __init__(self, mode: str = "auto", draft_lengths: Sequence[int] = (1,)) -> None:
        """`draft_lengths`: the tokens a drafting step may draft (default: one way to draft, 1, against none)."""
        if mode not in SPECULATION_CHOICES:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION_CHOICES)}")
        self.mode = mode
        self.ways = (*sorted({n for n in draft_lengths if n > 0}, reverse=True), 0)
        self._by_size: dict[int, MeasuredChoice[int]] = {}
        self._announced: dict[int, int] = {}  # each size's preference when `turned` last looked (or its start)
        self._size = 1
        self.current = self.at(1)  # the last size asked for

    def at(self, batch_size: int) -> MeasuredChoice[int]:
        """The choice for steps that decode `batch_size` sequences (`choose`: the tokens to draft, then
        `record(tokens drafted, step seconds, tokens emitted / batch_size)`)."""
        self._size = size = size_class(batch_size)
        choice = self._by_size.get(size)
        if choice is None:
            preferred = self._nearest_measured_preference(size)
            self._announced[size] = preferred  # (that size's turn was logged)
            choice = self._by_size[size] = MeasuredChoice(
                None if self.mode == "auto" else self.ways[0],
                eager_trials=False,
                margin=SWITCH_MARGIN,
                rare_above=1 - SWITCH_MARGIN,
                preferred=preferred,
                first_trial_after=FIRST_TRIAL_AFTER if size >= EARLY_TRIAL_SIZE else None,
                backoff=BACKOFF,
                fresh_trials=True,
                pooled=True,
                ways=self.ways,
            )
        self.current = choice
        return choice

    def _nearest_measured_preference(self, size: int) -> int:
        """The preference of the size class next above or below that measured two ways or more (the larger if both
        did), as drafting (the longest draft) or not; the longest draft if neither did. Sizes further apart tell
        little: a warm-up's two requests measure the target alone cheaper where 64 sequences draft. A
        neighbour's shorter length is not taken over: those differ by less and are measured in fewer steps (a load
        drained at the length its warm-up had settled on, on a noisy CPU)."""
        below = size - 1
        while below > 0 and size_class(below) == size:
            below -= 1
        for near in (size_class(size + 1), below and size_class(below)):
            choice = self._by_size.get(near)
            if choice is not None and choice.measured() >= 2:
                return self.ways[0] if choice.preferred else 0
        return self.ways[0]

    def choose(self, sequences: int) -> int:
        """The draft length for this step (at the size `at` was last given, `sequences` running; 0: the target
        alone), logged when its preference turns."""
        policy = self.current
        k = policy.choose()
        before = self.turned()
        if before is not None:
            now = policy.preferred
            costs = {
                way: f"{1e3 * c:.2f} ms" if (c := policy.cost(way)) is not None else "(not measured)"
                for way in (now, before)
            }
            log.info(
                "%s at batches near %d: a token for each sequence every %s, against %s %s",
                _describe(now, before),
                sequences,
                costs[now],
                costs[before],
                _way(before),
            )
        return k

    def turned(self) -> int | None:
        """The current size's preference before, if it has turned since this was last asked (for the log)."""
        preferred = self.current.preferred
        before, self._announced[self._size] = self._announced[self._size], preferred
        return None if preferred == before else before


def draft_lengths(longest: int, shortest: int) -> tuple[int, ...]:
    """The draft lengths `--speculation auto` chooses among: `longest`, then halved while at least `shortest` (4, 2,
    1; 6, 3, 1), each with CUDA graphs of its own on the workers."""
    lengths = [longest]
    while lengths[-1] // 2 >= max(shortest, 1):
        lengths.append(lengths[-1] // 2)
    return tuple(lengths)


def size_class(sequences: int) -> int:
    """The least of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5 times them) that is `sequences` or more."""
    power = 1 << max(sequences - 1, 0).bit_length()
    return power * 3 // 4 if power >= 4 and sequences <= power * 3 // 4 else power


def _way(k: int) -> str:
    return f"drafting {_tokens(k)} a step" if k else "with the target alone"


def _tokens(k: int) -> str:
    return f"{k} token{'s' if k > 1 else ''}"


def _describe(now: int, before: int) -> str:
    """What a turn of the speculation policy from `before` to `now` tokens drafted means, for its log line."""
    if not now:
        return "drafts do not pay, decoding with the target alone"
    if not before:
        return f"drafting again, {_tokens(now)} a step,"
    return f"{'shorter' if now < before else 'longer'} drafts pay, drafting {_tokens(now)} a step,"
