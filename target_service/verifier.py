"""The target side of speculative decoding: prefill, one-pass verification, commit and rollback."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from minedraft.engine.grammar import Grammars, masked_logits
from minedraft.engine.kv_cache import PagedKVCache
from minedraft.engine.model_runner import ModelRunner, StepShape
from minedraft.engine.sampling import (
    SamplingConfig,
    SamplingKind,
    penalized_logits,
    synthetic_row_rates,
    token_logprobs,
)
from minedraft.engine.sequence_table import SequenceTable
from target_service.rejection_sampler import RowParams, SamplerOutput, rejection_sample
from target_service.selected_verify import flat_argmax, selected_drafts, selected_shape, verify_variants

RUNNING, FINISHED_STOP, FINISHED_LENGTH = 0, 1, 2
# The kinds of batch a proposer sends by default: all greedy (ids only); sampled, and filtered, with the draft's
# probabilities.
KINDS = (
    SamplingKind(all_greedy=True, filtered=False),
    SamplingKind(all_greedy=False, filtered=False),
    SamplingKind(all_greedy=False, filtered=True),
)
log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """Per row of a prefill or verify: the tokens it emits and whether the sequence is done, packed as columns
    (emitted, accepted, finish, tokens...) so that the host reads them in one copy."""

    packed: torch.Tensor  # [B, 3 + m]; row b emits its tokens[:emitted]; accepted drafts (0 for prefill and AR);
    # finish is RUNNING, FINISHED_STOP or FINISHED_LENGTH
    on_read: Callable[[list[int]], None] | None = None  # told each row's emitted count once the host has it
    cached_tokens: list[int] | None = None  # a prefill's: the prompt tokens each row found in the prefix cache
    # With log-probabilities asked for: [B, m, 1 + 2N] float32, per token its own, the top N's, their ids (exact in
    # float32 below 2**24), one copy to the host; and per row how many top ones it asked for (None: none)
    logprobs: torch.Tensor | None = None
    top_n: Sequence[int | None] = ()
    # A prefill's, per row that asked (SamplingConfig.prompt_logprobs), else None: each prompt token after the first,
    # its log-probability and its top ones' (id, log-probability)
    prompt_logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None] | None = None
    on_tokens: Callable[[list[list[int]]], None] | None = None  # told each row's emitted tokens (grammar matchers)
    # Exporting hidden states (`Verifier.export_hidden`): [B, m, width] per row's positions, valid up to each
    # prompt's length (a prefill: `hidden_counts`) or each row's emitted count (a verify)
    hidden: torch.Tensor | None = None
    hidden_counts: list[int] | None = None
    # A verify of selected drafts (TETRIS): packed's last column is each row's verified draft count, read by per_row
    selected: bool = False
    verified: list[int] | None = None
    _emitted: list[int] | None = None

    def hidden_rows(self) -> tuple[torch.Tensor, list[int]]:
        """After `per_row`: the exported hidden states of every position a row keeps, the rows one after the other
        [sum(counts), width], and each row's count (a prefill: every prompt position; a verify: the positions of the
        pending token and the accepted drafts, each the one before an emitted token)."""
        assert self.hidden is not None
        counts = self.hidden_counts if self.hidden_counts is not None else self._emitted
        assert counts is not None, "per_row first"
        # One gather: flattened row t of row b sits at b x m + (t - b's first) (a slice a row: ~2.5 us of host each).
        lengths = torch.tensor(counts, dtype=torch.long)
        offsets = torch.arange(len(counts)) * self.hidden.shape[1] - (lengths.cumsum(0) - lengths)
        index = torch.arange(int(lengths.sum())) + offsets.repeat_interleave(lengths)
        return self.hidden.flatten(0, 1).index_select(0, index.to(self.hidden.device)), list(counts)

    def per_row(self) -> list[tuple[list[int], int, int]]:
        """(tokens, accepted, finish) per row, on the host: the one device-to-host copy of a step (a second one,
        `logprobs_per_row`, only where a row asked for logprobs)."""
        rows = self.packed.tolist()
        self._emitted = [n for n, *_ in rows]
        if self.selected:
            self.verified = [row[-1] for row in rows]
        if self.on_read is not None:
            self.on_read(self._emitted)
        per_row = [(row[:n], a, f) for n, a, f, *row in rows]
        if self.on_tokens is not None:
            self.on_tokens([tokens for tokens, _, _ in per_row])
        return per_row

    def logprobs_per_row(self) -> list[list[tuple[float, list[tuple[int, float]]]] | None]:
        """After `per_row`: per row that asked, each emitted token's log-probability and its top ones' (id,
        log-probability), most likely first; None for rows that did not ask (and every row without logprobs)."""
        if self.logprobs is None:
            return [None] * len(self.packed)
        assert self._emitted is not None, "per_row first"
        reported, width = self.logprobs.tolist(), (self.logprobs.shape[-1] - 1) // 2
        rows: list[list[tuple[float, list[tuple[int, float]]]] | None] = []
        for b, (n, top) in enumerate(zip(self._emitted, self.top_n, strict=True)):
            if top is None:
                rows.append(None)
                continue
            tokens = [reported[b][j] for j in range(n)]
            rows.append([(t[0], [(int(t[1 + width + i]), t[1 + i]) for i in range(top)]) for t in tokens])
        return rows


class Acceptance:
    """A target step's decision, inside its graph after the forward: the penalties, `rejection_sample`, the emitted
    tokens' log-probabilities, then the commit (`_commit`: trimmed at stop tokens and the length budget, the rest
    rolled back). Reads and writes the sequence table's tensors, the rows' cache lengths and pending tokens."""

    def __init__(
        self,
        runner: ModelRunner,
        table: SequenceTable,
        pending: torch.Tensor,
        eos: torch.Tensor,
        synthetic_acceptance: float | torch.Tensor | None,
    ) -> None:
        self.runner = runner
        self.table = table
        self.pending = pending  # [rows] each row's last committed token, the next verify's first input
        self.eos = eos
        self.synthetic_acceptance = synthetic_acceptance  # benchmarks only: see rejection_sample
        self.synthetic_by_step = False  # benchmarks only: --synthetic-rate-by step (`synthetic_row_rates`)
        # With compiled layers the acceptance and commit compile too: in a greedy verify's graph they were 55 small
        # kernels (99 with synthetic acceptance), ~0.1 ms of an 8B verify at batch 1. `warm_up` compiles them.
        # Without inductor's coalescing analysis (a tiling heuristic for large kernels, not these small ones): with
        # the argmax an operator of its own (`minedraft.kernels.argmax`) it failed an assertion compiling them (torch
        # 2.11, H200).
        self._accept_and_commit = (
            torch.compile(
                self._accept_and_commit_eagerly, dynamic=True, options={"triton.coalesce_tiling_analysis": False}
            )
            if runner.compiles
            else self._accept_and_commit_eagerly
        )
        self._warmed_up: set[int] = set()  # draft counts (0: prefills) whose acceptance and commit are compiled
        self._warmed_selected: set[int] = set()  # and those whose verifies of selected drafts are

    @torch.inference_mode()
    def warm_up(self, k: int, selected: bool = False) -> None:
        """With compiled layers, compile the acceptance and commit of verifies of k drafts and of prefills and
        target-only steps (none), for every kind of batch, at one row and at several, before serving: afterwards a
        kind missed here runs uncompiled (the runner's stance) rather than stall a step on a compile. `selected`:
        the verifies of TETRIS's selected drafts (per-row lengths) too."""
        lengths_too = selected and k not in self._warmed_selected
        if not self.runner.compiles or ({0, k} <= self._warmed_up and not lengths_too):
            return
        start = time.perf_counter()
        row, vocab, device = self.runner.scratch_row, self.runner.vocab_size, self.runner.device
        for drafts in sorted({0, k}):
            for kind in KINDS:
                for batch in (1, 2):
                    rows = torch.full((batch,), row, device=device)
                    tokens = torch.zeros(batch, drafts + 1, dtype=torch.long, device=device)
                    probs = torch.zeros(batch, drafts, vocab, device=device) if not kind.all_greedy and drafts else None
                    logits = torch.zeros(batch, drafts + 1, vocab, dtype=self.runner.logits_dtype, device=device)
                    variants: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)]
                    if lengths_too and drafts:  # selected: padded, and a ragged greedy one's argmax found before
                        variants.append((torch.full_like(rows, drafts), None))
                        if kind.all_greedy:
                            variants.append((variants[-1][0], torch.zeros_like(tokens)))
                    for lengths, argmax in variants:
                        self.decide(
                            rows,
                            tokens=tokens,
                            num_valid=torch.full_like(rows, drafts + 1),
                            before=torch.zeros_like(rows),
                            logits=logits,
                            draft_probs=probs,
                            drafts=drafts,
                            kind=kind,
                            draft_lengths=lengths,
                            target_argmax=argmax,
                        )
        self.table.generated[row] = 0
        self.runner.cache.lengths[row] = 0
        self._warmed_up.update({0, k})
        if selected:
            self._warmed_selected.add(k)
        log.info("acceptance and commit compiled for k=%d in %.1f s", k, time.perf_counter() - start)

    def decide(
        self,
        rows: torch.Tensor,
        *,
        tokens: torch.Tensor,
        num_valid: torch.Tensor,
        before: torch.Tensor,
        logits: torch.Tensor,
        draft_probs: torch.Tensor | None,
        drafts: int,
        kind: SamplingKind,
        bitmask: torch.Tensor | None = None,
        draft_lengths: torch.Tensor | None = None,
        target_argmax: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Acceptance and commit of a step whose last `drafts` input `tokens` are drafts (a prefill: none), on its
        `logits` `[B, drafts + 1, V]`, the rows' cache lengths `before` it; inside the step's graph, so it reads only
        its arguments and the table's tensors. `bitmask` `[B, drafts + 1, words]`: the tokens each position's grammar
        allows (`Grammars.masks`), with a grammar. `draft_lengths` [B]: each row's verified drafts (TETRIS; None:
        all). `target_argmax` [B, drafts + 1]: the logits' argmax, where a plain greedy kind reads only that (a
        ragged verify's, found over its flattened tokens). Returns `StepResult.packed`, then its `logprobs` when the
        kind has them."""
        # (Without drafts, not a slice of the prompts: compiled code guards on the strides.)
        draft_ids = tokens[:, tokens.shape[1] - drafts :] if drafts else tokens.new_zeros(len(tokens), 0)
        stance = (
            torch.compiler.set_stance(self.runner.forward_pass.stance() if drafts in self._warmed_up else "default")
            if self.runner.compiles
            else contextlib.nullcontext()
        )
        with stance:
            return self._accept_and_commit(
                rows,
                draft_ids=draft_ids,
                first_position=before + num_valid - drafts,
                logits=logits,
                draft_probs=draft_probs,
                all_greedy=kind.all_greedy,
                filtered=kind.filtered,
                penalized=kind.penalized,
                logprobs=kind.logprobs,
                bitmask=bitmask,
                draft_lengths=draft_lengths,
                target_argmax=target_argmax,
            )

    def _accept_and_commit_eagerly(
        self,
        rows: torch.Tensor,
        draft_ids: torch.Tensor,
        first_position: torch.Tensor,
        logits: torch.Tensor,
        draft_probs: torch.Tensor | None,
        all_greedy: bool,
        filtered: bool,
        penalized: bool,
        logprobs: bool,
        bitmask: torch.Tensor | None = None,
        draft_lengths: torch.Tensor | None = None,
        target_argmax: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """The penalties applied (with `penalized`), the grammar's mask (with a `bitmask`), `rejection_sample`, the
        emitted tokens' log-probabilities (with `logprobs`), then `_commit`; `first_position` is each row's sequence
        index of its first draft (or of its next token). Compiled with the layers (`_accept_and_commit`)."""
        t = self.table
        if penalized:  # each position sees the history before it, the drafts it follows included
            assert t.history is not None
            logits = penalized_logits(logits, t.history[rows, :-1], first_position, draft_ids, t.penalties(rows))
        reported = logits  # log-probabilities without the grammar's mask, as vLLM's (its -inf is no JSON number)
        if bitmask is not None:  # a token the grammar refuses gets p = 0: as a draft it is rejected, never sampled
            logits = masked_logits(logits, bitmask)
        params = RowParams(
            temperature=t.temperature[rows],
            top_k=t.top_k[rows],
            top_p=t.top_p[rows],
            seed_key=t.seed_key[rows],
            min_p=t.min_p[rows],
        )
        sampled = rejection_sample(
            target_logits=logits,
            draft_ids=draft_ids,
            draft_probs=draft_probs,
            params=params,
            first_position=first_position,
            synthetic_acceptance=self._synthetic(rows, first_position),
            all_greedy=all_greedy,
            filtered=filtered,
            draft_lengths=draft_lengths,
            target_argmax=target_argmax,
        )
        extra = []
        if logprobs:  # one tensor: one copy to the host
            chosen, values, ids = token_logprobs(reported, params.temperature, sampled.tokens)
            extra.append(torch.cat([chosen[..., None], values, ids.to(values.dtype)], dim=-1))
        packed = self._commit(rows, first_position - 1, sampled)
        if penalized:
            t.record_history(rows, first_position, sampled.tokens, packed[:, 0])
        if draft_lengths is not None:  # (the last column: `StepResult.per_row` reads the tokens before it)
            packed = torch.cat([packed, draft_lengths[:, None]], dim=1)
        return [packed, *extra]

    def _synthetic(self, rows: torch.Tensor, first_position: torch.Tensor) -> float | torch.Tensor | None:
        """Benchmarks only: the acceptance rate, or each row's [B, 1] of the rates (`synthetic_row_rates`)."""
        rates = self.synthetic_acceptance
        if not isinstance(rates, torch.Tensor):
            return rates
        step = first_position if self.synthetic_by_step else None
        return synthetic_row_rates(rates, self.table.seed_key[rows], step)[:, None]

    def _commit(self, rows: torch.Tensor, starts: torch.Tensor, sampled: SamplerOutput) -> torch.Tensor:
        """Trim at stop tokens and the length budget; keep the cache of what was emitted, drop the rest. Returns
        `StepResult.packed`."""
        tokens, width = sampled.tokens, sampled.tokens.shape[1]
        emitted = sampled.num_accepted + 1
        t = self.table
        is_eos = torch.isin(tokens, self.eos) & ~t.ignore_eos[rows][:, None]
        is_stop = is_eos | (tokens[:, :, None] == t.stop_ids[rows][:, None, :]).any(-1)
        is_stop &= torch.arange(width, device=tokens.device)[None, :] < emitted[:, None]
        first_stop = torch.where(is_stop.any(-1), is_stop.to(torch.long).argmax(-1), width)
        budget = t.max_tokens[rows] - t.generated[rows]
        keep = torch.minimum(torch.minimum(emitted, first_stop + 1), budget)
        finish = torch.where(first_stop < keep, FINISHED_STOP, torch.where(keep >= budget, FINISHED_LENGTH, RUNNING))
        t.generated[rows] += keep
        # Cached now: old pending + the first keep-1 emitted tokens; the last emitted one becomes pending.
        self.runner.truncate(rows, starts + keep)
        self.pending[rows] = tokens[torch.arange(len(rows), device=tokens.device), keep - 1]
        return torch.cat([torch.stack([keep, sampled.num_accepted, finish], dim=1), tokens], dim=1)


class Verifier:
    """Holds the target model's sequences. Invariant: each row's cache holds every committed token but the last,
    which waits in `pending` to be the first input of the next verify."""

    def __init__(
        self,
        runner: ModelRunner,
        eos_token_ids: Sequence[int],
        synthetic_acceptance: float | torch.Tensor | None = None,
        tokenizer: object | None = None,
    ) -> None:
        self.runner = runner
        self.table = SequenceTable(runner, eos_token_ids)
        # Structured outputs: the matchers on the host; each row's first mask (a prefill's) where its step reads it.
        self.grammars = Grammars(tokenizer, runner.vocab_size, eos_token_ids, pin=runner.device.type == "cuda")
        self.row_masks: torch.Tensor | None = None
        self.pending = torch.zeros(runner.num_slots + 1, dtype=torch.long, device=runner.device)
        # Host copies of rows' cache lengths, known once a step's result is read (-1: unknown, one host sync).
        self.cached = np.full(runner.num_slots + 1, -1, dtype=np.int64)
        eos = torch.tensor(sorted(set(eos_token_ids)) or [-1], dtype=torch.long, device=runner.device)
        self.selected_verifies = False  # TETRIS: precapture verifies of selected drafts too (set at Prepare)
        self.ragged_verifies = True  # TETRIS: only each row's selected drafts run (design section 14); False: padded
        self.verify_widths: tuple[int, ...] = ()  # TETRIS: the draft counts prepared, to which selected drafts are cut
        self.acceptance = Acceptance(runner, self.table, self.pending, eos, synthetic_acceptance)
        self._prefill_hidden: dict[int, torch.Tensor] = {}  # row -> its prompt's exported states, while prefilling

    @property
    def exports(self) -> bool:
        return bool(self.runner.forward_pass.export_layers)

    def export_hidden(self, layers: Sequence[int]) -> None:
        """From now on every prefill and verify also returns the hidden states of `layers` (indices into HF's
        `output_hidden_states`, what an EAGLE head reads) at the positions it keeps (`StepResult.hidden_rows`).
        A prefill then computes its whole prompt, a cached prefix too: the head needs every position's state."""
        count = int(self.runner.model.config.get_text_config().num_hidden_layers)
        if any(not 0 <= i <= count for i in layers):
            raise ValueError(f"hidden states of layers {list(layers)} asked for; the target has {count} layers")
        self.runner.forward_pass.export_layers = tuple(layers)

    def prefill(
        self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]
    ) -> StepResult:
        """Cache the prompts and sample each sequence's first token (time to first token ends here): each group of
        prompts a step (`SequenceTable.prefill`) that decides and commits as a verify without drafts would, as if
        the last prompt token had been pending."""
        kind = self.table.sampling_kind(seq_ids, self.runner.vocab_size, configs)
        asked = {s: c.prompt_logprobs for s, c in zip(seq_ids, configs) if c.prompt_logprobs is not None}
        reported: dict[int, list[tuple[float, list[tuple[int, float]]]]] = {}  # by row, filled by the bodies
        body = functools.partial(self._prefill_step, kind=kind, asked=asked, reported=reported)
        on_rows = None
        if kind.grammar:  # each matcher past the output a preempted sequence had; its first mask in its row
            outputs = [p[len(p) - c.output_tokens :] if c.output_tokens else [] for p, c in zip(prompts, configs)]
            self.grammars.admit(seq_ids, [c.grammar for c in configs], outputs)
            on_rows = functools.partial(self._write_row_masks, masks=self.grammars.first_masks(seq_ids))
        pool = self.runner.cache.pool
        assert pool is not None
        caching = pool.prefix_caching
        if self.exports:  # every prompt position computed: a cached prefix has no hidden states to export
            pool.prefix_caching = False
        try:
            step_rows, _, (packed, *logprobs), cached = self.table.prefill(
                seq_ids, prompts, configs, kind=self._step_kind(kind), body=body, on_rows=on_rows
            )
            parts = [self._prefill_hidden[row] for row in step_rows.tolist()] if self.exports else None
            hidden = None if parts is None else gathered_hidden(parts, prompts)
        except Exception:
            self.grammars.release(seq_ids)
            raise
        finally:
            pool.prefix_caching = caching
            self._prefill_hidden.clear()
        rows = self.table.row_list(seq_ids)  # (below: the last token of each prompt is pending)
        on_read = functools.partial(recorder, self.cached, self.runner.cache, rows, [len(p) - 1 for p in prompts], 0)
        result = StepResult(packed, on_read, cached)
        if logprobs:
            result.logprobs, result.top_n = logprobs[0], [c.logprobs for c in configs]
        if asked:
            result.prompt_logprobs = [reported.get(row) for row in rows]
        if kind.grammar:
            result.on_tokens = functools.partial(self.grammars.advance, list(seq_ids))
        if hidden is not None:
            result.hidden, result.hidden_counts = hidden, [len(p) for p in prompts]
        return result

    def _write_row_masks(self, rows: torch.Tensor, masks: torch.Tensor) -> None:
        """Each row's first grammar mask, where its prefill's step reads it (all set: unconstrained)."""
        if self.row_masks is None:
            slots = self.table.temperature.shape[0]
            shape = (slots, self.grammars.words)
            self.row_masks = torch.full(shape, -1, dtype=torch.int32, device=self.runner.device)
        self.row_masks[rows] = masks.to(self.runner.device, non_blocking=True)  # (pinned on CUDA)

    def verify(
        self,
        seq_ids: Sequence[int],
        draft_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        batch_id: int | None = None,
        selected: bool = False,
    ) -> StepResult:
        """Score `[pending, d_1..d_k]` of every row in one forward, accept a prefix, commit it, roll back the rest:
        all in the step's CUDA graph (`_verify_step`). k = 0: plain autoregressive decoding, same path. A `batch_id`
        (0 or 1) keeps the batch's rows in graph buffers of its own. The blocks the k + 1 positions need are taken
        first: all, or a CapacityError. `selected` (TETRIS, design section 14): each row's drafts end before its
        first -1, cut to a prepared width, and only they run, flattened (`ragged_verifies`; else the lengths mask
        the acceptance), or plain SD's verify where every row keeps all of its cut drafts (`selected_shape`)."""
        _, rows = self.table.batch_rows(seq_ids, batch_id)
        draft_ids, draft_probs, flattened, even = selected_shape(
            draft_ids, draft_probs, selected, self.verify_widths, self.ragged_verifies, self.runner.device
        )
        selected = selected and even is None
        k = draft_ids.shape[1]
        index = rows.numpy()  # (a host tensor: no copy)
        before = self.cached[index]
        if (before < 0).any():  # a row whose last result was not read (a failed call): ask the device
            before = self.runner.cache.lengths[rows.to(self.runner.device)].numpy(force=True)
        self.runner.cache.reserve(index, before + k + 1)
        kind = self.table.sampling_kind(seq_ids, self.runner.vocab_size)
        probs: tuple[torch.Tensor, ...] = ()
        if draft_probs is not None:
            probs = (padded_probs(draft_probs.to(self.runner.device, torch.float32), self.runner.vocab_size),)
        if kind.grammar:  # the masks of every verified position, after the drafts before it (`Grammars.masks`)
            probs += (self.grammars.masks(seq_ids, draft_ids.cpu().numpy()),)
        needed = int(before.max()) + k + 1
        packed, *logprobs = self._run_verify(
            rows, draft_ids, probs, kind=kind, needed=needed, lane=batch_id, selected=selected, flattened=flattened
        )
        hidden = logprobs.pop() if self.exports else None
        # The next verify of k drafts reaches 2(k + 1) past `before` at most; the recorder trims past the same reach,
        # so no block is freed and taken again from step to step.
        self.runner.cache.keep_ahead(index, before + 2 * (k + 1))
        self.cached[index] = -1  # unknown until the result is read
        top_n = [self.table.configs_by_id[s].logprobs for s in seq_ids] if logprobs else []
        on_read = functools.partial(recorder, self.cached, self.runner.cache, index, before, 2 * (k + 1))
        verified = None if even is None else [even] * len(seq_ids)  # (plain SD's verify of a selection)
        result = StepResult(packed, on_read, hidden=hidden, selected=selected, verified=verified)
        if logprobs:
            result.logprobs, result.top_n = logprobs[0], top_n
        if kind.grammar:  # the matchers move on by what was emitted once the host reads it
            result.on_tokens = functools.partial(self.grammars.advance, list(seq_ids))
        return result

    def held_seq_ids(self) -> list[int]:
        """Every sequence it holds (what a worker frees when its lease ends)."""
        return list(self.table.rows_by_id)

    def release(self, seq_ids: Sequence[int]) -> None:
        self.cached[self.table.remove(seq_ids)] = -1
        self.grammars.release(seq_ids)

    def _run_verify(
        self,
        rows: torch.Tensor,
        draft_ids: torch.Tensor,
        probs: tuple[torch.Tensor, ...],
        *,
        kind: SamplingKind,
        needed: int,
        lane: int | None,
        selected: bool = False,
        flattened: int | None = None,
    ) -> list[torch.Tensor]:
        """The verify step: prepared on the drafts (and their probabilities, and with a grammar its masks), then run.
        The pending tokens are gathered inside its graph, which leaves the host only the copies into the graph's
        inputs. `flattened`: a ragged verify of selected drafts, of that many tokens (its graphs keyed by it)."""
        k = draft_ids.shape[1]
        ragged = "" if flattened is None else f"-ragged{flattened}"
        step = self.runner.prepare(
            kind=self._step_kind(kind) + ("-selected" if selected else "") + ragged,
            rows=rows,
            inputs=(draft_ids, *probs),
            needed=needed,
            tokens=k + 1,
            lane=lane,
        )
        body = functools.partial(self._verify_step, kind=kind, selected=selected, flattened=flattened)
        return self.runner.run(step, body)

    def _verify_step(
        self,
        rows: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        shape: StepShape,
        *,
        kind: SamplingKind,
        selected: bool = False,
        flattened: int | None = None,
    ) -> list[torch.Tensor]:
        """A verify's body, inside its graph: each row's pending token and its drafts -> the forward -> accept a
        prefix, commit it, roll back the rest (`_decide`). `selected`: a row's drafts end at its first id of -1;
        `flattened` (selected too): only they run, as that many tokens (`ForwardPass.step_forward`)."""
        drafts, *probs = inputs
        bitmask = probs.pop() if kind.grammar else None
        k = drafts.shape[1]
        num_valid = torch.full_like(rows, k + 1)
        drafts, draft_lengths, counts = selected_drafts(drafts, rows, num_valid, self.runner.scratch_row, selected)
        tokens = torch.cat([self.pending[rows][:, None], drafts], dim=1)
        before = self.runner.cache.lengths[rows]
        valid = num_valid if flattened is None else counts
        argmax_only = flattened is not None and kind == SamplingKind(all_greedy=True, filtered=False)
        logits = self.runner.step_forward(
            rows, tokens, valid, shape=shape, last_only=False, flattened=flattened, flat_logits=argmax_only
        )
        argmax = flat_argmax(logits, self.runner.forward_pass.unflatten) if argmax_only else None
        exported = self.runner.forward_pass.exported if self.exports else None
        decided = self.acceptance.decide(
            rows,
            tokens=tokens,
            num_valid=num_valid,
            before=before,
            logits=logits,
            draft_probs=probs[0] if probs else None,
            drafts=k,
            kind=kind,
            bitmask=bitmask,
            draft_lengths=draft_lengths,
            target_argmax=argmax,
        )
        return decided if exported is None else [*decided, exported]

    def _prefill_step(
        self,
        rows: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        shape: StepShape,
        *,
        kind: SamplingKind,
        asked: dict[int, int] | None = None,
        reported: dict[int, list[tuple[float, list[tuple[int, float]]]]] | None = None,
    ) -> list[torch.Tensor]:
        """A prefill's body: the prompts -> the forward -> each sequence's first token decided and committed
        (`_decide`, without drafts). Rows of the sequences `asked` for prompt log-probabilities (seq id -> top ones)
        get them in `reported` (by row): such a group's forward keeps the logits of every position (a prefill runs
        eagerly, so the host reads them here)."""
        prompts, lengths = inputs
        before = self.runner.cache.lengths[rows]
        wanted = {self.table.rows_by_id[s]: top for s, top in (asked or {}).items()}
        host_rows = rows.tolist() if wanted else []
        if any(row in wanted for row in host_rows):
            every = self.runner.step_forward(rows, prompts, lengths, shape=shape, last_only=False)
            logits = every[torch.arange(len(host_rows), device=every.device), lengths - 1]
            for b, row in enumerate(host_rows):
                if row in wanted and reported is not None:
                    reported[row] = _prompt_logprobs(every[b], prompts[b], int(lengths[b]), wanted[row])
        else:
            logits = self.runner.step_forward(rows, prompts, lengths, shape=shape, last_only=True)
        bitmask = None
        if kind.grammar:
            assert self.row_masks is not None
            bitmask = self.row_masks[rows][:, None]
        exported = self.runner.forward_pass.exported
        if self.exports and exported is not None:  # (a prefill runs eagerly: the host may keep what it made)
            for b, (row, length) in enumerate(zip(rows.tolist(), lengths.tolist(), strict=True)):
                self._prefill_hidden[row] = exported[b, :length].clone()
        return self.acceptance.decide(
            rows,
            tokens=prompts,
            num_valid=lengths,
            before=before,
            logits=logits[:, None],  # at each prompt's last token
            draft_probs=None,
            drafts=0,
            kind=kind,
            bitmask=bitmask,
        )

    def precapture(self, k: int, max_batch: int) -> int:
        """Run the verify of k drafts in every shape serving can give it (`ModelRunner.precapture`), for each kind of
        batch a proposer sends by default: all greedy (ids only), sampled and filtered (with the draft's
        probabilities); with k > 0 the target's step alone too (k = 0), which a speculating coordinator runs while
        drafts do not pay, or its draft is lost."""
        shapes = 0
        for drafts, kind in itertools.product(sorted({k, 0}, reverse=True), KINDS):
            for variant in verify_variants(drafts, self.selected_verifies, self.ragged_verifies, self.runner.device):
                verify = functools.partial(self._scratch_verify, drafts=drafts, kind=kind, variant=variant)
                shapes += self.runner.precapture(max_batch=max_batch, n=drafts + 1, run_step=verify)
        return shapes

    def _scratch_verify(
        self, rows: torch.Tensor, needed: int, *, drafts: int, kind: SamplingKind, variant: tuple[bool, int]
    ) -> None:
        """A verify of zero drafts (and probabilities, when sampled) on scratch rows, as `precapture` runs it, of a
        `verify_variants` variant."""
        probs = scratch_probs(len(rows), drafts, kind, self.runner.vocab_size, rows.device)
        draft_ids = torch.zeros(len(rows), drafts, dtype=torch.long, device=rows.device)
        selected, flat = variant[0], len(rows) * variant[1] or None
        self._run_verify(rows, draft_ids, probs, kind=kind, needed=needed, lane=None, selected=selected, flattened=flat)

    def warm_up(self, k: int) -> None:
        """With compiled layers, compile the acceptance and commit of verifies of k drafts, prefills and target-only
        steps before serving (`Acceptance.warm_up`); with `selected_verifies`, of selected drafts too (and layers)."""
        self.acceptance.warm_up(k, self.selected_verifies)
        if self.selected_verifies and self.ragged_verifies and self.runner.compiles and k:
            kv_len = self.runner.step_shape(1, k + 1, k + 1)[1]
            self.runner.forward_pass.warm_up_ragged(self.runner.scratch_row, k + 1, kv_len)

    def _step_kind(self, kind: SamplingKind) -> str:
        """The kind of a verify (or prefill) step of a batch of this kind: its graphs' key (one that exports hidden
        states returns them too)."""
        return "verify-" + kind.name + ("-export" if self.exports else "")


def _prompt_logprobs(
    logits: torch.Tensor, prompt: torch.Tensor, length: int, top: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each prompt token after the first: its log-probability under the raw logits [n, V] at the position before it,
    and the `top` most likely tokens' (id, log-probability) there."""
    logprobs = logits[: length - 1].float().log_softmax(dim=-1)
    chosen = logprobs.gather(-1, prompt[1:length, None].to(logprobs.device).long())[:, 0].tolist()
    best = logprobs.topk(max(top, 1), dim=-1)
    ids, values = best.indices.tolist(), best.values.tolist()
    return [(c, list(zip(i[:top], v[:top], strict=True))) for c, i, v in zip(chosen, ids, values, strict=True)]


def scratch_probs(
    batch: int, drafts: int, kind: SamplingKind, vocab: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """A scratch verify's draft probabilities (zeros; none for greedy drafts or none drafted)."""
    return (torch.zeros(batch, drafts, vocab, device=device),) if not kind.all_greedy and drafts else ()


def recorder(
    cached: np.ndarray,
    cache: PagedKVCache,
    rows: Sequence[int] | np.ndarray,
    starts: Sequence[int] | np.ndarray,
    ahead: int,
    emitted: list[int],
) -> None:
    """What a step's result tells the host once read: each row now caches its start plus what it `emitted`
    (`Acceptance._commit`), and the blocks past that and the `ahead` positions its next step may write go back."""
    lengths = np.asarray(starts, dtype=np.int64) + np.asarray(emitted, dtype=np.int64)
    cached[rows] = lengths
    cache.trim(rows, lengths + ahead)


def padded_probs(draft_probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """The draft's probabilities over the target's vocabulary (a draft's may be smaller): one graph input shape."""
    missing = vocab - draft_probs.shape[-1]
    return torch.nn.functional.pad(draft_probs, (0, missing)) if missing > 0 else draft_probs


def gathered_hidden(parts: Sequence[torch.Tensor], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Each prompt's exported states (`parts`, as the prefill's steps left them) in one [B, longest, width]."""
    hidden = parts[0].new_zeros(len(parts), max(len(p) for p in prompts), parts[0].shape[-1])
    for b, part in enumerate(parts):
        hidden[b, : len(part)] = part
    return hidden
