"""How the target's hidden states travel to an EAGLE head: one named `[rows, H]` tensor per layer it reads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

PREFIX = "hidden."  # a reverse-layout tensor named hidden.<i>: the target's `output_hidden_states[i]`
SEQ_ID = "seq_id"  # [rows, 1] int64: the sequence each row of the hidden states is of


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
