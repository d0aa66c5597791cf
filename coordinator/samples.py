"""`n` completions of one prompt (GenerateRequest.n): each sample is its own sequence on both workers, admitted like
any request; the target's prefix cache shares the prompt's full KV blocks among them (`SequenceTable.prefill`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from coordinator.request_state import RequestState
from coordinator.validation import InvalidRequest
from minedraft.observability.metrics import mean_accepted_length
from minedraft.proto import generation_pb2

MAX_N = 16  # samples one request may ask for
SEED_RANGE = 2**64  # SamplingParams.seed is a uint64


def sample_count(request: generation_pb2.GenerateRequest, max_queue_size: int, max_n: int = MAX_N) -> int:
    """How many samples `request` asks for (unset or 0: one), checked: each waits in the queue on its own, so more
    than the queue holds could never be admitted."""
    n = request.n or 1
    if n > max_n:
        raise InvalidRequest(f"n must be at most {max_n}, got {n}", "n")
    if n > max_queue_size:
        raise InvalidRequest(
            f"n={n} samples cannot wait in this server's queue of {max_queue_size} (--max-queue-size)", "n"
        )
    return n


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index`: the request's seed + index (mod 2^64), so that seeded samples differ from one
    another and a rerun of the request reproduces each."""
    return (seed + index) % SEED_RANGE


def make_samples(first: RequestState, n: int, seq_ids: Iterator[int]) -> list[RequestState]:
    """`first` (sample 0) and n - 1 more samples of its prompt, each with its own seq id and seed; they share
    `first`'s stream, so that their messages interleave in the order they are emitted."""
    samples = [first]
    for index in range(1, n):
        samples.append(
            RequestState(
                next(seq_ids),
                list(first.prompt_ids),
                dataclasses.replace(first.config, seed=sample_seed(first.config.seed, index)),
                first.request.stop_strings,
                first.request.tokenizer,
                seeded=first.request.seeded,
                index=index,
                queue=first.client.queue,
            )
        )
    return samples


def total_usage(usages: Sequence[generation_pb2.Usage]) -> generation_pb2.Usage:
    """The usage of a request's samples together, as OpenAI counts `n`: the prompt once (and its cached tokens as
    sample 0 found them), the completions and speculation figures summed; time to first token is the first
    sample's to get one, time per output token the mean over all samples' tokens after their first."""
    if len(usages) == 1:
        return usages[0]
    first = usages[0]
    total = generation_pb2.Usage(
        prompt_tokens=first.prompt_tokens,
        cached_prompt_tokens=first.cached_prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
        draft_tokens=sum(u.draft_tokens for u in usages),
        accepted_tokens=sum(u.accepted_tokens for u in usages),
        steps=sum(u.steps for u in usages),
        drafted_steps=sum(u.drafted_steps for u in usages),
        time_to_first_token_s=min(u.time_to_first_token_s for u in usages),
    )
    total.mean_accepted_length = mean_accepted_length(total.accepted_tokens, total.drafted_steps, total.steps)
    total.acceptance_rate = total.accepted_tokens / total.draft_tokens if total.draft_tokens else 0.0
    positions = [0] * max(len(u.accepted_per_position) for u in usages)
    for u in usages:
        for i, count in enumerate(u.accepted_per_position):
            positions[i] += count
    total.accepted_per_position.extend(positions)
    later = [(u.time_per_output_token_s, max(u.completion_tokens - 1, 0)) for u in usages]
    tokens = sum(count for _, count in later)
    total.time_per_output_token_s = sum(t * count for t, count in later) / tokens if tokens else 0.0
    return total
