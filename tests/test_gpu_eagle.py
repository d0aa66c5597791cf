"""On a GPU, the EAGLE head's draft chains replayed from CUDA graphs draft what they draft eagerly, bit for bit.

A random EAGLE-3 head on cuda:0 in float32, three drafters fed the same calls: graphed, the same padded chains run
eagerly, and eager (--eager). Rows join and leave (batches of 1, 3, 8 and 5), and a long prompt doubles the head's
cache after the graphs were captured, which drops them for new ones (into a new memory pool: capturing into the
dropped graphs' freed one asserts in CUDA's caching allocator). Skipped without CUDA; on the GPU machine
`python3 -m pytest tests/test_gpu_eagle.py`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from draft_service.eagle import EagleProposer
from draft_service.eagle_graphs import ChainGraphs
from draft_service.eagle_head import EagleHead, HeadSpec

HIDDEN, VOCAB, DRAFT_VOCAB, K = 64, 512, 128, 4
# Each step's rows: 0 alone, then 1 and 2 join, then 3..7 (7's prompt of 300 grows the cache past 256 keys),
# then 0, 1 and 2 leave and 8 joins.
PROMPT_LENGTHS = {0: 20, 1: 60, 2: 150, 3: 9, 4: 33, 5: 200, 6: 90, 7: 300, 8: 17}
STEPS = [[0], [0], [0, 1, 2], [2, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0], [3, 4, 5, 6, 7]]
STEPS += [[8, 5, 6], [8, 5, 6], [8]]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _head() -> EagleHead:
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        num_hidden_layers=1,
    )
    config.draft_vocab_size = DRAFT_VOCAB  # (an EAGLE-3 head's own vocabulary, mapped to the target's by d2t)
    torch.manual_seed(0)
    head = EagleHead(config, eagle3=True, fc_inputs=3 * HIDDEN)
    head.embed = torch.nn.Embedding(VOCAB, HIDDEN)
    ids = torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values
    head.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
    return head.to("cuda:0", torch.float32).eval().requires_grad_(False)


def _events() -> list[tuple[Any, ...]]:
    """The calls of `STEPS`: a row's prompt and its states when it joins, its release when it leaves, proposals
    after random verdicts, then the states of the positions each verify kept."""
    g = torch.Generator().manual_seed(3)
    events: list[tuple[Any, ...]] = []
    held: list[int] = []
    accepted: dict[int, int] = {}
    for rows in STEPS:
        if gone := [s for s in held if s not in rows]:
            events.append(("release", gone))
        for s in (s for s in rows if s not in held):
            n = PROMPT_LENGTHS[s]
            events.append(("join", s, torch.randint(1, VOCAB, (n,), generator=g).tolist(), torch.randn(n, 3 * HIDDEN)))
            accepted[s] = 0
        held = list(rows)
        tokens = torch.randint(1, VOCAB, (len(rows),), generator=g)
        events.append(("propose", rows, torch.tensor([accepted[s] for s in rows]), tokens))
        for s in rows:
            accepted[s] = int(torch.randint(0, K + 1, (1,), generator=g))
        events.append(("states", rows, [torch.randn(accepted[s] + 1, 3 * HIDDEN, generator=g) for s in rows]))
    return events


def _play(proposer: EagleProposer, events: list[tuple[Any, ...]]) -> list[list[list[int]]]:
    drafts = []
    for event in events:
        if event[0] == "release":
            proposer.release(event[1])
        elif event[0] == "join":
            proposer.add_hidden([event[1]], [event[3]], admitting=True)
            proposer.prefill([event[1]], [event[2]], [])
        elif event[0] == "propose":
            drafts.append(proposer.propose(event[1], event[2], event[3], K).draft_ids.tolist())
        else:
            proposer.add_hidden(event[1], event[2])
    return drafts


@needs_cuda
def test_graphed_chains_draft_as_eager_ones_on_cuda() -> None:
    head, spec, events = _head(), HeadSpec(True, (1, 2, 3)), _events()
    graphed = EagleProposer(head, spec, num_slots=8)
    assert graphed.graphs is not None and graphed.precapture(K, 8) == 4 * 2  # batches 1-8, keys 128 and 256
    before = graphed.cache.keys
    got = _play(graphed, events)
    assert graphed.cache.capacity > 256 and graphed.cache.keys is not before  # it grew after the capture
    assert graphed.graphs.keys_of_graphs is not None and graphed.graphs.keys_of_graphs() is graphed.cache.keys
    assert any(length > 256 for _, _, length, _ in graphed.graphs.graphs), "no graph captured after the growth"
    padded = EagleProposer(head, spec, num_slots=8)
    padded.graphs = ChainGraphs(head, padded.cache, padded.outputs, 8, replay=False)
    assert _play(padded, events) == got  # the same shapes, eagerly
    eager = EagleProposer(head, spec, num_slots=8, cuda_graphs=False)
    assert eager.graphs is None and eager.precapture(K, 8) == 0
    assert _play(eager, events) == got
    assert len({tuple(d) for step in got for d in step}) > 5  # real drafts, not one row repeated
