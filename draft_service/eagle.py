"""The EAGLE drafter: an EAGLE-1 or EAGLE-3 head (`eagle_head`) drafting from the target's hidden states, every
held sequence's rows in one batched forward per step, its keys and values in a slot per sequence."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from draft_service.drafter import Proposal, check_proposal
from draft_service.eagle_graphs import ChainGraphs, KnownRows, greedy_chain
from draft_service.eagle_head import EagleHead, HeadCache, HeadSpec, SlotRun
from minedraft.engine.attention import avoid_cudnn_attention
from minedraft.engine.sampling import SamplingConfig
from minedraft.errors import CapacityError, InvalidRequest

log = logging.getLogger(__name__)

# The slots' first length of keys (`HeadCache` doubles it as sequences outgrow it), at most the target's own.
INITIAL_CACHE_POSITIONS = 256
# A forward of rows padded to the longest runs at most twice their positions, or this many (a proposal's rows
# of 1 to k + 1 positions always run together).
PADDED_POSITIONS_FLOOR = 4096
MAX_DRAFT_ROOM = 64  # positions past max_len the cache grows to at once, for drafts


@dataclass
class HeadSequence:
    """One sequence's state in the head: its tokens, the target's features not yet run (each waits for the token
    after its position), its slot of the head's keys and values (`cached` keys, those of the positions up to
    `kv_len` it ran: on the target's features, or on the head's own output where none came), whether it ran any
    (its output at position kv_len - 1 is then its slot's row of `EagleProposer.outputs`), and its last proposal."""

    tokens: list[int]
    slot: int
    features: list[torch.Tensor] = field(default_factory=list)  # [n, H] blocks of positions kv_len ..
    kv_len: int = 0
    cached: int = 0  # kv_len less the positions left out (before the first state that came)
    ran: bool = False
    last_drafts: list[int] = field(default_factory=list)


@dataclass
class _Rows:
    """One batched forward's rows: each a sequence and the positions it runs (`count`) from its `kv_len`."""

    sequences: list[HeadSequence]
    counts: list[int]


def _keep_drafts(sequences: Sequence[HeadSequence], drafts: torch.Tensor) -> None:
    """Each sequence's drafts, read to the host (what its next proposal extends its tokens by)."""
    for sequence, row in zip(sequences, drafts.tolist(), strict=True):
        sequence.last_drafts = row


class EagleProposer:
    """The EAGLE drafter (`Drafter`): per sequence, the head's keys and values for every position whose target
    hidden state it has run, rolled back after each proposal to those (the drafted positions ran on the head's own
    hidden states: their keys, written past `cached`, are overwritten by the next). The target's hidden states come
    through `add_hidden` before the call that needs them: a prefill's, one per prompt position; a proposal's, one
    per position the last verify accepted, the verified token's included. A proposal runs every row at once: one
    forward of all rows' known positions, then k greedy steps with the argmax on the device (on CUDA, in steady
    state, both as one graph), the drafts copied to the host once. Greedy drafts: q is one-hot (lossless, as any
    greedy draft)."""

    def __init__(
        self,
        head: EagleHead,
        spec: HeadSpec,
        num_slots: int,
        max_len: int | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        """`max_len`: the target's longest sequence, where known (the cache starts at most that long and grows no
        longer than it needs past it). `cuda_graphs`: on CUDA, the k draft steps run as CUDA graphs (`ChainGraphs`);
        False (--eager): eagerly, as on the CPU."""
        self.head, self.spec, self.num_slots = head, spec, num_slots
        self.device, self.dtype = head.fc.weight.device, head.fc.weight.dtype
        avoid_cudnn_attention(self.device)  # (the head's attention shapes change every call)
        attn = head.self_attn
        capacity = min(INITIAL_CACHE_POSITIONS, max_len or INITIAL_CACHE_POSITIONS)
        # (a sequence of max_len tokens drafts k past it: the limit leaves room for that, not for doubling again)
        limit = None if max_len is None else max_len + MAX_DRAFT_ROOM
        # One slot more than the sequences': the scratch slot (`num_slots`), where a graph's padding rows run.
        slots = num_slots + 1
        self.cache = HeadCache(slots, attn.kv_heads, attn.head_dim, self.dtype, self.device, capacity, limit)
        # Each slot's last output (position kv_len - 1): the hidden state its next self-fed position or draft reads.
        self.outputs = torch.zeros(slots, head.fc.out_features, dtype=self.dtype, device=self.device)
        self.sequences: dict[int, HeadSequence] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._waiting: dict[int, list[torch.Tensor]] = {}  # hidden states that came before their sequence
        graphed = cuda_graphs and self.device.type == "cuda"
        self.graphs = ChainGraphs(head, self.cache, self.outputs, num_slots) if graphed else None

    @torch.inference_mode()
    def add_states(self, row_seq_ids: Sequence[int], rows: torch.Tensor, admitting: bool = False) -> None:
        """The target's hidden states as the channel brings them: rows of several sequences, each labelled with its
        sequence's id, each sequence's in position order (`admitting`: a prefill's, for sequences it admits next)."""
        order: dict[int, list[int]] = {}
        for index, seq_id in enumerate(row_seq_ids):
            order.setdefault(seq_id, []).append(index)
        picked = [i for indices in order.values() for i in indices]
        grouped = rows if picked == list(range(len(rows))) else rows[torch.tensor(picked, device=rows.device)]
        self._take(list(order), [len(indices) for indices in order.values()], grouped, admitting)

    @torch.inference_mode()
    def add_hidden(self, seq_ids: Sequence[int], hidden: Sequence[torch.Tensor], admitting: bool = False) -> None:
        """The target's hidden states [n, len(layers) * H_target] of each sequence's next positions; those of a
        sequence not held are dropped (it finished in the verify that made them), unless `admitting`."""
        if len(seq_ids) != len(hidden):
            raise ValueError(f"{len(seq_ids)} sequence ids for {len(hidden)} blocks of hidden states")
        if hidden:
            self._take(list(seq_ids), [len(rows) for rows in hidden], torch.cat(list(hidden)), admitting)

    def _take(self, seq_ids: list[int], counts: list[int], rows: torch.Tensor, admitting: bool) -> None:
        """Each sequence's `counts` consecutive `rows`, through the head's `fc` at once, to its pending features."""
        kept = [i for i, seq_id in enumerate(seq_ids) if admitting or seq_id in self.sequences]
        if not kept:
            return
        if len(kept) < len(seq_ids):
            offsets = [sum(counts[:i]) for i in range(len(counts))]
            picked = [offsets[i] + j for i in kept for j in range(counts[i])]
            rows = rows[torch.tensor(picked, device=rows.device)]
        features = self.head.features(rows.to(self.device, self.dtype))
        for i, block in zip(kept, features.split([counts[i] for i in kept]), strict=True):
            sequence = self.sequences.get(seq_ids[i])
            if sequence is None:
                self._waiting.setdefault(seq_ids[i], []).append(block)
            else:
                sequence.features.append(block)

    @torch.inference_mode()
    def prefill(
        self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]
    ) -> list[int]:
        held = [s for s in seq_ids if s in self.sequences]
        if held or len(set(seq_ids)) != len(seq_ids):
            raise InvalidRequest(f"sequence ids already held: {held or list(seq_ids)}")
        if len(self.sequences) + len(seq_ids) > self.num_slots:
            raise CapacityError(f"need {len(seq_ids)} sequence rows, {self.num_slots - len(self.sequences)} free")
        try:
            admitted = []
            for seq_id, prompt in zip(seq_ids, prompts, strict=True):
                sequence = HeadSequence(list(prompt), self._free_slots.pop(), self._waiting.pop(seq_id, []))
                count = sum(len(f) for f in sequence.features)
                if count:  # states of the prompt's last positions only (a bounded reverse buffer): the rest left out
                    sequence.kv_len = max(0, len(prompt) - count)
                self.sequences[seq_id] = sequence
                admitted.append(sequence)
            self._run_found(self._known(admitted))
        finally:
            self._waiting.clear()  # (states of a prefill that failed go with it)
        return [0] * len(seq_ids)

    @torch.inference_mode()
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
        check_proposal(seq_ids, self.sequences, k)
        sequences = [self.sequences[seq_id] for seq_id in seq_ids]
        for b, (sequence, accepted, token) in enumerate(zip(sequences, num_accepted.tolist(), next_tokens.tolist())):
            sequence.tokens += sequence.last_drafts[:accepted] + (list(missed[b]) if missed else []) + [token]
        # Per row in this order (rows apart): the gap before the states that came, then those, then what follows.
        gaps = [(sequence, start) for sequence in sequences if (start := self._align(sequence)) is not None]
        self._run_self_fed([s for s, _ in gaps], [start for _, start in gaps])
        found = self._known(sequences)
        drafts = self._graphed_proposal(sequences, found, k)
        if drafts is not None and defer_upkeep:  # (every row drafted: their host copy waits until after the reply)
            return Proposal(drafts, None, upkeep=functools.partial(_keep_drafts, sequences, drafts))
        if drafts is None:
            self._run_found(found)
            self._run_self_fed(sequences, [len(s.tokens) - 1 for s in sequences])
            ready = [sequence for sequence in sequences if sequence.ran]
            drafts = self._chain(ready, k) if ready else None
        drafted = iter(drafts.tolist() if drafts is not None else [])
        rows = []
        for seq_id, sequence in zip(seq_ids, sequences, strict=True):
            if sequence.ran:
                sequence.last_drafts = next(drafted)
            else:  # no state of the target yet (a draft back after a loss): any valid id
                if not sequence.last_drafts:
                    log.warning("sequence %d: no hidden states of the target yet; drafting its last token", seq_id)
                sequence.last_drafts = [sequence.tokens[-1]] * k
            rows.append(sequence.last_drafts)
        return Proposal(torch.tensor(rows, dtype=torch.long, device=self.device), None)

    def _align(self, sequence: HeadSequence) -> int | None:
        """The states that came are those of the sequence's last positions but its newest token's (a verify's: the
        positions it kept; a prefill's: the prompt's): positions before them that no state came for run on the
        head's own output (returns where they end, for `_run_self_fed`), or, with none yet (a sequence admitted
        without its prompt's states: a draft back after a loss), are left out of the head's keys; states of
        positions already run are dropped."""
        count = sum(len(f) for f in sequence.features)
        start = len(sequence.tokens) - 1 - count
        if start < sequence.kv_len:
            features = torch.cat(sequence.features)[sequence.kv_len - start :]
            sequence.features = [features] if len(features) else []
        elif start > sequence.kv_len:
            if sequence.ran:
                return start
            sequence.kv_len = start
        return None

    def _known(self, sequences: Sequence[HeadSequence]) -> list[tuple[HeadSequence, int, torch.Tensor]]:
        """Each sequence's positions whose target feature and next token are both known (taken from its features):
        (sequence, count, features)."""
        found: list[tuple[HeadSequence, int, torch.Tensor]] = []
        for sequence in sequences:
            if not sequence.features:
                continue
            features = torch.cat(sequence.features) if len(sequence.features) > 1 else sequence.features[0]
            runnable = min(len(features), len(sequence.tokens) - 1 - sequence.kv_len)
            if runnable <= 0:
                continue
            found.append((sequence, runnable, features[:runnable]))
            sequence.features = [features[runnable:]] if runnable < len(features) else []
        return found

    def _run_found(self, found: list[tuple[HeadSequence, int, torch.Tensor]]) -> None:
        """Run the head on the known positions: all rows in one forward, unless their lengths differ so much (a
        prefill's prompts) that padding every row to the longest would more than double the positions run: then in
        groups of similar lengths, longest first."""
        found.sort(key=lambda row: -row[1])
        group: list[tuple[HeadSequence, int, torch.Tensor]] = []
        for index, row in enumerate(found):
            group.append(row)
            following = found[index + 1] if index + 1 < len(found) else None
            real = sum(count for _, count, _ in group)
            padded = group[0][1] * (len(group) + 1)  # (with the next row)
            if following is None or padded > max(PADDED_POSITIONS_FLOOR, 2 * (real + following[1])):
                rows = _Rows([s for s, _, _ in group], [count for _, count, _ in group])
                self._forward(rows, torch.cat([block for _, _, block in group]))
                group = []

    def _graphed_proposal(
        self, sequences: Sequence[HeadSequence], found: list[tuple[HeadSequence, int, torch.Tensor]], k: int
    ) -> torch.Tensor | None:
        """A proposal in steady state as one graph (`ChainGraphs` with `KnownRows`): each row's known positions (k +
        1 at most), then its drafts. None where it does not fit (no graphs, more positions, a row still behind its
        tokens after them or with nothing to draft from): the caller runs it in steps."""
        if self.graphs is None:
            return None
        counts = {id(sequence): count for sequence, count, _ in found}
        for sequence in sequences:
            count = counts.get(id(sequence), 0)
            if count > k + 1 or sequence.kv_len + count != len(sequence.tokens) - 1 or not (sequence.ran or count):
                return None
        known = KnownRows(
            [counts.get(id(s), 0) for s in sequences],
            [s.tokens[s.kv_len + 1 : s.kv_len + 1 + counts.get(id(s), 0)] for s in sequences],
            torch.cat([block for _, _, block in found]) if found else None,  # (`_known` keeps the rows' order)
        )
        try:
            drafts = self.graphs.drafts(sequences, k, known)
        except RuntimeError as exc:
            self._draft_eagerly(exc)
            return None
        for sequence, count in zip(sequences, known.counts, strict=True):
            sequence.kv_len, sequence.cached, sequence.ran = sequence.kv_len + count, sequence.cached + count, True
        return drafts

    def _run_self_fed(self, sequences: Sequence[HeadSequence], ends: Sequence[int]) -> None:
        """Positions the target sent no hidden states for (tokens decoded while no proposal was asked for: the
        coordinator's spells without drafts, a draft back after a loss), up to each row's end, run on the head's
        own last output, as its drafted positions do: a weaker guess, still verified by the target, and kept (no
        state will come for them). One position of every such row per forward."""
        while True:
            behind = [s for s, end in zip(sequences, ends, strict=True) if s.ran and s.kv_len < end]
            if not behind:
                return
            self._forward(_Rows(behind, [1] * len(behind)), None)

    def _forward(self, rows: _Rows, hidden: torch.Tensor | None) -> None:
        """One batched forward of `rows`, each running its next `count` positions (on `hidden`, the rows' features
        one after another; None: one position each on its own last output), kept: `kv_len` and `cached` advance,
        the last output of each is remembered."""
        width, batch = max(rows.counts), len(rows.sequences)
        tokens: list[int] = []
        positions: list[int] = []
        limits: list[int] = []
        valid: list[int] = []
        last: list[int] = []
        for b, (sequence, count) in enumerate(zip(rows.sequences, rows.counts, strict=True)):
            ahead = sequence.tokens[sequence.kv_len + 1 : sequence.kv_len + 1 + count]
            tokens += ahead + [0] * (width - count)  # (a padded query's token: any id)
            positions += range(sequence.kv_len, sequence.kv_len + width)
            limits += range(sequence.cached, sequence.cached + width)
            valid += range(b * width, b * width + count)
            last.append(b * width + count - 1)
        slots = [sequence.slot for sequence in rows.sequences]
        # All of the forward's indices in one copy to the device.
        packed = torch.tensor(tokens + positions + limits + slots + last + valid, device=self.device)
        flat = batch * width
        tokens_t, positions_t, limits_t = (packed[i * flat : (i + 1) * flat].view(batch, width) for i in range(3))
        slots_t, last_t, valid_t = packed[3 * flat :].split([batch, batch, len(valid)])
        padded = len(valid) < flat
        if hidden is None:
            hidden = self.outputs[slots_t]
        elif padded:
            hidden = hidden.new_zeros(flat, hidden.shape[-1]).index_copy(0, valid_t, hidden)
        length = max(s.cached + n for s, n in zip(rows.sequences, rows.counts, strict=True))
        self.cache.reserve(length)
        run = SlotRun(slots_t, positions_t, limits_t, length, valid_t if padded else None)
        out = self.head.forward_slots(tokens_t, hidden.view(batch, width, -1), self.cache, run)
        self.outputs[slots_t] = out.reshape(flat, -1)[last_t]
        for sequence, count in zip(rows.sequences, rows.counts, strict=True):
            sequence.kv_len, sequence.cached, sequence.ran = sequence.kv_len + count, sequence.cached + count, True

    def _chain(self, sequences: Sequence[HeadSequence], k: int) -> torch.Tensor:
        """k greedy drafts per row [B, k] (on the device): each from the last output, then run on the head's own
        hidden state, all rows at once; their keys go past each slot's `cached` (the next proposal overwrites them,
        as the target's states replace them). On CUDA, as a graph (`ChainGraphs`)."""
        if self.graphs is not None:
            try:
                return self.graphs.drafts(sequences, k)
            except RuntimeError as exc:
                self._draft_eagerly(exc)
        meta = torch.tensor([[s.slot, s.kv_len, s.cached] for s in sequences], device=self.device)
        reach = max(s.cached for s in sequences)
        self.cache.reserve(reach + k - 1)
        return greedy_chain(self.head, self.cache, self.outputs, meta, k, [reach + step + 1 for step in range(k)])

    def _draft_eagerly(self, exc: RuntimeError) -> None:
        """A head whose steps cannot be captured still drafts, eagerly, from now on."""
        log.warning("CUDA graph of the EAGLE head failed, drafting eagerly from now on: %s", exc)
        self.graphs = None

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            sequence = self.sequences.pop(seq_id, None)
            if sequence is not None:
                self._free_slots.append(sequence.slot)
            self._waiting.pop(seq_id, None)

    def held_seq_ids(self) -> list[int]:
        return list(self.sequences)

    @torch.inference_mode()
    def precapture(self, k: int, max_batch: int) -> int:
        """The draft chains' graphs of k drafts for every batch up to `max_batch` at the cache's key lengths now
        (others are captured at first use); none on the CPU or eagerly."""
        if self.graphs is None:
            return 0
        try:
            return self.graphs.precapture(k, min(max_batch, self.num_slots))
        except RuntimeError as exc:
            self._draft_eagerly(exc)
            return 0
