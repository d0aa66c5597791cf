"""The batch manager's admission and balance, the overlap policy, and the draft/target vocabulary check."""

from __future__ import annotations

import pytest

from coordinator.batch_manager import BatchManager, QueueFullError
from coordinator.kv_blocks import BlockLedger, PrefixMemory
from coordinator.measured_choice import PROBE_EVERY, PROBE_STEPS
from coordinator.overlap_policy import OverlapPolicy
from coordinator.request_state import RequestState
from coordinator.speculation_policy import (
    EARLY_TRIAL_SIZE,
    FIRST_TRIAL_AFTER,
    SpeculationPolicy,
    draft_lengths,
    size_class,
)
from minedraft.engine.models import VocabInfo, check_pair
from minedraft.engine.sampling import SamplingConfig
from minedraft.errors import ModelLoadError
from minedraft.proto import common_pb2


def _request(seq_id: int, prompt_len: int = 3) -> RequestState:
    return RequestState(seq_id, list(range(1, prompt_len + 1)), SamplingConfig(), (), None)


def test_admission_fills_the_emptier_batch_and_respects_the_limit() -> None:
    manager = BatchManager(max_batch_size=3, max_queue_size=10, num_batches=2)
    for i in range(8):
        manager.submit(_request(i))
    placed = manager.take_admissions()
    sizes = {batch.batch_id: len(requests) for batch, requests in placed}
    assert sizes == {0: 3, 1: 3}
    assert [len(b.members) for b in manager.batches] == [3, 3]
    assert manager.queue_length == 2  # the rest waits: nothing beyond max_batch_size per batch


def test_a_burst_is_admitted_in_prefills_of_at_most_max_prefill_tokens() -> None:
    """A first prompt longer than the limit still goes in (alone), and what is left waits for the next step."""
    manager = BatchManager(max_batch_size=8, max_queue_size=20, num_batches=2, max_prefill_tokens=100)
    for i, length in enumerate([20, 30, 10, 20, 5, 150, 40, 40, 10]):
        manager.submit(_request(i, length))
    admitted = []
    while manager.waiting:
        admitted.append(sorted(r.seq_id for _, requests in manager.take_admissions() for r in requests))
    assert admitted == [[0, 1, 2, 3, 4], [5], [6, 7, 8]]  # 85 tokens (with the next, 235); 150; 90
    unlimited = BatchManager(max_batch_size=8, max_queue_size=20, num_batches=2)
    for i in range(9):
        unlimited.submit(_request(i, 150))
    assert sum(len(requests) for _, requests in unlimited.take_admissions()) == 9


def test_the_prefill_budget_counts_what_the_prefix_cache_likely_holds_as_free() -> None:
    """Prompts sharing 96 tokens with one the target prefilled: once the target reported a hit, only their other
    tokens count against --max-prefill-tokens, so four go in a step where one did."""
    ledger = BlockLedger()
    ledger.reset(block_size=16, num_blocks=100, free=100)
    prefixes = PrefixMemory(ledger)
    shared = list(range(1, 97))
    prefixes.prefilled([shared + [500]], [0])
    waiting = [RequestState(i, shared + [600 + i] * 5, SamplingConfig(), (), None) for i in range(6)]
    assert prefixes.uncached_tokens(waiting[0]) == 101  # not active: the target reported no hit yet
    prefixes.prefilled([shared + [501]], [96])
    assert prefixes.uncached_tokens(waiting[0]) == 5  # 6 full blocks of 16 cached
    manager = BatchManager(max_batch_size=8, max_queue_size=20, num_batches=2, max_prefill_tokens=110)
    for request in waiting:
        manager.submit(request)
    assert len([r for _, rs in manager.take_admissions(cost=prefixes.uncached_tokens) for r in rs]) == 6
    for request in waiting:
        manager.submit(RequestState(request.seq_id + 10, request.prompt_ids, SamplingConfig(), (), None))
    assert len([r for _, rs in manager.take_admissions() for r in rs]) == 1  # full prompts: one a step


def test_a_cold_burst_sharing_a_prompt_is_admitted_by_the_tokens_it_computes() -> None:
    """64 requests sharing 2,000 tokens, nothing cached yet, against a target that reports its prefix caching on:
    the first computes the shared blocks and the others share them in the same prefill (`SequenceTable.prefill`),
    so all go in one step within 8,192 tokens where whole prompts would take four a step."""
    ledger = BlockLedger()
    ledger.reset(block_size=16, num_blocks=10_000, free=10_000, prefix_caching=True)
    prefixes = PrefixMemory(ledger)
    assert prefixes.active  # before any prefill: the target said it caches
    shared = [1 + i % 300 for i in range(2000)]
    burst = [RequestState(i, shared + [400 + i] * 20, SamplingConfig(), (), None) for i in range(64)]
    cost = prefixes.admission_cost()
    assert [cost(r) for r in burst[:2]] == [2020, 20]  # the 125 full shared blocks counted once
    assert prefixes.uncached_tokens(burst[1]) == 2020  # alone, it finds nothing cached
    manager = BatchManager(max_batch_size=32, max_queue_size=64, num_batches=2, max_prefill_tokens=8192)
    for request in burst:
        manager.submit(request)
    assert sum(len(rs) for _, rs in manager.take_admissions(cost=prefixes.admission_cost())) == 64
    off = BlockLedger()
    off.reset(block_size=16, num_blocks=10_000, free=10_000, prefix_caching=False)
    assert PrefixMemory(off).admission_cost()(burst[1]) == 2020  # a target without prefix caching computes all


def test_queue_is_bounded() -> None:
    manager = BatchManager(max_batch_size=1, max_queue_size=2, num_batches=1)
    manager.submit(_request(0))
    manager.submit(_request(1))
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        manager.submit(_request(2))


def test_batch_awaiting_verify_takes_newcomers_as_joiners() -> None:
    manager = BatchManager(max_batch_size=4, max_queue_size=10, num_batches=2)
    manager.submit(_request(0))
    manager.submit(_request(1))
    manager.take_admissions()
    busy = manager.batches[0]
    busy.drafts = common_pb2.DraftPayload()  # its drafts are in flight: membership frozen
    for i in range(2, 5):
        manager.submit(_request(i))
    manager.take_admissions()
    assert len(busy.members) == 1 and len(busy.joining) >= 1
    busy.open_membership()
    assert busy.joining == [] and len(busy.members) >= 2


def test_cancelled_and_finished_leave_at_the_step_boundary() -> None:
    manager = BatchManager(max_batch_size=4, max_queue_size=10, num_batches=1)
    requests = [_request(i) for i in range(3)]
    for r in requests:
        manager.submit(r)
    manager.take_admissions()
    requests[0].client.cancelled = True
    requests[1].decode.finish_reason = 1
    gone = manager.remove_finished(manager.batches[0])
    assert gone == requests[:2] and manager.batches[0].members == [requests[2]]


def test_rebalance_moves_the_surplus_to_the_other_batch() -> None:
    manager = BatchManager(max_batch_size=8, max_queue_size=10, num_batches=2)
    big, small = manager.batches
    big.members = [_request(i) for i in range(6)]
    small.members = [_request(10)]
    manager.rebalance(big)
    assert (len(big.members), len(small.members)) == (4, 3)


def test_overlap_policy_prefers_what_measures_faster_and_keeps_probing() -> None:
    policy = OverlapPolicy("auto")
    choices = []
    for _ in range(10 * PROBE_EVERY):
        overlap = policy.choose()
        choices.append(overlap)
        policy.record(overlap, 0.30 if overlap else 0.20, 10)  # overlapping is slower here
    tail = choices[PROBE_EVERY:]
    assert tail.count(False) > 0.85 * len(tail)  # falls back to running the calls in sequence
    assert True in tail  # and still tries overlapping now and then
    assert OverlapPolicy("always").choose() and not OverlapPolicy("never").choose()


def test_overlap_policy_is_not_swayed_by_a_few_slow_steps() -> None:
    """A sequential step that captured a CUDA graph (seconds, once) must not make overlapping look better."""
    policy = OverlapPolicy("auto")
    choices: list[bool] = []
    for _ in range(3 * PROBE_EVERY):
        overlap = policy.choose()
        slow = not overlap and choices.count(False) < PROBE_STEPS  # the first sequential trials hit new shapes
        choices.append(overlap)
        policy.record(overlap, 5.0 if slow else (0.30 if overlap else 0.20), 10)
    tail = choices[PROBE_EVERY:]
    assert tail.count(False) > 0.8 * len(tail)


def test_overlap_policy_rarely_tries_a_much_slower_strategy_but_still_notices_a_change() -> None:
    """Two GPUs: sequential steps cost twice overlapped ones. Trials of the slow way stay rare; when the
    costs turn (the draft moves to a shared GPU, say), the policy follows within a few trial intervals."""
    policy = OverlapPolicy("auto")

    def run(steps: int, overlapped_cost: float, sequential_cost: float) -> list[bool]:
        made = []
        for _ in range(steps):
            overlap = policy.choose()
            made.append(overlap)
            policy.record(overlap, overlapped_cost if overlap else sequential_cost, 32)
        return made

    choices = run(20 * PROBE_EVERY, 0.026, 0.050)
    steady = choices[4 * PROBE_EVERY :]
    assert steady.count(False) < 0.04 * len(steady)  # was 4 steps in 36 (11%)
    assert False in steady
    after = run(20 * PROBE_EVERY, 0.060, 0.040)  # now overlapping is the slow way
    assert after[-4 * PROBE_EVERY :].count(True) < 0.04 * 4 * PROBE_EVERY


def test_speculation_policy_leaves_drafts_that_do_not_pay_and_takes_them_back_when_they_do() -> None:
    """Costs of a step per token each sequence emitted: drafting 1.2 ms against 1.0 alone (a big draft at a large
    batch), then 0.5 against 1.0 (acceptance rose). It decodes alone after its first trial, tries drafting ever less
    often while nothing changes, starts a new size class from a measured neighbour's way, and drafts again once
    drafting pays; `always` drafts at every step."""
    speculation = SpeculationPolicy("auto")  # drafting 1 token or none: True or False here

    def run(steps: int, drafting_cost: float, alone_cost: float, batch: int = 64) -> list[bool]:
        made = []
        for _ in range(steps):
            policy = speculation.at(batch)
            drafting = policy.choose()
            made.append(bool(drafting))
            policy.record(drafting, 2 * (drafting_cost if drafting else alone_cost), 2.0)
        return made

    def trials(made: list[bool], way: bool) -> list[int]:
        """Where each run of steps taken `way` starts."""
        return [i for i, d in enumerate(made) if d == way and (i == 0 or made[i - 1] != way)]

    assert EARLY_TRIAL_SIZE <= 64
    first = run(FIRST_TRIAL_AFTER + PROBE_STEPS, 1.2e-3, 1.0e-3)
    assert first == [True] * (FIRST_TRIAL_AFTER - 1) + [False] * (PROBE_STEPS + 1)  # the first trial turned it
    assert not speculation.at(49).preferred  # (49-64: one size class)
    tail = run(2000, 1.2e-3, 1.0e-3)
    starts = trials(tail, True)
    # Drafting, no 10% cheaper, is tried after 4 x PROBE_EVERY steps alone, then twice and four times as many (the
    # cap), each trial PROBE_STEPS long.
    assert 4 * PROBE_EVERY - 4 < starts[0] < 4 * PROBE_EVERY and len(starts) == 5
    assert [b - a - (PROBE_STEPS - 1) for a, b in zip(starts, starts[1:])] == [8 * PROBE_EVERY] + [16 * PROBE_EVERY] * 3
    assert tail.count(False) > 0.97 * len(tail)
    # Other sizes are measured apart. The next size class down (33-48) starts from the measured one's way, and tries
    # the other after FIRST_TRIAL_AFTER steps; a size with no measured neighbour starts drafting, and below
    # EARLY_TRIAL_SIZE tries the target alone after the usual PROBE_EVERY steps.
    half = run(FIRST_TRIAL_AFTER + PROBE_STEPS, 0.85e-3, 1.0e-3, batch=40)
    assert half == [False] * (FIRST_TRIAL_AFTER - 1) + [True] * (PROBE_STEPS + 1)  # drafting 15% cheaper there
    small = run(PROBE_EVERY + PROBE_STEPS, 1.2e-3, 1.0e-3, batch=8)
    assert small == [True] * (PROBE_EVERY - 1) + [False] * (PROBE_STEPS + 1)
    assert not speculation.at(64).preferred
    # Acceptance rose: the next trial at 64 finds drafting at half the cost and keeps it.
    after = run(20 * PROBE_EVERY, 0.5e-3, 1.0e-3)
    assert speculation.at(64).preferred and after[-4 * PROBE_EVERY :].count(True) >= 4 * PROBE_EVERY - PROBE_STEPS
    always = SpeculationPolicy("always").at(64)
    always.record(True, 1.0, 1)
    always.record(False, 0.1, 1)
    assert all(always.choose() for _ in range(2 * PROBE_EVERY))
    with pytest.raises(ValueError, match="speculation must be one of"):
        SpeculationPolicy("never")


def test_speculation_costs_pool_steps_whose_tokens_vary() -> None:
    """One sequence drafting 4 tokens a step emits 1 to 5 tokens a step (2.8 on average here): 14.8 ms a drafted
    step is 5.3 ms a token, against 6.0 for the target alone. The median of the steps' own ratios says 7.4 (most
    steps emit 1 or 2 tokens) and would leave drafting; summed, the costs keep it."""
    speculation = SpeculationPolicy("auto")
    emitted = [1, 1, 1, 1, 2, 2, 5, 5, 5, 5]
    made = []
    for step in range(6 * PROBE_EVERY):
        policy = speculation.at(1)
        drafting = policy.choose()
        made.append(drafting)
        policy.record(drafting, 14.8e-3 if drafting else 6.0e-3, emitted[step % len(emitted)] if drafting else 1.0)
    assert False in made  # tried
    assert speculation.at(1).preferred and made[-PROBE_EVERY:].count(True) >= PROBE_EVERY - PROBE_STEPS
    cost = speculation.at(1).cost(True)
    assert cost is not None and abs(cost - 14.8e-3 * 9 / sum(emitted[:9])) < 2e-3  # (about the last 9 steps')


def test_speculation_size_classes_are_powers_of_two_and_one_and_a_half_times_them() -> None:
    assert [size_class(n) for n in (1, 2, 3, 4, 5, 6, 7, 9, 13, 17, 25, 33, 48, 49, 64, 65)] == [
        1,
        2,
        3,
        4,
        6,
        6,
        8,
        12,
        16,
        24,
        32,
        48,
        48,
        64,
        64,
        96,
    ]


def test_vocabulary_mismatch_is_refused_with_a_clear_message() -> None:
    target = VocabInfo(logits_size=1000, tokenizer_size=1000, tokenizer_hash="aaaa", eos_token_ids=(0,))
    check_pair(target, VocabInfo(1000, 1000, "aaaa", (0,)))
    with pytest.raises(ModelLoadError, match="do not share a vocabulary"):
        check_pair(target, VocabInfo(1000, 1000, "bbbb", (0,)))
    with pytest.raises(ModelLoadError, match="propose ids the target cannot score"):
        check_pair(target, VocabInfo(1200, 1000, "aaaa", (0,)))


def test_draft_lengths_halve_from_k_down_to_the_shortest() -> None:
    assert [draft_lengths(*a) for a in ((4, 1), (6, 1), (5, 1), (8, 3), (4, 4), (4, 0), (1, 1))] == [
        (4, 2, 1),
        (6, 3, 1),
        (5, 2, 1),
        (8, 4),
        (4,),
        (4, 2, 1),
        (1,),
    ]


def test_speculation_policy_walks_to_the_cheapest_draft_length() -> None:
    """Per token each sequence got at 64 sequences: 4 drafts 1.5 ms, 2 drafts 1.2, 1 draft 1.0, none 1.3 (a verify
    whose extra positions cost more than they save at that batch). The lengths and none lie on a ring (4, 2, 1, none,
    back to 4). From 4 it tries none first after FIRST_TRIAL_AFTER steps (as with one length) and turns; it tries 1
    after the usual PROBE_EVERY (a trial that drafts again costs a catch-up), turns, goes on to 2 after
    FIRST_TRIAL_AFTER and stays at 1; then it tries its neighbours (2 and none) in turn, ever less often. A new size
    class next to it starts from the longest length. When the costs change (acceptance fell: none is cheapest) it
    follows."""
    speculation = SpeculationPolicy("auto", draft_lengths(4, 1))
    costs = {4: 1.5e-3, 2: 1.2e-3, 1: 1.0e-3, 0: 1.3e-3}

    def run(steps: int) -> list[int]:
        made = []
        for _ in range(steps):
            policy = speculation.at(64)
            k = policy.choose()
            made.append(k)
            policy.record(k, 2 * costs[k], 2.0)
        return made

    def spells(made: list[int]) -> list[int]:
        """The way of each run of steps, in order."""
        return [k for i, k in enumerate(made) if i == 0 or made[i - 1] != k]

    quick, usual = FIRST_TRIAL_AFTER - 1 + PROBE_STEPS, PROBE_EVERY - 1 + PROBE_STEPS
    walk = run(FIRST_TRIAL_AFTER - 1 + usual + quick + PROBE_STEPS + 1)
    assert walk == [4] * (FIRST_TRIAL_AFTER - 1) + [0] * usual + [1] * quick + [2] * PROBE_STEPS + [1]
    assert speculation.at(64).preferred == 1
    tail = run(3000)
    assert set(spells(tail)) == {1, 2, 0} and tail.count(1) > 0.95 * len(tail)
    assert spells(tail)[1::2].count(2) >= 2 and spells(tail)[1::2].count(0) >= 2  # both neighbours tried
    assert speculation.at(40).preferred == 4  # a new size drafts if its neighbour does, from the longest length
    costs[0] = 0.5e-3
    later = run(3000)
    assert speculation.at(64).preferred == 0 and later[-1000:].count(0) > 0.97 * 1000
    fixed = SpeculationPolicy("always", draft_lengths(4, 1)).at(64)
    assert {fixed.choose() for _ in range(2 * PROBE_EVERY)} == {4}


def test_the_samples_of_one_request_queue_all_or_none() -> None:
    from coordinator.samples import make_samples, total_usage
    from minedraft.proto import generation_pb2

    manager = BatchManager(max_batch_size=4, max_queue_size=4, num_batches=1)
    manager.submit(_request(0))
    first = RequestState(1, [1, 2, 3], SamplingConfig(temperature=1.0, seed=2**64 - 1), (), None)
    samples = make_samples(first, 3, iter(range(10, 20)))
    assert [(s.seq_id, s.index, s.config.seed) for s in samples] == [(1, 0, 2**64 - 1), (10, 1, 0), (11, 2, 1)]
    assert all(s.client.queue is first.client.queue for s in samples)  # one stream: their messages interleave
    manager.submit_all(samples)
    with pytest.raises(QueueFullError, match="each of n samples counts"):
        manager.submit_all(make_samples(_request(2), 2, iter(range(30, 40))))
    assert manager.queue_length == 4

    usages = [
        generation_pb2.Usage(
            prompt_tokens=3, completion_tokens=5, draft_tokens=8, accepted_tokens=a, steps=2, drafted_steps=2
        )
        for a in (2, 4)
    ]
    usages[0].accepted_per_position.extend([2])
    usages[1].accepted_per_position.extend([2, 2])
    total = total_usage(usages)
    assert (total.prompt_tokens, total.completion_tokens, total.accepted_tokens) == (3, 10, 6)
    assert list(total.accepted_per_position) == [4, 2] and total.mean_accepted_length == pytest.approx(2.5)
