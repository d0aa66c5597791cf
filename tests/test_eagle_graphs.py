"""The EAGLE head's graphed draft chain, run eagerly on the CPU: rows padded to their batch bucket on the scratch
slot and keys read to their bucket draft exactly what today's eager chain drafts (float32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_eagle_head import HIDDEN, _play, _scenario, make_target, save_head

from draft_service.eagle import EagleProposer
from draft_service.eagle_graphs import ChainGraphs, KnownRows, key_bucket
from draft_service.eagle_head import load_eagle_head


class PaddedChains(ChainGraphs):
    """The padded, bucketed body run eagerly, each chain's shapes and its rows noted."""

    def __init__(self, proposer: EagleProposer) -> None:
        super().__init__(proposer.head, proposer.cache, proposer.outputs, proposer.num_slots, replay=False)
        # (rows, (padded, k, keys, width), keys needed)
        self.ran: list[tuple[int, tuple[int, int, int, int], int]] = []

    def drafts(self, rows: Any, k: int, known: KnownRows | None = None) -> torch.Tensor:
        counts = known.counts if known is not None else [0] * len(rows)
        needed = max(r.cached + count for r, count in zip(rows, counts)) + k
        out = super().drafts(rows, k, known)
        assert self.last_key is not None
        self.ran.append((len(rows), self.last_key, needed))
        return out


class DeferringProposer(EagleProposer):
    """Proposes as the draft service does (`defer_upkeep`), running the upkeep left as the service would after its
    reply."""

    upkeeps = 0

    def propose(self, *args: Any, **kwargs: Any) -> Any:
        proposal = super().propose(*args, **{**kwargs, "defer_upkeep": True})
        if proposal.upkeep is not None:
            self.upkeeps += 1
            proposal.upkeep()
        return proposal


def test_key_buckets() -> None:
    assert [key_bucket(n, None) for n in (1, 128, 129, 300, 1025)] == [128, 128, 256, 512, 2048]
    assert [key_bucket(n, 200) for n in (1, 150, 199, 230)] == [128, 200, 200, 230]  # (never past what is needed)


@pytest.mark.parametrize("eagle3", [True, False])
def test_padded_bucketed_chain_drafts_as_the_eager_one(tmp_path: Path, eagle3: bool) -> None:
    """Through a draft service's calls (rows of several lengths joining and leaving, batches of 3 to 5, then each
    row alone), k of 1 and 4, the padded chains draft what the eager ones draft, token for token; the cache grows
    under them (a small first capacity)."""
    target_dir, _ = make_target(tmp_path, "llama", 6)
    fc_inputs = 3 * HIDDEN if eagle3 else 2 * HIDDEN
    head, spec = load_eagle_head(str(save_head(tmp_path, eagle3, fc_inputs, None)), str(target_dir), eagle3)
    for k in (1, 4):
        events = _scenario(fc_inputs if eagle3 else HIDDEN, k=k, rounds=6)
        eager = _play(EagleProposer(head, spec, num_slots=6, max_len=8), events)
        padded = EagleProposer(head, spec, num_slots=6, max_len=8)
        padded.graphs = chains = PaddedChains(padded)
        assert _play(padded, events) == eager
        deferring = DeferringProposer(head, spec, num_slots=6, max_len=8)
        deferring.graphs = PaddedChains(deferring)
        assert _play(deferring, events) == eager and deferring.upkeeps > 0  # drafts read to the host after replying
        for seq_id in (10, 12):  # each alone: a batch of one (a 5-token and a 40-token prompt)
            alone = EagleProposer(head, spec, num_slots=1)
            alone.graphs = PaddedChains(alone)
            assert _play(alone, events, only=seq_id)[seq_id] == eager[seq_id]
        sizes = {rows for rows, _, _ in chains.ran}
        assert {3, 5} <= sizes, sizes  # padded to 4 and 8 on the scratch slot
        assert all(padded_rows > rows or rows in (1, 2, 4) for rows, (padded_rows, _, _, _), _ in chains.ran)
        assert all(keys >= needed for _, (_, _, keys, _), needed in chains.ran)
        assert any(keys > needed for _, (_, _, keys, _), needed in chains.ran)  # keys past every row's limit read
        widths = {width for _, (_, _, _, width), _ in chains.ran}
        assert widths == {0, k + 1}, widths  # known positions graphed with the drafts, and the drafts alone
        assert padded.cache.capacity > 8 and padded.cache.keys.shape[0] == 7  # grown; the scratch slot beside
