"""The draft side of speculative decoding: propose k tokens per sequence, then reconcile with the target."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from draft_service.drafter import Proposal
from minedraft.engine.attention import fused_query_tokens
from minedraft.engine.grammar import Grammars, masked_logits
from minedraft.engine.model_runner import ModelRunner, StepShape
from minedraft.engine.sampling import (
    STREAM_DRAFT,
    SamplingConfig,
    SamplingKind,
    greedy_tokens,
    penalized_logits,
    processed_probs,
    sample_from,
    seeded_uniform,
    synthetic_row_rates,
)
from minedraft.engine.sequence_table import SequenceTable

# A proposal's first forward runs the tail of what the target committed: [t], or [d_k, t] after a full accept.
TAIL_TOKENS = 2


class Proposer:
    """The draft model's drafter (`Drafter`): holds its sequences in the model's paged KV cache.

    Per row it remembers its last proposal: `committed` (tokens cached when it began), how many drafts it made and
    the last of them, d_k. The target's answer (accepted count a, emitted token t) then says which cached drafts
    stay: the cache ran the last proposal's drafts 1..k-1, so it keeps min(a, k-1) of them, and after a full accept
    d_k still has to be run, before t.
    """

    def __init__(
        self,
        runner: ModelRunner,
        greedy_drafts: bool = False,
        eos_token_ids: Sequence[int] = (),
        tokenizer: object | None = None,
    ) -> None:
        self.runner = runner
        self.table = SequenceTable(runner, eos_token_ids)  # (the EOS ids: what min_tokens masks in drafts too)
        self.greedy_drafts = greedy_drafts  # one-hot q for every row: no probabilities move, still lossless
        # Structured outputs: with a tokenizer, drafts are masked by the request's grammar as the target's
        # distribution is (acceptance; lossless either way). The matchers follow the target's verdicts, and each
        # constrained row's last drafts, on the host.
        self.grammars = None if tokenizer is None else Grammars(tokenizer, runner.vocab_size, eos_token_ids)
        self.last_drafts: dict[int, list[int]] = {}
        # TETRIS (design section 14): each proposal also returns its drafts' log q (`Proposal.token_logprobs`), for
        # the selection; set at Prepare. `synthetic_rates` (benchmarks only): each row's score is log of the rate,
        # of these, that the target's --synthetic-row-acceptance accepts it by (`synthetic_row_rates`; by step: each
        # step's own), as a draft that predicts its acceptance, as a trained one does.
        self.scores_drafts = False
        self.synthetic_rates: torch.Tensor | None = None
        self.synthetic_by_step = False
        slots, device = runner.num_slots + 1, runner.device  # with the scratch row, as the table
        self.committed = torch.zeros(slots, dtype=torch.long, device=device)
        self.last_k = torch.zeros(slots, dtype=torch.long, device=device)
        self.final_draft = torch.zeros(slots, dtype=torch.long, device=device)
        # Host copies of `committed` and `last_k`: a proposal's key length without waiting for the device.
        self.committed_host = np.zeros(slots, dtype=np.int64)
        self.last_k_host = np.zeros(slots, dtype=np.int64)

    def prefill(
        self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]
    ) -> list[int]:
        """Cache the prompts; the prompt tokens each found in the prefix cache."""
        if self.grammars is not None and any(c.grammar is not None for c in configs):
            outputs = [p[len(p) - c.output_tokens :] if c.output_tokens else [] for p, c in zip(prompts, configs)]
            self.grammars.admit(seq_ids, [c.grammar for c in configs], outputs)
        try:
            rows, lengths, _, cached = self.table.prefill(
                seq_ids, prompts, configs, kind="prefill", body=self._cache_only
            )
        except Exception:
            self.release(seq_ids)
            raise
        self.committed[rows] = lengths
        self.last_k[rows] = 0
        for row, prompt in zip(self.table.row_list(seq_ids), prompts, strict=True):
            self.committed_host[row], self.last_k_host[row] = len(prompt), 0
        return cached

    def propose(
        self,
        seq_ids: Sequence[int],
        num_accepted: torch.Tensor,
        next_tokens: torch.Tensor,
        k: int,
        batch_id: int | None = None,
        missed: Sequence[Sequence[int]] = (),
        defer_upkeep: bool = False,
    ) -> Proposal:
        """Reconcile every row with the target's last verdict, then draft k tokens for each (`batch_id`: as in
        `Verifier.verify`), all in the proposal's CUDA graph (`_proposal_step`). `num_accepted` and `next_tokens`
        are host tensors.

        `missed` (per row, or empty): tokens the target emitted before `next_tokens` that this draft was not given,
        since the coordinator decoded without drafts meanwhile (`_catch_up`).

        `defer_upkeep`: the blocks the next proposal needs are kept (`keep_ahead`) by the returned proposal's
        `upkeep`, which the caller runs once it has replied and before any other call of this proposer, rather
        than here: on a GPU a proposal's reply goes once its graph is launched, and the target waits for it."""
        if k < 1:
            raise ValueError("a proposal drafts at least one token")
        kind = self.table.sampling_kind(seq_ids, self.runner.vocab_size)
        kind = drafting_kind(kind, self.greedy_drafts, self.grammars is not None)
        if kind.grammar:  # (before the catch-up, which forgets the last proposal)
            self._follow_verdicts(seq_ids, num_accepted.tolist(), next_tokens.tolist(), missed)
        if any(missed):
            self._catch_up(seq_ids, num_accepted.tolist(), missed)
        _, rows = self.table.batch_rows(seq_ids, batch_id)
        # The lengths the proposal's forwards reach, from the host copies: the first writes both tail positions of
        # every row, valid or not, each later one appends one token. The blocks its writes reach are taken (all, or
        # a CapacityError), the rolled-back ones a row still holds reused, mostly taken by the proposal before.
        # Once the step is launched, the blocks up to the next proposal's reach are kept (`keep_ahead`).
        index = rows.numpy()  # (a host tensor: no copy)
        committed = committed_after(self.committed_host, self.last_k_host, index, num_accepted.numpy())
        ends = committed + (k - 1)  # the last forward's token, k - 1 past the tail's last
        if k < TAIL_TOKENS:  # the tail's positions, written whether valid or not, may reach further
            kept, _ = kept_and_tail(self.committed_host, self.last_k_host, index, num_accepted.numpy())
            ends = np.maximum(ends, kept + TAIL_TOKENS)
        self.runner.cache.reserve(index, ends)
        verdicts = torch.stack([num_accepted, next_tokens], dim=1)  # copied straight into the graph's inputs
        outputs = self._run_proposal(
            rows, verdicts, k=k, kind=kind, needed=int(ends.max()), lane=batch_id, seq_ids=seq_ids
        )
        # The next reach: kept' <= kept + tail + k - 1, tail' <= 2, so ends' <= kept + tail + 2k <= ends + k + 1.
        upkeep = functools.partial(self.runner.cache.keep_ahead, index, ends + k + 1)
        self.committed_host[index], self.last_k_host[index] = committed, k
        if not defer_upkeep:
            upkeep()
        probs = None if kind.all_greedy else outputs[1]
        scores = outputs[-1] if self.scores_drafts else None
        return Proposal(outputs[0], probs, upkeep if defer_upkeep else None, scores)

    def _run_proposal(
        self,
        rows: torch.Tensor,
        verdicts: torch.Tensor,
        *,
        k: int,
        kind: SamplingKind,
        needed: int,
        lane: int | None,
        seq_ids: Sequence[int] = (),
    ) -> list[torch.Tensor]:
        """The proposal step: prepared on the target's verdicts `[B, 2]` (accepted count, emitted token), then run;
        `needed` is the longest row after its last forward. With a grammar it runs eagerly: its masks are made on
        the host between its forwards, from the drafts before."""
        step = self.runner.prepare(
            kind=kind.name + ("-scored" if self.scores_drafts else ""),
            rows=rows,
            inputs=(verdicts,),
            needed=needed,
            tokens=TAIL_TOKENS,
            forwards=k,
            lane=lane,
        )
        if kind.grammar:
            step.graphable = False
        return self.runner.run(step, functools.partial(self._proposal_step, k=k, kind=kind, seq_ids=seq_ids))

    def _proposal_step(
        self,
        rows: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        shape: StepShape,
        *,
        k: int,
        kind: SamplingKind,
        seq_ids: Sequence[int] = (),
    ) -> list[torch.Tensor]:
        """A proposal's body, inside its graph (a draft's forwards are too small to pay for a launch from Python
        each): each row rolled back to what the target kept (`_reconcile`), then k forwards, each drafting a token
        from the last logits (`choose_draft`) and running it in the next; the last draft is remembered as the row's d_k.
        Returns the drafts `[B, k]`, then their distributions `[B, k, V]` unless every row drafts greedily, then
        with `scores_drafts` each draft's log q `[B, k]`."""
        (verdicts,) = inputs
        tokens, num_valid = self._reconcile(rows, verdicts)
        if kind.penalized:  # the tail's tokens where the penalties of the drafts count them
            self.table.record_history(rows, self.committed[rows] - num_valid, tokens, num_valid)
        drafts, probs, scores = [], [], []
        drafted: list[int] | None = None  # with a grammar: the last drafts on the host
        for position in range(k):
            logits = self.runner.step_forward(rows, tokens, num_valid, shape=shape, last_only=True)
            if kind.grammar:
                assert self.grammars is not None
                logits = masked_draft_logits(self.grammars, logits, seq_ids, drafted)
            draft, q = choose_draft(self.table, self.committed, rows, logits, position=position, kind=kind)
            if kind.grammar:
                drafted = draft[: len(seq_ids)].tolist()
            if kind.penalized:
                self.table.record_history(rows, self.committed[rows] + position, draft[:, None], torch.ones_like(draft))
            drafts.append(draft)
            if q is not None:
                probs.append(q)
            if self.scores_drafts and self.synthetic_rates is None:
                scores.append(draft_log_q(logits, draft, q))
            tokens, num_valid = draft[:, None], torch.ones_like(num_valid)
        self.final_draft[rows] = draft
        self.last_k.index_fill_(0, rows, k)  # (an assignment would copy k from the host: not in a graph)
        stacked = torch.stack(drafts, dim=1)
        if kind.grammar:
            assert self.grammars is not None
            self.grammars.rollback_drafts()
            host = stacked[: len(seq_ids)].tolist()
            self.last_drafts.update((s, host[b]) for b, s in enumerate(seq_ids) if s in self.grammars.matchers)
        outputs = [stacked] + ([torch.stack(probs, dim=1)] if probs else [])
        if self.scores_drafts:
            step, seeds = self.committed[rows] if self.synthetic_by_step else None, self.table.seed_key[rows]
            outputs.append(
                torch.stack(scores, dim=1) if scores else synthetic_scores(self.synthetic_rates, seeds, k, step)
            )
        return outputs

    def _follow_verdicts(
        self, seq_ids: Sequence[int], num_accepted: list[int], next_tokens: list[int], missed: Sequence[Sequence[int]]
    ) -> None:
        """Each constrained row's matcher past what the target committed since: the drafts it accepted of the last
        proposal, the tokens decoded without drafts (`missed`), the token it emitted."""
        assert self.grammars is not None
        rows = self.table.row_list(seq_ids)
        committed = []
        for i, (seq_id, row) in enumerate(zip(seq_ids, rows, strict=True)):
            accepted = min(num_accepted[i], int(self.last_k_host[row]))
            drafts = self.last_drafts.get(seq_id, [])[:accepted]
            committed.append(drafts + list(missed[i] if missed else ()) + [next_tokens[i]])
        self.grammars.advance(seq_ids, committed)

    def _catch_up(self, seq_ids: Sequence[int], num_accepted: list[int], missed: Sequence[Sequence[int]]) -> None:
        """Rows that missed tokens: the verdict on their last proposal applied, then what it leaves uncached (d_k
        after a full accept) and the missed tokens cached, in one eager forward (as a prefill: a graph per width
        would be captured mid-load). Each row is left as a prefill leaves it, nothing drafted, so that the
        proposal's graph feeds it `next_tokens` alone. Only after the coordinator decoded without drafts, which it
        does in spells (`SpeculationPolicy`): one forward per spell, off the proposals' graphs."""
        lagging = [i for i, tokens in enumerate(missed) if tokens]
        host_rows = self.table.row_list([seq_ids[i] for i in lagging])
        device = self.runner.device
        rows = torch.tensor(host_rows, dtype=torch.long, device=device)
        final_drafts = self.final_draft[rows].tolist()
        kept_array, tails = kept_and_tail(
            self.committed_host, self.last_k_host, np.asarray(host_rows), np.asarray([num_accepted[i] for i in lagging])
        )
        kept = kept_array.tolist()
        appended = [
            ([final_draft] if tail == 2 else []) + list(missed[i])
            for i, final_draft, tail in zip(lagging, final_drafts, tails.tolist())
        ]
        width = max(len(t) for t in appended)
        if device.type == "cuda":  # wide enough for the prefills' attention (`fused_query_tokens`), within the rows
            width = max(width, min(fused_query_tokens(self.runner.model.config), self.runner.max_len - max(kept)))
        ids = torch.zeros(len(lagging), width, dtype=torch.long)
        for b, tokens in enumerate(appended):
            ids[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        ids = ids.clamp(max=self.runner.vocab_size - 1)  # (as `_reconcile`: a wider target vocabulary)
        self.table.write_history(host_rows, kept, [ids[b, : len(t)].tolist() for b, t in enumerate(appended)])
        lengths = [keep + len(tokens) for keep, tokens in zip(kept, appended)]
        self.runner.cache.trim(host_rows, kept)
        self.runner.cache.reserve(host_rows, [min(keep + width, self.runner.max_len) for keep in kept])  # padding too
        self.runner.truncate(rows, torch.tensor(kept, dtype=torch.long, device=device))
        step = self.runner.prepare(
            kind="catch-up",
            rows=rows,
            inputs=(ids.to(device), torch.tensor([len(t) for t in appended], device=device)),
            needed=max(kept) + width,
            tokens=width,
            last_only=True,
        )
        self.runner.run(step, self._cache_only)
        self.committed[rows] = torch.tensor(lengths, dtype=torch.long, device=device)
        self.last_k[rows] = 0
        self.committed_host[host_rows], self.last_k_host[host_rows] = lengths, 0

    def precapture(self, k: int, max_batch: int) -> int:
        """Run every kind of proposal of k tokens in every shape serving can give it (`ModelRunner.precapture`)."""
        kinds = [SamplingKind(all_greedy=True, filtered=False)]
        if not self.greedy_drafts:
            kinds += [SamplingKind(all_greedy=False, filtered=False), SamplingKind(all_greedy=False, filtered=True)]
        shapes = 0
        for kind in kinds:
            proposal = functools.partial(self._scratch_proposal, k=k, kind=kind)
            shapes += self.runner.precapture(max_batch=max_batch, n=TAIL_TOKENS, run_step=proposal)
        return shapes

    def _scratch_proposal(self, rows: torch.Tensor, needed: int, *, k: int, kind: SamplingKind) -> None:
        """A proposal after a verdict of zeros on scratch rows, as `precapture` runs it."""
        verdicts = torch.zeros(len(rows), 2, dtype=torch.long, device=rows.device)
        self._run_proposal(rows, verdicts, k=k, kind=kind, needed=needed, lane=None)

    def _reconcile(self, rows: torch.Tensor, verdicts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inside the proposal's graph: roll each row back to what the target kept; the first forward's tokens are
        those committed but not cached, [t] or [d_k, t] after a full accept, and how many of them are valid."""
        num_accepted, next_tokens = verdicts[:, 0], verdicts[:, 1]
        last_k = self.last_k[rows]
        kept = self.committed[rows] + torch.minimum(num_accepted, (last_k - 1).clamp(min=0))
        self.runner.truncate(rows, kept)
        full = (num_accepted == last_k) & (last_k > 0)
        tail = torch.stack([torch.where(full, self.final_draft[rows], next_tokens), next_tokens], dim=1)
        # A target with a padded, wider vocabulary may emit an id the draft cannot embed; any stand-in keeps the
        # output lossless (the target verifies), it only lowers acceptance after such a rare token.
        tail = tail.clamp(max=self.runner.vocab_size - 1)
        tail_len = 1 + full.to(torch.long)
        self.committed[rows] = kept + tail_len
        # Padding rows: the scratch row stays empty. (An assignment of 0 would copy it from the host: not in a graph.)
        self.committed.narrow(0, self.runner.scratch_row, 1).zero_()
        return tail, tail_len

    def _cache_only(self, rows: torch.Tensor, inputs: Sequence[torch.Tensor], shape: StepShape) -> list[torch.Tensor]:
        """The body of a draft's prefill or catch-up: the forward only caches the tokens."""
        input_ids, num_valid = inputs
        self.runner.step_forward(rows, input_ids, num_valid, shape=shape, last_only=True)
        return []

    def held_seq_ids(self) -> list[int]:
        """Every sequence it holds (what a worker frees when its lease ends)."""
        return list(self.table.rows_by_id)

    def release(self, seq_ids: Sequence[int]) -> None:
        self.table.remove(seq_ids)
        if self.grammars is not None:
            self.grammars.release(seq_ids)
        for seq_id in seq_ids:
            self.last_drafts.pop(seq_id, None)


def choose_draft(
    table: SequenceTable,
    committed: torch.Tensor,
    rows: torch.Tensor,
    logits: torch.Tensor,
    *,
    position: int,
    kind: SamplingKind,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inside the proposal's graph: the draft token of each row from its last logits `[B, V]`, the proposal's
    `position`-th (`committed`: each row's committed tokens), and its distribution q (None when every row drafts
    greedily: none is made, and none moves); penalized as the target's, over the row's history and the drafts
    before."""
    t = table
    if kind.penalized:
        assert t.history is not None
        length = committed[rows] + position
        none = torch.zeros(len(rows), 0, dtype=torch.long, device=logits.device)
        logits = penalized_logits(logits[:, None], t.history[rows, :-1], length, none, t.penalties(rows))[:, 0]
    if kind.all_greedy:
        return greedy_tokens(logits), None
    temp = t.temperature[rows]  # (with greedy_drafts every batch is all-greedy: see `drafting_kind`)
    probs = processed_probs(
        logits[:, None],
        temperature=temp,
        top_k=t.top_k[rows],
        top_p=t.top_p[rows],
        filtered=kind.filtered,
        min_p=t.min_p[rows],
    )[:, 0]
    u = seeded_uniform(t.seed_key[rows], (committed[rows] + position)[:, None], STREAM_DRAFT)[:, 0]
    greedy = temp == 0
    token = torch.where(greedy, greedy_tokens(logits), sample_from(probs, u))
    one_hot = torch.zeros_like(probs).scatter_(-1, token[:, None], 1.0)  # no host sync, unlike F.one_hot
    return token, torch.where(greedy[:, None], one_hot, probs)


def draft_log_q(logits: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """A draft's log q [B]: from its distribution where sampled, else from the logits it was the argmax of."""
    if q is not None:
        return q.gather(-1, draft[:, None])[:, 0].float().clamp(min=torch.finfo(torch.float32).tiny).log()
    return logits.float().log_softmax(dim=-1).gather(-1, draft[:, None])[:, 0]


def masked_draft_logits(
    grammars: Grammars, logits: torch.Tensor, seq_ids: Sequence[int], drafted: list[int] | None
) -> torch.Tensor:
    """A proposal's logits `[B, V]` (B padded past the sequences) masked by each row's grammar after its drafts
    so far (`Grammars.draft_masks`)."""
    masks = grammars.draft_masks(seq_ids, drafted)
    if len(masks) < len(logits):  # padding rows: nothing masked
        masks = torch.cat([masks, masks.new_full((len(logits) - len(masks), masks.shape[1]), -1)])
    return masked_logits(logits[:, None], masks.to(logits.device)[:, None])[:, 0]


def committed_after(committed: np.ndarray, last_k: np.ndarray, rows: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """Per row (`committed`, `last_k`: the proposer's host copies): the tokens committed once the target's verdict
    is applied, kept + tail (`kept_and_tail`), in fewer array operations (each costs a GPU host ~3 us before the
    launch): an accept of all last_k drafts keeps last_k - 1 and a tail of 2, an accept of fewer keeps them and a
    tail of 1, and a row that drafted nothing (after a prefill or a catch-up) keeps none of a verdict that was for
    drafts it caught up on."""
    return committed[rows] + np.minimum(accepted, last_k[rows]) + 1


def kept_and_tail(
    committed: np.ndarray, last_k_all: np.ndarray, rows: np.ndarray, accepted: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per row: (tokens its cache keeps, tokens committed but not cached yet) after the target's verdict, from
    the host copies (`_reconcile` does the same on the device)."""
    last_k = last_k_all[rows]
    kept = committed[rows] + np.minimum(accepted, np.maximum(last_k - 1, 0))
    return kept, np.where((accepted == last_k) & (last_k > 0), 2, 1)


@functools.cache
def drafting_kind(kind: SamplingKind, greedy_drafts: bool, masks: bool) -> SamplingKind:
    """How a batch of `kind` drafts: greedily for every row with `greedy_drafts`; never with logprobs (the target's
    alone); masked by a grammar where the draft has a tokenizer (`masks`). Cached: a named tuple's `_replace` cost
    5 us of each proposal's host time."""
    return kind._replace(all_greedy=kind.all_greedy or greedy_drafts, logprobs=False, grammar=kind.grammar and masks)


def synthetic_scores(
    rates: torch.Tensor | None, seed_keys: torch.Tensor, k: int, first_position: torch.Tensor | None = None
) -> torch.Tensor:
    """Benchmarks only: each row's drafts scored log(rate), the rate the target accepts them by
    (`synthetic_row_rates`; `first_position`: the first draft's, with --synthetic-rate-by step)."""
    assert rates is not None
    return synthetic_row_rates(rates, seed_keys, first_position).log()[:, None].expand(len(seed_keys), k).contiguous()
