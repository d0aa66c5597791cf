"""How the target's hidden states travel to an EAGLE head: one named `[rows, H]` tensor per layer it reads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

PREFIX = "hidden."  # a reverse-layout tensor named hidden.<i>: the target's `output_hidden_states[i]`
SEQ_ID = "seq_id"  # [rows, 1] int64: the sequence each row of the hidden states is of
# A prefill's rows the reverse buffer holds beyond a verify's (max batch x (k + 1)): one prompt of this many tokens
# whole, at most; at a 4096-wide target's three layers in bf16, 48 MiB a slot.
PREFILL_ROWS = 2048


def reverse_rows(max_batch_size: int, k: int, max_len: int) -> int:
    """The rows of the reverse buffer: a verify's, or one prompt of up to min(max_len, PREFILL_ROWS) tokens whole,
    whichever is more (not every position the draft's sequences may hold: too big for cuda-ipc slots at 8B)."""
    return max(max_batch_size * (k + 1), min(max_len, PREFILL_ROWS))


def latest_rows(counts: Sequence[int], budget: int) -> list[int]:
    """How many of each sequence's last rows a send of at most `budget` rows keeps: all of a sequence's when they
    fit, else an equal share each, what short sequences leave unused going to the longer ones."""
    kept = [0] * len(counts)
    waiting = sorted(range(len(counts)), key=lambda i: counts[i])
    left = budget
    for place, i in enumerate(waiting):
        kept[i] = min(counts[i], left // (len(waiting) - place))
        left -= kept[i]
    return kept


def exported_layers(layers: Sequence[int]) -> tuple[int, ...]:
    """The layers the target exports for a head that reads `layers` (in its order, with repeats): each once."""
    return tuple(dict.fromkeys(layers))


def tensor_names(layers: Sequence[int]) -> list[str]:
    return [f"{PREFIX}{i}" for i in exported_layers(layers)]


def layers_named(names: Sequence[str]) -> tuple[int, ...]:
    """The layers a reverse layout's tensor names ask the target for (names not of hidden states are not)."""
    return tuple(int(name[len(PREFIX) :]) for name in names if name.startswith(PREFIX))


def split_by_layer(rows: torch.Tensor, layers: Sequence[int]) -> dict[str, torch.Tensor]:
    """The target's side: exported states [rows, len(layers) * H] of `layers` (each once), one tensor per layer."""
    width = rows.shape[1] // len(layers)
    return {f"{PREFIX}{i}": rows[:, j * width : (j + 1) * width] for j, i in enumerate(layers)}


def joined_for_head(tensors: Mapping[str, torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    """The draft's side: the head's input [rows, len(layers) * H], its layers in its order (repeats included)."""
    return torch.cat([tensors[f"{PREFIX}{i}"] for i in layers], dim=-1)
