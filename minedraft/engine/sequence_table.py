"""The sequences a worker holds: id -> row, their decoding parameters as row-indexed tensors, their prefills."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import torch

from minedraft.engine.model_runner import ModelRunner, StepBody
from minedraft.engine.sampling import (
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    Penalties,
    SamplingConfig,
    SamplingKind,
    seed_key,
)
from minedraft.errors import InvalidRequest, UnknownSequenceError

# A prefill forward's fixed cost, in prompt tokens: on an H200 one prompt of 512 tokens took 46.7 ms where each of 16
# took 16.2 ms, about 1000 tokens' worth more.
PREFILL_FORWARD_COST = 1024


def prefill_groups(lengths: Sequence[int], forward_cost: int) -> list[list[int]]:
    """Indices of the prompts to prefill together, each group padded to its longest: of the splits of the prompts
    sorted by length, the one that computes the fewest tokens, padding included, at `forward_cost` tokens a forward.
    Prompts of similar lengths share a forward; one long prompt among short ones gets its own. Each group lists its
    prompts in their order."""
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    # Groups start only where the length changes: a group's tail of prompts as long as the next group's first costs
    # no more in that group (padded to their own length), so the split runs over distinct lengths, not prompts.
    starts = [j for j in range(len(order)) if j == 0 or lengths[order[j]] != lengths[order[j - 1]]]
    # best[j]: (cost, start of the last group) of the cheapest split of the j longest prompts
    best = {0: (0, 0)}
    for b, j in enumerate(starts[1:] + [len(order)], start=1):
        best[j] = min((best[i][0] + forward_cost + (j - i) * lengths[order[i]], i) for i in starts[:b])
    groups, end = [], len(order)
    while end:
        start = best[end][1]
        groups.append(sorted(order[start:end]))  # one group: the prompts as they came
        end = start
    return groups[::-1]


def prefix_followers(
    keys: Sequence[Sequence[bytes]], cached: Sequence[int], block_size: int, forward_cost: int
) -> set[int]:
    """Of prompts prefilled together (`keys`: the prefix cache keys of each one's full blocks, of which its first
    `cached` are cached), the indices of those to prefill after the others: in each family of prompts whose first
    uncached block is the same, all but the one with the most uncached blocks in common with the rest, which
    computes them once for the others to share. None where that saves no more tokens than a forward costs."""
    uncached = [k[c:] for k, c in zip(keys, cached)]
    families: dict[bytes, list[int]] = collections.defaultdict(list)
    for i, rest in enumerate(uncached):
        if rest:
            families[rest[0]].append(i)
    holders = collections.Counter(key for rest in uncached for key in rest)
    later: set[int] = set()
    saved = 0
    for members in families.values():
        if len(members) < 2:
            continue
        leader = max(members, key=lambda i: sum(holders[key] - 1 for key in uncached[i]))  # (the first of equals)
        computed = set(uncached[leader])
        for i in members:
            if i != leader:
                later.add(i)
                saved += sum(key in computed for key in uncached[i])  # (keys chain: a run from the start)
    return later if saved * block_size > forward_cost else set()


class SequenceTable:
    """Maps sequence ids to rows and keeps per-row parameters where batched tensor code can gather them."""

    def __init__(self, runner: ModelRunner, eos_token_ids: Sequence[int] = ()) -> None:
        self.runner = runner
        slots, device = runner.num_slots, runner.device
        self.rows_by_id: dict[int, int] = {}
        self.configs_by_id: dict[int, SamplingConfig] = {}  # on the host: batch-wide choices without a device sync
        # Rows up to the runner's scratch row: padding rows of a step's graph read and write theirs.
        slots += 1
        self.temperature = torch.zeros(slots, device=device)
        self.top_p = torch.ones(slots, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.long, device=device)
        self.seed_key = torch.zeros(slots, dtype=torch.long, device=device)  # sampling.seed_key of each seed
        self.max_tokens = torch.zeros(slots, dtype=torch.long, device=device)
        self.generated = torch.zeros(slots, dtype=torch.long, device=device)
        self.ignore_eos = torch.zeros(slots, dtype=torch.bool, device=device)
        self.stop_ids = torch.full((slots, MAX_STOP_TOKEN_IDS), -1, dtype=torch.long, device=device)
        self.min_p = torch.zeros(slots, device=device)
        self.repetition = torch.ones(slots, device=device)
        self.presence = torch.zeros(slots, device=device)
        self.frequency = torch.zeros(slots, device=device)
        self.min_tokens = torch.zeros(slots, dtype=torch.long, device=device)
        self.bias_ids = torch.full((slots, MAX_LOGIT_BIAS), -1, dtype=torch.long, device=device)  # -1: none
        self.bias = torch.zeros(slots, MAX_LOGIT_BIAS, device=device)
        self.output_start = torch.zeros(slots, dtype=torch.long, device=device)
        self.eos = torch.tensor(sorted(set(eos_token_ids)) or [-1], dtype=torch.long, device=device)
        # Each row's tokens, prompt and output, that penalties count: made when the first penalized sequence comes
        # (slots x max_len ids), with a last column that writes past a row's end go to.
        self.history: torch.Tensor | None = None
        self.max_tokens[runner.scratch_row] = 1 << 62  # the scratch row never finishes
        # What a batch's steps ask of the table again and again while its members stay (a batch id or None -> its
        # sequence ids, their rows, the rows as a host tensor; sequence ids -> their sampling kind): forgotten
        # whenever a sequence comes or goes. Host time before a step's launch leaves the GPU idle.
        self._rows_of_batch: dict[int | None, tuple[tuple[int, ...], list[int], torch.Tensor]] = {}
        self._kinds: dict[tuple[int, ...], SamplingKind] = {}

    def __len__(self) -> int:
        return len(self.rows_by_id)

    def add(self, seq_ids: Sequence[int], configs: Sequence[SamplingConfig]) -> torch.Tensor:
        duplicates = [s for s in seq_ids if s in self.rows_by_id]
        if duplicates or len(set(seq_ids)) != len(seq_ids):
            raise InvalidRequest(f"sequence ids already held: {duplicates or list(seq_ids)}")
        for cfg in configs:
            if len(cfg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop token ids per request")
            if len(cfg.logit_bias) > MAX_LOGIT_BIAS or any(
                not 0 <= i < self.runner.vocab_size for i, _ in cfg.logit_bias
            ):
                raise InvalidRequest(f"a logit bias takes at most {MAX_LOGIT_BIAS} token ids of the vocabulary")
        rows = self.runner.allocate(len(seq_ids))
        self._forget_batches()
        self.rows_by_id.update(zip(seq_ids, rows))
        self.configs_by_id.update(zip(seq_ids, configs))
        index = torch.tensor(rows, dtype=torch.long, device=self.runner.device)

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.runner.device)

        self.temperature[index] = column([c.temperature for c in configs], torch.float32)
        self.top_p[index] = column([c.top_p for c in configs], torch.float32)
        self.top_k[index] = column([c.top_k for c in configs], torch.long)
        # Seeds are uint64 on the wire; fold them into int64's range bit for bit.
        self.seed_key[index] = seed_key(
            column([c.seed - (1 << 64) if c.seed >= 1 << 63 else c.seed for c in configs], torch.long)
        )
        self.max_tokens[index] = column([c.max_tokens for c in configs], torch.long)
        self.generated[index] = 0
        self.ignore_eos[index] = column([c.ignore_eos for c in configs], torch.bool)
        stops = [list(c.stop_token_ids) + [-1] * (MAX_STOP_TOKEN_IDS - len(c.stop_token_ids)) for c in configs]
        self.stop_ids[index] = column(stops, torch.long).reshape(len(configs), MAX_STOP_TOKEN_IDS)
        self.min_p[index] = column([c.min_p for c in configs], torch.float32)
        self.repetition[index] = column([c.repetition_penalty for c in configs], torch.float32)
        self.presence[index] = column([c.presence_penalty for c in configs], torch.float32)
        self.frequency[index] = column([c.frequency_penalty for c in configs], torch.float32)
        self.min_tokens[index] = column([c.min_tokens for c in configs], torch.long)
        if any(c.logit_bias for c in configs):
            padded = [list(c.logit_bias) + [(-1, 0.0)] * (MAX_LOGIT_BIAS - len(c.logit_bias)) for c in configs]
            self.bias_ids[index] = column([[i for i, _ in row] for row in padded], torch.long)
            self.bias[index] = column([[b for _, b in row] for row in padded], torch.float32)
        else:  # (a row's earlier sequence may have left its bias)
            self.bias_ids[index] = -1
        if self.history is None and any(c.penalized for c in configs):
            self.history = torch.zeros(self.temperature.shape[0], self.runner.max_len + 1, dtype=torch.int32)
            self.history = self.history.to(self.runner.device)
        return index

    def write_history(self, rows: list[int], starts: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        """On the host: each row's `tokens` from sequence index `start` on, where penalties will count them."""
        if self.history is None:
            return
        for row, start, ids in zip(rows, starts, tokens, strict=True):
            if ids:
                self.history[row, start : start + len(ids)] = torch.tensor(ids, dtype=torch.int32)

    def record_history(
        self, rows: torch.Tensor, first: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor
    ) -> None:
        """Inside a step: each row's first `count` of `tokens` [B, n] at sequence indices from `first` [B] on."""
        assert self.history is not None
        n, end = tokens.shape[1], self.history.shape[1] - 1
        index = first[:, None] + torch.arange(n, device=tokens.device)
        index = torch.where(torch.arange(n, device=tokens.device) < count[:, None], index, end).clamp(0, end)
        self.history[rows[:, None], index] = tokens.to(torch.int32)

    def penalties(self, rows: torch.Tensor) -> Penalties:
        """The penalty parameters of `rows`; what min_tokens masks: the stop ids and EOS, unless ignored."""
        eos = self.eos[None, :].expand(len(rows), -1)
        eos = torch.where(self.ignore_eos[rows][:, None], torch.full_like(eos, -1), eos)
        return Penalties(
            repetition=self.repetition[rows],
            presence=self.presence[rows],
            frequency=self.frequency[rows],
            min_tokens=self.min_tokens[rows],
            output_start=self.output_start[rows],
            stop_ids=torch.cat([eos, self.stop_ids[rows]], dim=1),
            bias_ids=self.bias_ids[rows],
            bias=self.bias[rows],
        )

    def prefill(
        self,
        seq_ids: Sequence[int],
        prompts: Sequence[Sequence[int]],
        configs: Sequence[SamplingConfig],
        *,
        kind: str,
        body: StepBody,
        on_rows: Callable[[torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[int]]:
        """Take rows for new sequences and cache their prompts: each starts with the cached blocks its prompt begins
        with (prefix caching), then a step of `kind` per group of the rest of similar lengths (`prefill_groups`),
        padded to its longest, whose `body` runs the forward and makes what it will of the logits after each
        prompt's last token (`ModelRunner.prepare`, `last_only`). Prompts that share blocks not cached yet go in
        rounds (`prefix_followers`): one of each such family first, then the others, sharing what it cached.

        Returns (rows, prompt lengths, what the bodies made in the order of `prompts`, the prompt tokens of each
        found cached, not computed for it); on failure the rows and their blocks are freed. `on_rows` is told the
        rows taken, in the order of `prompts`, before any step.
        """
        if not prompts:
            raise InvalidRequest("a prefill needs at least one prompt")
        rows = self.add(seq_ids, configs)
        try:
            if on_rows is not None:
                on_rows(rows)
            cache, device = self.runner.cache, self.runner.device
            assert cache.pool is not None
            host_rows = rows.tolist()
            starts = [len(p) - c.output_tokens for p, c in zip(prompts, configs)]
            self.output_start[rows] = torch.tensor(starts, dtype=torch.long, device=device)
            self.write_history(host_rows, [0] * len(prompts), prompts)
            # (A prompt whose log-probabilities are asked is computed whole: cached blocks have no logits.)
            keys = [
                cache.prefix_keys(p) if cache.pool.prefix_caching and c.prompt_logprobs is None else []
                for p, c in zip(prompts, configs)
            ]
            cached = [cache.share_prefix(row, p, k) for row, p, k in zip(host_rows, prompts, keys)]
            pending, order, parts = list(range(len(prompts))), [], []
            while pending:
                size = cache.block_size
                later = prefix_followers(
                    [keys[i] for i in pending], [cached[i] // size for i in pending], size, PREFILL_FORWARD_COST
                )
                now = [i for j, i in enumerate(pending) if j not in later]
                pending = [i for j, i in enumerate(pending) if j in later]
                for group, part in self._prefill_round(rows, host_rows, prompts, cached, now, kind=kind, body=body):
                    order += group
                    parts.append(part)
                for i in pending:  # the blocks the round cached
                    cached[i] = cache.share_prefix(host_rows[i], prompts[i], keys[i], again=True)
            outputs = parts[0]
            if len(parts) > 1:  # back in the prompts' order
                back = torch.tensor(order, device=device).argsort()
                outputs = [torch.cat(part)[back] for part in zip(*parts, strict=True)]
        except Exception:
            self.remove(seq_ids)
            raise
        return rows, torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device), outputs, cached

    def _prefill_round(
        self,
        rows: torch.Tensor,
        all_rows: list[int],
        prompts: Sequence[Sequence[int]],
        cached: Sequence[int],
        now: list[int],
        *,
        kind: str,
        body: StepBody,
    ) -> list[tuple[list[int], list[torch.Tensor]]]:
        """Prefill prompts `now` (indices into `prompts`, on `rows`, `all_rows` on the host) past their `cached`
        tokens, then cache their full blocks: per group of similar lengths the group's indices and what its body
        made."""
        cache, device = self.runner.cache, self.runner.device
        host_rows = [all_rows[i] for i in now]
        cache.reserve(host_rows, [len(prompts[i]) for i in now])
        index = torch.tensor(now, device=device)
        cache.lengths[rows[index]] = torch.tensor([cached[i] for i in now], dtype=torch.long, device=device)
        rests = {i: prompts[i][cached[i] :] for i in now}
        results = []
        for positions in prefill_groups([len(rests[i]) for i in now], PREFILL_FORWARD_COST):
            group = [now[p] for p in positions]
            longest = max(len(rests[i]) for i in group)
            ids = torch.zeros(len(group), longest, dtype=torch.long)
            for b, i in enumerate(group):
                ids[b, : len(rests[i])] = torch.tensor(rests[i], dtype=torch.long)
            index = torch.tensor(group, device=device)
            step = self.runner.prepare(
                kind=kind,
                rows=rows[index],
                inputs=(ids.to(device), torch.tensor([len(rests[i]) for i in group], device=device)),
                needed=max(len(prompts[i]) for i in group),
                tokens=longest,
                last_only=True,
            )
            results.append((group, self.runner.run(step, body)))
        for row, i in zip(host_rows, now):
            cache.register_prompt(row, prompts[i])
        return results

    def row_list(self, seq_ids: Sequence[int]) -> list[int]:
        missing = [s for s in seq_ids if s not in self.rows_by_id]
        if missing:
            raise UnknownSequenceError(f"unknown sequence ids {missing[:8]}")
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidRequest("a step lists a sequence id more than once")
        return [self.rows_by_id[s] for s in seq_ids]

    def batch_rows(self, seq_ids: Sequence[int], batch_id: int | None) -> tuple[list[int], torch.Tensor]:
        """The rows of a batch's step: a list, and a host tensor that a step copies straight into its graph's
        inputs (kept per batch while its members stay)."""
        ids = tuple(seq_ids)
        known = self._rows_of_batch.get(batch_id)
        if known is None or known[0] != ids:
            rows = self.row_list(seq_ids)
            known = self._rows_of_batch[batch_id] = (ids, rows, torch.tensor(rows, dtype=torch.long))
        return known[1], known[2]

    def remove(self, seq_ids: Sequence[int]) -> list[int]:
        """Free the rows of `seq_ids` and return them; ids not held are ignored (release is idempotent)."""
        self._forget_batches()
        rows = [self.rows_by_id.pop(s) for s in seq_ids if s in self.rows_by_id]
        for s in seq_ids:
            self.configs_by_id.pop(s, None)
        self.runner.release(rows)
        return rows

    def sampling_kind(
        self, seq_ids: Sequence[int], vocab: int, configs: Sequence[SamplingConfig] | None = None
    ) -> SamplingKind:
        """Whether every sequence is greedy and whether some sequence is restricted by top-k or top-p, known on the
        host; `configs`: of sequences not held yet."""
        if configs is None:
            ids = tuple(seq_ids)
            if ids not in self._kinds:
                if len(self._kinds) >= 8:  # a batch's ids repeat; a caller varying them must not grow this
                    self._kinds.clear()
                self._kinds[ids] = self.sampling_kind(ids, vocab, [self.configs_by_id[s] for s in ids])
            return self._kinds[ids]
        return SamplingKind(
            all_greedy=all(c.greedy for c in configs),
            filtered=any(0 < c.top_k < vocab or c.top_p < 1 or c.min_p > 0 for c in configs),
            penalized=any(c.penalized for c in configs),
            logprobs=any(c.logprobs is not None for c in configs),
            grammar=any(c.grammar is not None for c in configs),
        )

    def _forget_batches(self) -> None:
        self._rows_of_batch.clear()
        self._kinds.clear()
