"""In-process continuous batching over a verifier and an optional proposer: offline generation and tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from draft_service.drafter import Drafter
from draft_service.eagle import EagleProposer
from minedraft.engine.hidden_export import exported_layers
from minedraft.engine.sampling import SamplingConfig
from target_service.verifier import RUNNING, StepResult, Verifier


@dataclass
class OfflineRequest:
    prompt: list[int]
    config: SamplingConfig
    arrival_step: int = 0  # the step boundary at which it joins (to test joining mid-flight)


@dataclass
class OfflineResult:
    tokens: list[int] = field(default_factory=list)
    finish: int = RUNNING
    steps: int = 0
    accepted: int = 0


def generate_offline(
    verifier: Verifier,
    proposer: Drafter | None,
    requests: Sequence[OfflineRequest],
    k: int,
    max_batch_size: int,
) -> list[OfflineResult]:
    """Run requests to completion with standard speculative decoding (or AR when `proposer` is None), as one batch
    (batch id 0: its K/V kept in one block of cache rows, as the services keep each of their two batches). An EAGLE
    proposer gets the target's hidden states of each prefill and verify, as the draft service does."""
    eagle = proposer if isinstance(proposer, EagleProposer) else None
    layers = exported_layers(eagle.spec.layers) if eagle is not None else ()
    if eagle is not None:
        verifier.export_hidden(layers)
    results = [OfflineResult() for _ in requests]
    waiting = sorted(range(len(requests)), key=lambda i: requests[i].arrival_step)
    active: list[int] = []
    verdict: dict[int, tuple[int, int]] = {}  # seq -> (accepted, last emitted token) for the next proposal
    step = 0
    while waiting or active:
        room = max_batch_size - len(active)
        joining = [i for i in waiting[:room] if requests[i].arrival_step <= step]  # waiting is sorted by arrival
        if joining:
            waiting = waiting[len(joining) :]
            prompts = [requests[i].prompt for i in joining]
            configs = [requests[i].config for i in joining]
            prefilled = verifier.prefill(joining, prompts, configs)
            first = prefilled.per_row()
            if eagle is not None:
                _hand_states(eagle, joining, prefilled, layers, admitting=True)
            if proposer is not None:
                proposer.prefill(joining, prompts, configs)
            active += _record(results, joining, first, verdict=verdict, verifier=verifier, proposer=proposer)
        if active:
            if proposer is not None:
                accepted = torch.tensor([verdict[i][0] for i in active])
                last = torch.tensor([verdict[i][1] for i in active])
                proposal = proposer.propose(active, accepted, last, k, batch_id=0)
                drafts, probs = proposal.draft_ids, proposal.draft_probs
            else:
                drafts, probs = torch.zeros(len(active), 0, dtype=torch.long), None
            verified = verifier.verify(active, drafts, probs, batch_id=0)
            rows = verified.per_row()
            if eagle is not None:
                _hand_states(eagle, active, verified, layers)
            for i, (_, accepted_count, _) in zip(active, rows):
                results[i].steps += 1
                results[i].accepted += accepted_count
            active = _record(results, active, rows, verdict=verdict, verifier=verifier, proposer=proposer)
        step += 1
    return results


def _hand_states(
    eagle: EagleProposer, seq_ids: list[int], result: StepResult, layers: Sequence[int], admitting: bool = False
) -> None:
    """The hidden states a step kept, to the head in its layers' order (the services' reverse channel, in-process)."""
    rows, counts = result.hidden_rows()
    width = rows.shape[1] // len(layers)
    by_layer = {layer: rows[:, j * width : (j + 1) * width] for j, layer in enumerate(layers)}
    joined = torch.cat([by_layer[layer] for layer in eagle.spec.layers], dim=-1)
    labels = [seq for seq, n in zip(seq_ids, counts, strict=True) for _ in range(n)]
    eagle.add_states(labels, joined, admitting)


def _record(
    results: list[OfflineResult],
    seq_ids: list[int],
    rows: list[tuple[list[int], int, int]],
    *,
    verdict: dict[int, tuple[int, int]],
    verifier: Verifier,
    proposer: Drafter | None,
) -> list[int]:
    """Append emitted tokens; release finished sequences; return those still running."""
    still: list[int] = []
    done: list[int] = []
    for seq, (tokens, accepted, finish) in zip(seq_ids, rows):
        results[seq].tokens += tokens
        results[seq].finish = finish
        verdict[seq] = (accepted, tokens[-1])
        (done if finish != RUNNING else still).append(seq)
    if done:
        verifier.release(done)
        if proposer is not None:
            proposer.release(done)
    return still
