"""Paged KV cache: after rollback a row holds exactly the K/V of its committed tokens; rows are reused; capacity."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

from draft_service.proposer import Proposer, committed_after, kept_and_tail
from minedraft.engine.model_runner import CapacityError, ModelRunner
from minedraft.engine.sampling import SamplingConfig, SamplingKind
from minedraft_app.offline import OfflineRequest, generate_offline
from target_service.verifier import FINISHED_LENGTH, RUNNING, Verifier

pytestmark = pytest.mark.usefixtures("single_thread")

ARCHS = ("llama", "qwen3", "mistral", "gpt2", "gpt_neox")
VOCAB = 128
ATOL = 1e-5


def fresh_state(model: PreTrainedModel, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K/V per layer of one prefill of `tokens` into a new cache (the reference a rolled-back row must equal)."""
    runner = ModelRunner(model, 1, 128)
    rows = torch.tensor(runner.allocate(1))
    runner.forward(rows, torch.tensor([tokens]), torch.tensor([len(tokens)]))
    return runner.cache.rows_state(int(rows[0]))


def assert_state_equal(
    got: list[tuple[torch.Tensor, torch.Tensor]], want: list[tuple[torch.Tensor, torch.Tensor]], what: str
) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} layers, expected {len(want)}"
    for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(got, want)):
        assert k.shape == k_ref.shape, f"{what}, layer {layer}: keys {tuple(k.shape)} != {tuple(k_ref.shape)}"
        for name, x, ref in (("keys", k, k_ref), ("values", v, v_ref)):
            error = float((x - ref).abs().max()) if x.numel() else 0.0
            assert error <= ATOL, f"{what}, layer {layer}: {name} differ from a fresh prefill by {error:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_equals_fresh_prefill(arch: str, tiny_models) -> None:
    """Step SD by hand with a draft that is partly rejected; after every propose and verify, each row's cache in
    both the draft and the target equals a fresh prefill of the tokens it should hold."""
    target = tiny_models.target(arch, vocab=VOCAB)
    draft = tiny_models.noisy_draft(arch, vocab=VOCAB)
    k, slots = 3, 6
    verifier = Verifier(ModelRunner(target, slots, 96), [])
    proposer = Proposer(ModelRunner(draft, slots, 96))
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 17, 8, 29)]
    seq_ids = [10, 11, 12, 13]
    configs = [SamplingConfig(max_tokens=64), SamplingConfig(max_tokens=64, temperature=1.0, seed=5)] * 2
    first = verifier.prefill(seq_ids, prompts, configs).per_row()
    proposer.prefill(seq_ids, prompts, configs)
    committed = {s: p + tokens for s, p, (tokens, _, _) in zip(seq_ids, prompts, first)}
    accepted = torch.zeros(len(seq_ids), dtype=torch.long)
    last = torch.tensor([tokens[-1] for tokens, _, _ in first])
    seen: set[int] = set()
    for _ in range(6):
        proposal = proposer.propose(seq_ids, accepted, last, k)
        drafts = proposal.draft_ids.tolist()
        for b, s in enumerate(seq_ids):
            # The draft cache: every committed token, then the drafts it ran to propose the next (d_1..d_{k-1}).
            row = proposer.table.rows_by_id[s]
            assert_state_equal(
                proposer.runner.cache.rows_state(row),
                fresh_state(draft, committed[s] + drafts[b][: k - 1]),
                f"draft seq {s}",
            )
            # The host's copies, from which a proposal finds its key length, follow the device's.
            assert proposer.committed_host[row] == len(committed[s]) == proposer.committed[row]
            assert proposer.last_k_host[row] == k == proposer.last_k[row]
        result = verifier.verify(seq_ids, proposal.draft_ids, proposal.draft_probs).per_row()
        for s, (tokens, a, finish) in zip(seq_ids, result):
            assert finish == RUNNING
            seen.add(a)
            committed[s] += tokens
            # The target cache: every committed token but the last, which is pending.
            row = verifier.table.rows_by_id[s]
            assert_state_equal(
                verifier.runner.cache.rows_state(row), fresh_state(target, committed[s][:-1]), f"target seq {s}"
            )
            # The host's copy, from which a verify finds its key length, follows the device's.
            assert verifier.cached[row] == len(committed[s]) - 1 == verifier.runner.cache.lengths[row]
        accepted = torch.tensor([a for _, a, _ in result])
        last = torch.tensor([tokens[-1] for tokens, _, _ in result])
    assert 0 in seen and any(0 < a < k for a in seen), f"drafts were not partly rejected: accepted counts {seen}"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_draft_that_missed_tokens_catches_up_as_if_prefilled_with_them(arch: str, tiny_models) -> None:
    """After steps decoded without drafts, a proposal is given the verdict on the row's last proposal and the tokens
    it missed: the row's cache then holds exactly what it should, and it drafts what a draft prefilled with all of
    it drafts (verdicts from none to all k accepted, a full accept leaving d_k to cache; 0 to 3 tokens missed)."""
    draft = tiny_models.noisy_draft(arch, vocab=VOCAB)
    k = 3
    proposer = Proposer(ModelRunner(draft, 4, 96))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 12, 7, 9)]
    seq_ids = [1, 2, 3, 4]
    configs = [SamplingConfig(max_tokens=64), SamplingConfig(max_tokens=64, temperature=1.0, seed=9)] * 2
    proposer.prefill(seq_ids, prompts, configs)
    cached = {s: list(p) for s, p in zip(seq_ids, prompts)}  # what each row's cache should hold, drafts aside
    nexts = [int(t) for t in torch.randint(0, VOCAB, (4,), generator=gen)]
    accepted: list[int] = [0] * 4
    missed: list[list[int]] = [[] for _ in seq_ids]
    # (verdict, tokens missed) per row after each proposal; nothing after the last.
    for plan in (([0, 3, 1, 2], [1, 2, 0, 3]), ([3, 0, 2, 3], [3, 1, 1, 0]), None):
        proposal = proposer.propose(seq_ids, torch.tensor(accepted), torch.tensor(nexts), k, missed=missed)
        drafts = proposal.draft_ids.tolist()
        for b, s in enumerate(seq_ids):
            cached[s] += missed[b] + [nexts[b]]
            row = proposer.table.rows_by_id[s]
            assert_state_equal(
                proposer.runner.cache.rows_state(row), fresh_state(draft, cached[s] + drafts[b][:-1]), f"draft seq {s}"
            )
            alone = Proposer(ModelRunner(draft, 1, 96))
            alone.prefill([s], [cached[s][:-1]], [configs[b]])
            again = alone.propose([s], torch.tensor([0]), torch.tensor([cached[s][-1]]), k)
            assert again.draft_ids[0].tolist() == drafts[b], f"seq {s} drafted otherwise than a fresh draft"
        if plan is None:
            break
        # The target's verdict on these drafts, then decode steps without drafts.
        verdicts, missed_counts = plan
        emitted = [[int(t) for t in torch.randint(0, VOCAB, (1 + m,), generator=gen)] for m in missed_counts]
        for b, s in enumerate(seq_ids):
            cached[s] += drafts[b][: verdicts[b]]
        accepted = verdicts
        missed, nexts = [tokens[:-1] for tokens in emitted], [tokens[-1] for tokens in emitted]


def test_a_verify_after_an_unread_result_asks_the_device(tiny_models) -> None:
    """A result never read (a call that failed after its step ran) leaves the host without its rows' lengths: the
    next verify reads them from the device, and emits what it would have."""
    model = tiny_models.target("llama", vocab=VOCAB)
    drafts = [torch.tensor([[5, 9, 2], [7, 7, 1]]), torch.tensor([[3, 3, 8], [4, 0, 6]])]
    outputs = []
    for read_first in (True, False):
        verifier = Verifier(ModelRunner(model, 2, 96), [])
        verifier.prefill([1, 2], [[4, 8, 15], [16, 23, 42, 4, 8]], [SamplingConfig(max_tokens=64)] * 2).per_row()
        first = verifier.verify([1, 2], drafts[0], None)
        if read_first:
            first.per_row()
        rows = [verifier.table.rows_by_id[s] for s in (1, 2)]
        assert all((verifier.cached[row] >= 0) == read_first for row in rows)
        outputs.append(verifier.verify([1, 2], drafts[1], None).per_row())
        assert [verifier.cached[row] for row in rows] == verifier.runner.cache.lengths[rows].tolist()
    assert outputs[0] == outputs[1]


def test_truncate_then_append_on_scattered_rows(tiny_models) -> None:
    """Runner level, rows out of order (the gather path): append, roll back, append again; K/V and logits equal a
    fresh single forward over the kept tokens, and the stale entries past a row's length are never read."""
    model = tiny_models.target("llama", vocab=VOCAB)
    runner = ModelRunner(model, 4, 64)
    runner.allocate(4)
    rows = torch.tensor([3, 1])
    gen = torch.Generator().manual_seed(2)
    a = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 11)]
    b = torch.randint(0, VOCAB, (2, 6), generator=gen)
    c = torch.randint(0, VOCAB, (2, 3), generator=gen)
    padded = torch.zeros(2, 11, dtype=torch.long)
    for i, p in enumerate(a):
        padded[i, : len(p)] = torch.tensor(p)
    runner.forward(rows, padded, torch.tensor([5, 11]))
    runner.forward(rows, b, torch.tensor([6, 6]))
    keep = torch.tensor([1, 4])  # tokens of b each row keeps
    runner.truncate(rows, torch.tensor([5, 11]) + keep)
    logits = runner.forward(rows, c, torch.tensor([3, 3]))
    for i, row in enumerate(rows.tolist()):
        tokens = a[i] + b[i, : keep[i]].tolist() + c[i].tolist()
        assert int(runner.cache.lengths[row]) == len(tokens)
        assert_state_equal(runner.cache.rows_state(row), fresh_state(model, tokens), f"row {row}")
        with torch.inference_mode():
            reference = model(torch.tensor([tokens])).logits[0, -3:]
        torch.testing.assert_close(logits[i], reference, atol=ATOL, rtol=1e-5)


def test_rows_are_reused_after_release(tiny_models) -> None:
    model = tiny_models.target("qwen3", vocab=VOCAB)
    runner = ModelRunner(model, 3, 64)
    rows = runner.allocate(3)
    assert sorted(rows) == [0, 1, 2] and runner.free_slots == 0
    with pytest.raises(CapacityError):
        runner.allocate(1)
    long_prompt = list(range(40))
    runner.forward(torch.tensor(rows), torch.tensor([long_prompt] * 3), torch.tensor([40, 40, 40]))
    runner.release([rows[1]])
    assert runner.free_slots == 1
    reused = runner.allocate(1)
    assert reused == [rows[1]]
    assert int(runner.cache.lengths[reused[0]]) == 0, "a reused row must start empty"
    # A shorter sequence in the reused row: the previous occupant's K/V past its length stays hidden.
    short = [7, 8, 9, 10, 11]
    logits = runner.forward(torch.tensor(reused), torch.tensor([short]), torch.tensor([5]))
    assert_state_equal(runner.cache.rows_state(reused[0]), fresh_state(model, short), "reused row")
    with torch.inference_mode():
        torch.testing.assert_close(logits[0], model(torch.tensor([short])).logits[0], atol=ATOL, rtol=1e-5)


def test_verifier_and_proposer_reuse_rows(tiny_models, hf_reference) -> None:
    """Twelve requests through two slots: every row is released and refilled several times, output stays exact."""
    target, draft = tiny_models.target("gpt2", vocab=VOCAB), tiny_models.noisy_draft("gpt2", vocab=VOCAB)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist() for n in torch.randint(2, 30, (12,))]
    budgets = [int(m) for m in torch.randint(1, 12, (12,), generator=gen)]
    requests = [OfflineRequest(p, SamplingConfig(max_tokens=m)) for p, m in zip(prompts, budgets)]
    verifier = Verifier(ModelRunner(target, 2, 64), [])
    proposer = Proposer(ModelRunner(draft, 2, 64))
    results = generate_offline(verifier, proposer, requests, 3, 2)
    assert [r.tokens for r in results] == [hf_reference(target, p, m) for p, m in zip(prompts, budgets)]
    assert verifier.runner.free_slots == 2 and proposer.runner.free_slots == 2
    verifier.release([0, 1, 999])  # releasing what is not held is a no-op
    assert verifier.runner.free_slots == 2


def test_prompt_too_long_raises_capacity_error_and_frees_the_row(tiny_models) -> None:
    model = tiny_models.target("llama", vocab=VOCAB)
    for worker in (Verifier(ModelRunner(model, 2, 16), []), Proposer(ModelRunner(model, 2, 16))):
        with pytest.raises(CapacityError):
            worker.prefill([1], [list(range(17))], [SamplingConfig()])
        assert worker.runner.free_slots == 2 and len(worker.table) == 0, "a failed prefill leaked its row"
        worker.prefill([1], [list(range(16))], [SamplingConfig()])  # exactly full still fits
        with pytest.raises(CapacityError):
            worker.prefill([2, 3], [[1], [2]], [SamplingConfig()] * 2)  # one free row, two sequences
        assert worker.runner.free_slots == 1 and len(worker.table) == 1


def test_growing_past_the_cache_raises_and_leaves_state_intact(tiny_models) -> None:
    model = tiny_models.target("mistral", vocab=VOCAB)
    verifier = Verifier(ModelRunner(model, 1, 16), [])
    verifier.prefill([1], [list(range(12))], [SamplingConfig(max_tokens=100)])  # caches 12 tokens
    state = verifier.runner.cache.rows_state(0)
    with pytest.raises(CapacityError):
        verifier.verify([1], torch.tensor([[1, 2, 3, 4]]), None)  # would write positions 12..16
    assert int(verifier.runner.cache.lengths[0]) == 12
    assert_state_equal(verifier.runner.cache.rows_state(0), state, "after the refused verify")
    tokens, _, _ = verifier.verify([1], torch.tensor([[1, 2, 3]]), None).per_row()[0]  # positions 12..15 fit
    assert 1 <= len(tokens) <= 4


def test_runner_length_capped_by_position_embeddings(tiny_models) -> None:
    model = tiny_models.target("gpt2", vocab=VOCAB, max_positions=32)
    runner = ModelRunner(model, 1, 1000)
    assert runner.max_len == 32
    rows = torch.tensor(runner.allocate(1))
    with pytest.raises(CapacityError):
        runner.forward(rows, torch.zeros(1, 33, dtype=torch.long), torch.tensor([33]))


@pytest.mark.parametrize("draft_kind", ["self", "noisy"])
def test_request_at_the_admission_limit_completes(draft_kind: str, tiny_models) -> None:
    """The coordinator admits prompt + max_tokens <= max_len - k: such a request must run to the end under SD
    without either cache overflowing (the last verify writes k tokens past the last committed one)."""
    target = tiny_models.target("llama", vocab=VOCAB)
    draft = target if draft_kind == "self" else tiny_models.noisy_draft("llama", vocab=VOCAB)
    max_len, k = 32, 3
    prompts = [list(range(1, 1 + n)) for n in (2, 9, 20)]
    requests = [OfflineRequest(p, SamplingConfig(max_tokens=max_len - k - len(p))) for p in prompts]
    verifier = Verifier(ModelRunner(target, 3, max_len), [])
    proposer = Proposer(ModelRunner(draft, 3, max_len))
    results = generate_offline(verifier, proposer, requests, k, 3)
    assert [len(r.tokens) for r in results] == [max_len - k - len(p) for p in prompts]
    assert all(r.finish == FINISHED_LENGTH for r in results)


def test_draft_with_a_narrower_vocabulary_accepts_any_target_token() -> None:
    """A target id beyond the draft's embedding (a padded target vocabulary) must not break the proposer."""
    import transformers

    from draft_service.proposer import Proposer
    from minedraft.engine.sampling import SamplingConfig

    config = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    draft = transformers.AutoModelForCausalLM.from_config(config).eval()
    proposer = Proposer(ModelRunner(draft, 2, 64))
    proposer.prefill([7], [[1, 2, 3]], [SamplingConfig(max_tokens=8)])
    proposal = proposer.propose([7], torch.tensor([0]), torch.tensor([120]), 3)  # 120: only the target knows it
    assert proposal.draft_ids.shape == (1, 3) and int(proposal.draft_ids.max()) < 100


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_paged_rows_keep_the_kv_of_a_fresh_prefill_through_growth_and_rollback(arch: str, tiny_models) -> None:
    """Rows that come and go, grow over many small blocks and roll back across block boundaries (as verifies do)
    hold exactly the K/V that a fresh prefill of their committed tokens gives, and only the blocks those need;
    once all are released every block is back."""
    model = tiny_models.target(arch, vocab=VOCAB)
    runner = ModelRunner(model, 6, 96, block_size=4, kv_cache_memory=0.01, prefix_caching=False)
    fresh = ModelRunner(model, 1, 96, block_size=4, kv_cache_memory=0.01, prefix_caching=False)
    rng = torch.Generator().manual_seed(5)
    tokens: dict[int, list[int]] = {}
    crossed = 0
    for _ in range(60):
        if tokens and torch.rand(1, generator=rng) < 0.15:  # a sequence finishes
            gone = list(tokens)[int(torch.randint(len(tokens), (1,), generator=rng))]
            runner.release([gone])
            del tokens[gone]
        if runner.free_slots and torch.rand(1, generator=rng) < 0.5:  # a new one, prefilled
            (row,) = runner.allocate(1)
            prompt = torch.randint(0, VOCAB, (int(torch.randint(2, 11, (1,), generator=rng)),), generator=rng)
            runner.forward(torch.tensor([row]), prompt[None], torch.tensor([len(prompt)]), last_only=True)
            tokens[row] = prompt.tolist()
        rows = [r for r in tokens if len(tokens[r]) + 4 < 96]
        if not rows:
            continue
        ids = torch.randint(0, VOCAB, (len(rows), 4), generator=rng)
        runner.forward(torch.tensor(rows), ids, torch.full((len(rows),), 4))
        for b, row in enumerate(rows):  # keep a random prefix of the 4, as an acceptance would
            keep = int(torch.randint(0, 5, (1,), generator=rng))
            before = len(tokens[row])
            crossed += (before + 4) // 4 != (before + keep) // 4
            tokens[row] += ids[b, :keep].tolist()
            runner.truncate(torch.tensor([row]), torch.tensor([len(tokens[row])]))
            runner.cache.trim([row], [len(tokens[row])])
            assert len(runner.cache.row_blocks[row]) == -(-len(tokens[row]) // 4), "blocks past the length held"
    assert crossed >= 10  # rollbacks did cross block boundaries
    for row, committed in tokens.items():
        (scratch,) = fresh.allocate(1)
        fresh.forward(torch.tensor([scratch]), torch.tensor([committed]), torch.tensor([len(committed)]))
        assert_state_equal(runner.cache.rows_state(row), fresh.cache.rows_state(scratch), f"row {row}")
        fresh.release([scratch])
    assert len(tokens) >= 2 and max(len(t) for t in tokens.values()) > 8 * 4  # rows over many blocks
    runner.release(list(tokens))
    assert runner.cache.pool is not None and runner.cache.pool.used == 0
    assert runner.free_blocks == runner.num_blocks


def test_shared_prompt_blocks_are_reused_and_give_the_same_tokens(tiny_models) -> None:
    """A second prompt starting with the first one's full blocks shares them (reference counts), prefills only the
    rest and decodes exactly what it decodes without the cache; released, the blocks stay cached, evictable."""
    model = tiny_models.target("llama", vocab=VOCAB)
    prefix = list(range(1, 40))
    outputs = []
    for caching in (True, False):
        verifier = Verifier(ModelRunner(model, 4, 128, block_size=8, kv_cache_memory=0.01, prefix_caching=caching), [])
        configs = [SamplingConfig(max_tokens=8)] * 2
        verifier.prefill([1], [prefix + [50, 51]], configs[:1]).per_row()
        second = verifier.prefill([2], [prefix + [60, 61, 62]], configs[:1])
        assert second.cached_tokens == ([32] if caching else [0])  # 4 full blocks of 8 of the 39 shared tokens
        tokens = [second.per_row()[0][0]]
        for _ in range(3):
            tokens.append(verifier.verify([2], torch.zeros(1, 0, dtype=torch.long), None).per_row()[0][0])
        outputs.append(tokens)
        pool = verifier.runner.cache.pool
        assert pool is not None
        verifier.release([1, 2])
        assert pool.used == 0 and pool.cached == (6 if caching else 0)  # 4 shared full blocks, one more each
        assert pool.stats.hit_tokens == (32 if caching else 0)
    assert outputs[0] == outputs[1]


def test_a_step_listing_a_sequence_twice_is_refused(tiny_models) -> None:
    verifier = Verifier(ModelRunner(tiny_models.target("llama", vocab=VOCAB), 4, 64), [])
    verifier.prefill([1, 2], [[3, 4, 5], [6, 7]], [SamplingConfig(max_tokens=8)] * 2)
    with pytest.raises(ValueError, match="more than once"):
        verifier.verify([1, 1], torch.tensor([[1, 2], [1, 2]]), None, batch_id=0)
    tokens, _, _ = verifier.verify([2, 1], torch.tensor([[1, 2], [1, 2]]), None, batch_id=0).per_row()[0]
    assert tokens  # the worker's state is intact


def test_a_batch_whose_sequences_come_and_go_steps_on_their_current_rows(tiny_models) -> None:
    """The table remembers a batch's rows between its steps; a sequence that leaves and comes back under its id
    (on another row) is looked up afresh."""
    verifier = Verifier(ModelRunner(tiny_models.target("llama", vocab=VOCAB), 4, 64), [])
    table = verifier.table
    verifier.prefill([1, 2], [[3, 4, 5], [6, 7]], [SamplingConfig(max_tokens=8)] * 2)
    verifier.verify([1, 2], torch.tensor([[1, 2], [1, 2]]), None, batch_id=0).per_row()
    first = table.batch_rows([1, 2], 0)[0]
    verifier.release([1])
    verifier.prefill([5], [[8, 9]], [SamplingConfig(max_tokens=8)])  # takes sequence 1's row
    verifier.prefill([1], [[3, 4, 5]], [SamplingConfig(max_tokens=8, temperature=1.0)])  # another row, sampled
    rows, host = table.batch_rows([1, 2], 0)
    assert rows == [table.rows_by_id[1], table.rows_by_id[2]] != first and host.tolist() == rows
    assert table.sampling_kind([1, 2], VOCAB) == SamplingKind(all_greedy=False, filtered=False)
    verifier.verify([1, 2], torch.tensor([[1, 2], [1, 2]]), None, batch_id=0).per_row()


def test_a_prefill_gathers_however_few_tokens_follow_its_cached_blocks(tiny_models) -> None:
    """Where short steps read K/V through the paged kernels (CUDA), a prefill still gathers its keys: a prompt's rest
    after its cached blocks (20-60 tokens) would be a query count the kernel compiles anew at its first use, 0.6-0.9 s
    in which a whole burst sharing a prefix waits. Decode-sized steps keep the paged reads."""
    runner = ModelRunner(tiny_models.target("llama", vocab=VOCAB), 2, 128)
    runner._paged_queries = 64  # as on CUDA for a draft of 12 heads and 12 K/V heads (the Triton kernels take it)
    rows = torch.tensor([0])
    for tokens in (1, 20, 64):
        inputs = (torch.zeros(1, tokens, dtype=torch.long), torch.tensor([tokens]))
        prefill = runner.prepare(kind="prefill", rows=rows, inputs=inputs, needed=100, tokens=tokens, last_only=True)
        step = runner.prepare(kind="verify", rows=rows, inputs=inputs, needed=100, tokens=tokens)
        assert prefill.shape.kv_len is not None and prefill.shape.kv_len >= 100
        assert step.shape.kv_len is None


def test_blocks_kept_ahead_leave_the_next_step_nothing_to_write_and_never_fail() -> None:
    """`keep_ahead` takes the blocks a row's next step may reach and writes their entries, so that step's `reserve`
    takes none and has none to write; it gives back blocks past that reach; where the pool is short it takes none,
    and raises nothing."""
    from minedraft.engine.kv_cache import LayerSpec, PagedKVCache

    cache = PagedKVCache(num_rows=3, max_len=64, block_size=4, device="cpu")
    cache.specs = [LayerSpec(1, 4, 4, torch.float32, torch.device("cpu"))]
    cache.allocate(9)  # 8 usable
    cache.reserve([0, 1], [5, 5])
    cache.flush()
    cache.keep_ahead([0, 1], [10, 10])
    assert cache.held[:2].tolist() == [3, 3] and cache.pool is not None and cache.pool.available == 2
    assert [cache.tables[r, :3].tolist() for r in (0, 1)] == cache.row_blocks[:2]  # written already
    cache.reserve([0, 1], [9, 10])  # the next step: all there
    assert not cache._pending
    cache.keep_ahead([0, 1], [64, 64])  # more than the pool has: none taken, no error
    cache.keep_ahead([2], [100])  # past max_len: up to it, where it fits
    assert cache.held.tolist() == [3, 3, 0] and cache.pool.available == 2
    cache.keep_ahead([0], [5])  # past the reach: back
    assert cache.held.tolist() == [2, 3, 0] and cache.pool.available == 3


def test_host_written_tables_equal_the_devices_eager_writes() -> None:
    """A CPU cache writes table entries into the tensor's memory from the host; a device's flush scatters them
    (`apply_writes`, CUDA's way where its graph takes too few): takes, trims, trash entries for a prefill and
    releases leave the same tables either way."""
    from minedraft.engine.kv_cache import LayerSpec, PagedKVCache

    def cache(host_writes: bool) -> PagedKVCache:
        made = PagedKVCache(num_rows=9, max_len=512, block_size=4, device="cpu")
        made.specs = [LayerSpec(1, 4, 4, torch.float32, torch.device("cpu"))]
        made.allocate(600)
        if not host_writes:
            made._host_cells = None
        return made

    host, device = cache(True), cache(False)
    rows = list(range(8))
    for step in range(1, 12):
        for made in (host, device):
            made.trim(rows, [4 * step + r for r in rows])
            made.keep_ahead(rows, [4 * step + 9 + 3 * r for r in rows])
            if step % 4 == 0:
                made.trim([2, 5], [1, 3])
                made.flush()  # with the trash entries, as before a prefill
    for made in (host, device):
        made.release([1, 3])
        made.flush()
    assert torch.equal(host.tables, device.tables)
    assert host.row_blocks == device.row_blocks
    for row in range(8):
        blocks = host.row_blocks[row]
        assert host.tables[row, : len(blocks)].tolist() == blocks
        assert (host.tables[row, len(blocks) :] == 0).all(), "a column given back still names its block"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flushes_through_the_table_writer_leave_the_tables_as_eager_writes() -> None:
    """On CUDA `flush` writes through a captured graph from pinned buffers in turn: flushes after launches (more of
    them than the writer has buffers, each behind a busy GPU so its copy waits), trims' trash entries, and one flush
    of more entries than a graph takes (written eagerly) leave the tables as the CPU's eager writes do."""
    from minedraft.engine.block_tables import TableWriter
    from minedraft.engine.kv_cache import LayerSpec, PagedKVCache

    def cache(device: str) -> PagedKVCache:
        made = PagedKVCache(num_rows=9, max_len=4096, block_size=4, device=device)
        made.specs = [LayerSpec(1, 4, 4, torch.float32, torch.device(device))]
        made.allocate(2000)
        return made

    gpu, cpu = cache("cuda:0"), cache("cpu")
    gpu.table_writer = TableWriter(gpu.apply_writes, gpu.device)
    busy = torch.randn(2048, 2048, device="cuda:0")
    rows = list(range(8))
    for step in range(1, 12):
        for made in (gpu, cpu):
            made.trim(rows, [4 * step + r for r in rows])
            made.keep_ahead(rows, [4 * step + 9 + 3 * r for r in rows])
        busy = busy @ busy / 2048  # the GPU runs behind the host: each flush's copy waits its turn
    for made in (gpu, cpu):
        made.release([1, 3])
        made.keep_ahead([0], [4000])  # ~1,000 entries: more than a graph takes
        made.flush()
    assert torch.equal(gpu.tables.cpu(), cpu.tables)
    assert gpu.row_blocks == cpu.row_blocks


def test_a_proposals_committed_count_equals_kept_plus_tail(tiny_models) -> None:
    """The proposer's short form of what a verdict commits (`committed_after`, before a proposal's launch) equals
    kept + tail (`kept_and_tail`, as the proposal's graph reconciles) for every verdict a row can get: up to its
    last_k drafts accepted, and any after a catch-up or a prefill (nothing drafted)."""
    proposer = Proposer(ModelRunner(tiny_models.draft("llama"), 32, 64))
    rows = np.arange(32)
    for last_k in range(6):
        proposer.last_k_host[rows] = last_k
        proposer.committed_host[rows] = 7 + rows
        accepted = rows % (last_k + 1) if last_k else rows % 5
        host = (proposer.committed_host, proposer.last_k_host)
        kept, tail = kept_and_tail(*host, rows, accepted)
        assert committed_after(*host, rows, accepted).tolist() == (kept + tail).tolist()


@pytest.mark.parametrize("deferred", [False, True], ids=["upkeep-in-the-call", "upkeep-after-it"])
def test_steps_find_their_blocks_taken_by_the_step_before(tiny_models, hf_reference, deferred: bool) -> None:
    """After its first step each verify and proposal finds every block its writes reach already taken and written
    (the step before took them once launched, `keep_ahead`; a served proposal leaves that to its `upkeep`, after
    its reply), so nothing is left for its launch to write; a row holds at most one block past what its next step
    may reach; and the tokens are `generate()`'s."""

    target, draft = tiny_models.target("llama", vocab=VOCAB), tiny_models.noisy_draft("llama", vocab=VOCAB)
    k, size = 3, 4
    verifier = Verifier(ModelRunner(target, 4, 96, block_size=size, kv_cache_memory=0.01), [])
    proposer = Proposer(ModelRunner(draft, 4, 96, block_size=size, kv_cache_memory=0.01))
    gen = torch.Generator().manual_seed(8)
    seqs, prompts = [1, 2, 3], [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 9, 14)]
    configs = [SamplingConfig(max_tokens=40, ignore_eos=True)] * 3
    first = verifier.prefill(seqs, prompts, configs).per_row()
    proposer.prefill(seqs, prompts, configs)
    tokens = [list(t) for t, _, _ in first]
    accepted, last = torch.zeros(3, dtype=torch.long), torch.tensor([t[-1] for t in tokens])
    v_rows, d_rows = np.array(verifier.table.row_list(seqs)), np.array(proposer.table.row_list(seqs))
    v_cache, d_cache = verifier.runner.cache, proposer.runner.cache
    for step in range(9):
        kept, tail = kept_and_tail(proposer.committed_host, proposer.last_k_host, d_rows, accepted.numpy())
        reach = np.maximum(kept + 2, kept + tail + k - 1)
        if step:
            assert (reach <= d_cache.held[d_rows] * size).all(), "a proposal's blocks not taken ahead"
        proposal = proposer.propose(seqs, accepted, last, k, defer_upkeep=deferred)
        if deferred:
            assert proposal.upkeep is not None
            proposal.upkeep()
        assert not d_cache._pending, "table entries left for the next proposal's launch"
        assert (d_cache.held[d_rows] <= -(-(reach + k + 1) // size)).all()
        before = verifier.cached[v_rows]
        if step:
            assert (before + k + 1 <= v_cache.held[v_rows] * size).all(), "a verify's blocks not taken ahead"
        result = verifier.verify(seqs, proposal.draft_ids, None).per_row()
        assert not v_cache._pending, "table entries left for the next verify's launch"
        assert (v_cache.held[v_rows] <= -(-(verifier.cached[v_rows] + 2 * (k + 1)) // size)).all()
        for row, (emitted, _, _) in zip(tokens, result):
            row += emitted
        accepted = torch.tensor([a for _, a, _ in result])
        last = torch.tensor([t[-1] for t in tokens])
    for prompt, row in zip(prompts, tokens):
        assert row == hf_reference(target, prompt, len(row))


def test_a_prefills_padding_lands_in_the_trash_block_not_in_another_rows(tiny_models) -> None:
    """A row whose last block a rollback gave back (written to the device first, as a step does), released and
    taken by a short prompt prefilled beside a longer one: the short one's padding must not reach the block the
    rollback freed, which another sequence holds by then. Its K/V stays a fresh prefill's."""
    model = tiny_models.target("llama", vocab=VOCAB)
    probe = ModelRunner(model, 1, 16, block_size=4, kv_cache_memory=0.01, prefix_caching=False)
    memory = 5 * probe.cache.bytes_per_block / 2**30  # blocks 1-4, and the trash block
    verifier = Verifier(ModelRunner(model, 4, 16, block_size=4, kv_cache_memory=memory, prefix_caching=False), [])
    cache, config = verifier.runner.cache, SamplingConfig(max_tokens=4)
    verifier.prefill([1], [[5, 6]], [config]).per_row()  # A: block 1
    verifier.prefill([2], [[7, 8, 9, 10, 11, 12, 13, 14]], [config]).per_row()  # E: blocks 2, 3
    row_a = verifier.table.rows_by_id[1]
    cache.reserve([row_a], [5])  # a verify's speculative positions: block 4, the last free one
    cache.flush()
    cache.trim([row_a], [3])  # rolled back: block 4 free again
    verifier.prefill([3], [[20, 21]], [config]).per_row()  # B: block 4
    row_b = verifier.table.rows_by_id[3]
    assert cache.row_blocks[row_b] == [4]
    verifier.release([2])
    verifier.release([1])
    # C takes A's row (the last freed), padded to D's 8 tokens: its second block's entry is where padding goes.
    verifier.prefill([4, 5], [[30, 31], [40, 41, 42, 43, 44, 45, 46, 47]], [config] * 2).per_row()
    assert verifier.table.rows_by_id[4] == row_a
    assert_state_equal(cache.rows_state(row_b), fresh_state(model, [20, 21]), "B after C's padded prefill")


def test_an_eager_forward_runs_no_version_counter_hook(tiny_models, monkeypatch) -> None:
    """The rotary write mutates the K/V stacks and takes the tables: were any of its tensors a normal (not inference)
    tensor, each layer of an eager forward (a prefill; every step on a CPU) would pass through autograd's Python hook
    that bumps version counters (`fill_defaults` first), ~35 us a layer on this CPU."""
    import torch._library.utils as library_utils

    calls = []
    fill_defaults = library_utils.fill_defaults

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(args)
        return fill_defaults(*args, **kwargs)

    monkeypatch.setattr(library_utils, "fill_defaults", counted)
    verifier = Verifier(ModelRunner(tiny_models.target("llama", vocab=VOCAB), 2, 64), [])
    assert verifier.runner.cache.stacked, "the rotary write runs on stacked caches"
    verifier.runner.cache.kernel_writes = True  # as on a GPU: every layer through the operator (here its stand-in)
    verifier.prefill([1], [list(range(20))], [SamplingConfig(max_tokens=4)]).per_row()
    verifier.verify([1], torch.tensor([[3, 4]]), None).per_row()
    assert not calls, f"{len(calls)} calls went through autograd's version-counter hook"
