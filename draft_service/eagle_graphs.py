"""CUDA graphs of the EAGLE head's k greedy draft steps (`EagleProposer._chain`), keyed by (padded batch, k, keys)."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
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


class ChainGraphs:
    """The head's draft chains as CUDA graphs in one memory pool, keyed by (padded batch, k, key bucket): rows padded
    with `scratch`, a slot no sequence holds, to `padded_batch`; the keys read rounded up by `key_bucket`. The rows'
    (slot, kv_len, cached) are copied into a static buffer per padded batch before a replay; the drafts copied out.
    The graphs point at the cache's tensors: when `HeadCache.reserve` replaces them (its capacity doubles) they are
    dropped and captured again as needed. `replay=False`: the same padded body run eagerly (what the CPU tests
    hold equal to the eager chain)."""

    def __init__(
        self, head: EagleHead, cache: HeadCache, outputs: torch.Tensor, scratch: int, replay: bool = True
    ) -> None:
        self.head, self.cache, self.outputs, self.scratch, self.replay = head, cache, outputs, scratch, replay
        self.device = outputs.device
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.metas: dict[int, torch.Tensor] = {}  # padded batch -> its static rows
        # The cache's keys the graphs write and read (weakly: a replaced tensor is freed, not kept for the check)
        self.keys_of_graphs: weakref.ref[torch.Tensor] | None = None
        if replay:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(self.device)
        self.last_key: tuple[int, int, int] | None = None  # (for tests: what the last chain ran)

    def drafts(self, rows: Sequence[ChainRow], k: int) -> torch.Tensor:
        """k greedy drafts [B, k] of `rows`, as `EagleProposer._chain`'s."""
        batch, padded = len(rows), padded_batch(len(rows))
        meta = [[r.slot, r.kv_len, r.cached] for r in rows] + [[self.scratch, 0, 0]] * (padded - batch)
        length = key_bucket(max(r.cached for r in rows) + k - 1, self.cache.limit)
        self.cache.reserve(length)
        self.last_key = key = (padded, k, length)
        host = torch.tensor(meta)
        if not self.replay:
            return greedy_chain(self.head, self.cache, self.outputs, host.to(self.device), k, [length] * k)[:batch]
        with torch.cuda.device(self.device):
            graph, drafts = self._graph(key)
            self.metas[padded].copy_(host, non_blocking=True)
            graph.replay()
            return drafts[:batch].clone()  # (the pool's: the next replay of any graph may overwrite it)

    def precapture(self, k: int, max_batch: int) -> int:
        """The graphs of every batch bucket up to `max_batch`, at every key bucket the cache holds now."""
        buckets = [b for b in BATCH_BUCKETS if b < padded_batch(max_batch)] + [padded_batch(max_batch)]
        needs, bucket = [k], 2 * MIN_KEY_BUCKET  # (the shortest rows' bucket, then each the capacity holds)
        while bucket <= self.cache.capacity:
            needs, bucket = needs + [bucket], 2 * bucket
        lengths = sorted({key_bucket(n, self.cache.limit) for n in needs})
        self.cache.reserve(lengths[-1])
        with torch.cuda.device(self.device):
            before = len(self.graphs)
            for padded in buckets:
                for length in lengths:
                    self._graph((padded, k, length))
            return len(self.graphs) - before

    def _graph(self, key: tuple[int, int, int]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
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
            log.info("captured a CUDA graph of the EAGLE head's chain %s in %.2f s", key, time.perf_counter() - start)
        return self.graphs[key]

    def _capture(self, padded: int, k: int, length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warmed up on a side stream, then captured; on scratch rows only (the warm-up writes no sequence's keys)."""
        if padded not in self.metas:
            self.metas[padded] = torch.zeros(padded, 3, dtype=torch.long, device=self.device)
        meta = self.metas[padded]
        meta.copy_(torch.tensor([[self.scratch, 0, 0]] * padded))

        def body() -> torch.Tensor:
            return greedy_chain(self.head, self.cache, self.outputs, meta, k, [length] * k)

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
