"""The drafter interface the draft service serves through, and which drafter a checkpoint asks for."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from minedraft.engine.sampling import SamplingConfig
from minedraft.errors import InvalidRequest, ModelLoadError, UnknownSequenceError

# --speculative-method: auto reads the --draft checkpoint's config (`resolve_method`)
SPECULATIVE_METHODS = ("auto", "draft-model", "eagle", "eagle3", "ngram")
MODEL_FREE_METHODS = ("ngram",)  # drafters that load no weights of their own


@dataclass
class Proposal:
    draft_ids: torch.Tensor  # [B, k]
    draft_probs: torch.Tensor | None  # [B, k, V] processed q, or None when every row drafted greedily
    # With `defer_upkeep`: host work the proposal left, for the caller to run after replying and before the
    # drafter's next call (`Drafter.propose`).
    upkeep: Callable[[], None] | None = None
    # With the drafter scoring its drafts (TETRIS, `Proposer.scores_drafts`): log q of each drafted token [B, k]
    token_logprobs: torch.Tensor | None = None


class Drafter(Protocol):
    """What the draft service asks of a drafter; the coordinator, the rejection sampler and the channel see only
    its proposals. A drafter holds sequences by id, each reconciled at every proposal with the target's verdict on
    its last one (accepted count, emitted token), as `Proposer` documents."""

    def prefill(
        self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]
    ) -> list[int]:
        """Admit the sequences; the prompt tokens each found in a prefix cache."""
        ...

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
        """k drafts per sequence after applying the target's last verdict (`missed`: tokens emitted before
        `next_tokens` that were never given to this drafter)."""
        ...

    def release(self, seq_ids: Sequence[int]) -> None: ...

    def held_seq_ids(self) -> list[int]: ...

    def precapture(self, k: int, max_batch: int) -> int: ...


def resolve_method(method: str, draft_dir: str | None) -> str:
    """The drafter `--speculative-method` names; `auto` reads the draft checkpoint's config: an EAGLE-3 head names
    an Eagle3 architecture or a `draft_vocab_size`, an EAGLE-1 head is a Llama layer with an `fc` of 2H -> H (its
    checkpoint has no embeddings), anything else is a draft model."""
    if method not in SPECULATIVE_METHODS:
        raise ModelLoadError(f"--speculative-method {method!r}: choose one of {', '.join(SPECULATIVE_METHODS)}")
    if method != "auto":
        return method
    if not draft_dir:
        raise ModelLoadError("--speculative-method auto needs a --draft checkpoint to read (or name ngram)")
    path = os.path.join(draft_dir, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the draft's config {path!r}: {exc}") from exc
    architectures = " ".join(config.get("architectures") or [])
    if "eagle3" in architectures.lower() or "draft_vocab_size" in config:
        return "eagle3"
    if "eagle" in architectures.lower() or _has_eagle_fc(draft_dir):
        return "eagle"
    return "draft-model"


def _has_eagle_fc(draft_dir: str) -> bool:
    """Whether the checkpoint holds an EAGLE-1 head's `fc.weight` (the published heads name no architecture of
    their own)."""
    index = os.path.join(draft_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return "fc.weight" in json.load(f).get("weight_map", {})
    single = os.path.join(draft_dir, "model.safetensors")
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return "fc.weight" in set(f.keys())
    binary = os.path.join(draft_dir, "pytorch_model.bin")
    if os.path.isfile(binary):
        return "fc.weight" in torch.load(binary, map_location="meta", weights_only=True)
    return False


def check_proposal(seq_ids: Sequence[int], held: Container[int], k: int) -> None:
    """What a Propose must be, whatever drafts it: at least one token, each sequence held and listed once."""
    if k < 1:
        raise ValueError("a proposal drafts at least one token")
    unknown = [s for s in seq_ids if s not in held]
    if unknown:
        raise UnknownSequenceError(f"unknown sequence ids {unknown[:8]}")
    if len(set(seq_ids)) != len(seq_ids):
        raise InvalidRequest("a step lists a sequence id more than once")
