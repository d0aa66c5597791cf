"""CUDA graphs of the EAGLE head's proposal: each row's known positions, then its k greedy draft steps
(`EagleProposer._chain`), keyed by (padded batch, k, keys, known positions a row)."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from draft_service.eagle_head import EagleHead, HeadCache, SlotRun
from minedraft.engine.cuda_graphs import BATCH_BUCKETS, capturing, padded_batch

log = logging.getLogger(__name__)

# The fewest keys a chain reads: shorter rows read this many, their keys past each row's limit masked.
MIN_KEY_BUCKET = 128


class ChainRow(Protocol):
    """What a chain reads of a sequence (`HeadSequence`)."""

    slot: int
    kv_len: int
    cached: int


@dataclass
class KnownRows:
    """Each chain row's positions known since its last proposal (the target's features and the token after each),
    run before its drafts: `counts` a row (0 to the width), their `tokens` a row, `features` [sum of counts, H]."""

    counts: list[int]
    tokens: list[list[int]]
    features: torch.Tensor | None


def _columns(width: int) -> int:
    """A chain's static rows: slot, kv_len, cached; with known positions also their count and `width` tokens."""
    return 3 if width == 0 else 4 + width


def key_bucket(needed: int, limit: int | None) -> int:
    """The keys a chain reaching `needed` keys reads: the next power of two (a few buckets, so a few captures, as rows
    lengthen; at most twice the keys; the same steps as the cache's doubling), at most the cache's `limit`."""
    bucket = max(MIN_KEY_BUCKET, 1 << max(needed - 1, 0).bit_length())
    return bucket if limit is None else max(needed, min(bucket, limit))


def greedy_chain(
    head: EagleHead, cache: HeadCache, outputs: torch.Tensor, meta: torch.Tensor, k: int, lengths: Sequence[int]
) -> torch.Tensor:
    """k greedy drafts [P, k] of rows `meta` [P, 3] (slot, kv_len, cached; padding rows on a scratch slot), each
    from its slot's row of `outputs`, then run on the head's own hidden state, step i over `lengths[i]` keys (the
    mask hides those past each row's limit): eagerly the keys each step reaches, in a graph one static length."""
    slots, positions, cached = meta.unbind(1)
    out = outputs[slots]
    drafts = [head.greedy(out)]
    for step in range(k - 1):
        run = SlotRun(slots, (positions + step)[:, None], (cached + step)[:, None], lengths[step])
        out = head.forward_slots(drafts[-1][:, None], out[:, None], cache, run)[:, 0]
        drafts.append(head.greedy(out))
    return torch.stack(drafts, dim=1)


def known_then_chain(
    head: EagleHead,
    cache: HeadCache,
    outputs: torch.Tensor,
    meta: torch.Tensor,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    k: int,
    length: int,
) -> torch.Tensor:
    """Each row's known positions, then `greedy_chain`'s k drafts from the last one's output. `meta` [P, 4]: slot,
    kv_len, cached and the count of real positions among the row's `tokens` [P, W] and `hidden` [P, W, H]; the
    padding positions' keys land past the row's real ones, where its drafts' keys overwrite them before anything
    reads them. A row of no known position drafts from its slot's last output, as it stands."""
    slots, positions, cached, counts = meta.unbind(1)
    steps = torch.arange(tokens.shape[1], device=tokens.device)
    run = SlotRun(slots, positions[:, None] + steps, cached[:, None] + steps, length)
    out = head.forward_slots(tokens, hidden, cache, run)
    last = out[torch.arange(len(slots), device=out.device), (counts - 1).clamp(min=0)]
    outputs[slots] = torch.where(counts[:, None] > 0, last, outputs[slots])
    chain = torch.stack([slots, positions + counts, cached + counts], dim=1)
    return greedy_chain(head, cache, outputs, chain, k, [length] * k)


class ChainGraphs:
    """The head's proposals as CUDA graphs in one memory pool, keyed by (padded batch, k, key bucket, width): rows
    padded with `scratch`, a slot no sequence holds, to `padded_batch`; the keys read rounded up by `key_bucket`;
    width k + 1 when each row's known positions run first (`KnownRows`, padded to it), 0 for the drafts alone. The
    rows' inputs are copied into a static buffer per (padded batch, width) before a replay; the drafts copied out.
    The graphs point at the cache's tensors: when `HeadCache.reserve` replaces them (its capacity doubles) they are
    dropped and captured again as needed. `replay=False`: the same padded body run eagerly (what the CPU tests
    hold equal to the eager proposal)."""

    def __init__(
        self, head: EagleHead, cache: HeadCache, outputs: torch.Tensor, scratch: int, replay: bool = True
    ) -> None:
        self.head, self.cache, self.outputs, self.scratch, self.replay = head, cache, outputs, scratch, replay
        self.device = outputs.device
        self.graphs: dict[tuple[int, int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # (padded batch, width) -> its static rows [P, `_columns(width)`] (slot, kv_len, cached[, count, tokens]) and,
        # with a width, the known positions' features [P * width, H]
        self.inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        # The cache's keys the graphs write and read (weakly: a replaced tensor is freed, not kept for the check)
        self.keys_of_graphs: weakref.ref[torch.Tensor] | None = None
        if replay:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(self.device)
        self.last_key: tuple[int, int, int, int] | None = None  # (for tests: what the last proposal ran)

    def drafts(self, rows: Sequence[ChainRow], k: int, known: KnownRows | None = None) -> torch.Tensor:
        """k greedy drafts [B, k] of `rows`, as `EagleProposer._chain`'s; `known`: each row's known positions run
        first (at most k + 1 a row; the rows' kv_len and cached are those before them)."""
        batch, padded = len(rows), padded_batch(len(rows))
        width = 0 if known is None else k + 1
        table = [[r.slot, r.kv_len, r.cached] for r in rows]
        if known is not None:  # (each row's count, then its tokens padded to the width)
            for row, count, tokens in zip(table, known.counts, known.tokens, strict=True):
                row += [count, *tokens] + [0] * (width - len(tokens))
        table += [[self.scratch] + [0] * (_columns(width) - 1)] * (padded - batch)
        host = torch.tensor(table, dtype=torch.long)
        length = key_bucket(max(r.cached for r in rows) + k - 1 + width, self.cache.limit)
        self.cache.reserve(length)
        self.last_key = key = (padded, k, length, width)
        if not self.replay:
            meta, hidden = self._static_inputs(padded, width)
            self._fill(meta, hidden, host, known)
            return self._body(meta, hidden, k, length)[:batch]
        with torch.cuda.device(self.device):
            graph, drafts = self._graph(key)
            meta, hidden = self.inputs[(padded, width)]
            self._fill(meta, hidden, host, known)
            graph.replay()
            return drafts[:batch].clone()  # (the pool's: the next replay of any graph may overwrite it)

    def _fill(
        self, meta: torch.Tensor, hidden: torch.Tensor | None, host: torch.Tensor, known: KnownRows | None
    ) -> None:
        """The static inputs of a replay: the rows, and each row's known features at its first positions."""
        meta.copy_(host, non_blocking=True)
        if hidden is None or known is None:
            return
        hidden.zero_()
        if known.features is not None and len(known.features):
            width = meta.shape[1] - 4
            at = [b * width + j for b, count in enumerate(known.counts) for j in range(count)]
            hidden.index_copy_(0, torch.tensor(at, device=self.device), known.features.to(hidden.dtype))

    def precapture(self, k: int, max_batch: int) -> int:
        """The graphs of every batch bucket up to `max_batch` (each row's known positions first, as a proposal in
        steady state runs), at every key bucket the cache holds now."""
        buckets = [b for b in BATCH_BUCKETS if b < padded_batch(max_batch)] + [padded_batch(max_batch)]
        width = k + 1
        needs, bucket = [k + width], 2 * MIN_KEY_BUCKET  # (the shortest rows' bucket, then each the capacity holds)
        while bucket <= self.cache.capacity:
            needs, bucket = needs + [bucket], 2 * bucket
        lengths = sorted({key_bucket(n, self.cache.limit) for n in needs})
        self.cache.reserve(lengths[-1])
        with torch.cuda.device(self.device):
            before = len(self.graphs)
            for padded in buckets:
                for length in lengths:
                    self._graph((padded, k, length, width))
            return len(self.graphs) - before

    def _graph(self, key: tuple[int, int, int, int]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of `key` and its drafts' buffer, captured first where missing (every cached graph dropped first
        if the cache's tensors were replaced since they were captured)."""
        if self.keys_of_graphs is None or self.keys_of_graphs() is not self.cache.keys:
            if self.graphs:
                log.info(
                    "the EAGLE head's cache grew to %d keys: %d graphs dropped", self.cache.capacity, len(self.graphs)
                )
            self.graphs.clear()
            if self.replay:  # (a pool all of whose graphs are gone is freed: capturing into it again asserts)
                self.pool = torch.cuda.graph_pool_handle()
            self.keys_of_graphs = weakref.ref(self.cache.keys)
        if key not in self.graphs:
            start = time.perf_counter()
            self.graphs[key] = self._capture(*key)
            took = time.perf_counter() - start
            log.info("captured a CUDA graph of the EAGLE head's proposal %s in %.2f s", key, took)
        return self.graphs[key]

    def _static_inputs(self, padded: int, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if (padded, width) not in self.inputs:
            meta = torch.zeros(padded, _columns(width), dtype=torch.long, device=self.device)
            features = self.head.fc.out_features
            hidden = self.outputs.new_zeros(padded * width, features) if width else None
            self.inputs[(padded, width)] = (meta, hidden)
        return self.inputs[(padded, width)]

    def _body(self, meta: torch.Tensor, hidden: torch.Tensor | None, k: int, length: int) -> torch.Tensor:
        if hidden is None:
            return greedy_chain(self.head, self.cache, self.outputs, meta, k, [length] * k)
        width = meta.shape[1] - 4
        rows = hidden.view(meta.shape[0], width, -1)
        return known_then_chain(self.head, self.cache, self.outputs, meta[:, :4], meta[:, 4:], rows, k, length)

    def _capture(self, padded: int, k: int, length: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warmed up on a side stream, then captured; on scratch rows only (the warm-up writes no sequence's keys)."""
        meta, hidden = self._static_inputs(padded, width)
        meta.zero_()
        meta[:, 0] = self.scratch

        def body() -> torch.Tensor:
            return self._body(meta, hidden, k, length)

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capturing(self.device), torch.cuda.stream(self.stream):
            graph.capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                drafts = body()
            finally:
                graph.capture_end()
        return graph, drafts
