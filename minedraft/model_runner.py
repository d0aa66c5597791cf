"""One forward pass of a transformers causal LM over a batch of slot rows, each appending its own tokens."""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel

from minedraft.kv_cache import SlotKVCache


class CapacityError(RuntimeError):
    """No free slot, or a sequence would outgrow the cache."""


class ModelRunner:
    """Owns a model and its slot cache: allocates rows, runs forwards that append tokens, rolls rows back."""

    def __init__(self, model: PreTrainedModel, num_slots: int, max_len: int) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        limit = getattr(model.config, "max_position_embeddings", None) or max_len
        self.max_len = min(max_len, int(limit))
        self.num_slots = num_slots
        self.cache = SlotKVCache(num_slots, self.max_len, self.device)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._free = list(range(num_slots - 1, -1, -1))
        # transformers >= 5.24 names the cache argument `cache`; older 5.x call it `past_key_values`.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        softcap = getattr(model.config, "final_logit_softcapping", None)
        self._softcap = float(softcap) if softcap else None

    # -- rows ---------------------------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise CapacityError(f"need {count} cache rows, {len(self._free)} free of {self.num_slots}")
        rows = [self._free.pop() for _ in range(count)]
        self.cache.lengths[rows] = 0
        return rows

    def release(self, rows: list[int]) -> None:
        self._free.extend(rows)

    def truncate(self, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Roll rows back to `lengths` committed tokens; later entries become invisible garbage."""
        self.cache.lengths[rows] = lengths

    # -- forward ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self, rows: torch.Tensor, input_ids: torch.Tensor, num_valid: torch.Tensor, last_only: bool = False
    ) -> torch.Tensor:
        """Append `input_ids[b, :num_valid[b]]` to row `rows[b]` and return float32 logits.

        Returns `[B, n, V]`, or `[B, V]` at each row's last valid token when `last_only` (prefill: the hidden
        states of long prompts are reduced before the vocabulary projection).
        """
        batch, n = input_ids.shape
        starts = self.cache.lengths[rows]
        positions = starts[:, None] + torch.arange(n, device=self.device)
        kv_len = int((starts + n).max())
        if kv_len > self.max_len:
            raise CapacityError(f"a sequence would reach {kv_len} tokens, beyond the cache's {self.max_len}")
        keys = torch.arange(kv_len, device=self.device)
        allowed = keys[None, None, :] <= positions[:, :, None]  # [B, n, kv_len]: causal over committed + new
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        self.cache.select(rows, positions, kv_len)
        kwargs = {self._cache_kwarg: self.cache}
        base = self.model.base_model
        hidden = base(
            input_ids=input_ids, attention_mask=mask[:, None], position_ids=positions, use_cache=True, **kwargs
        ).last_hidden_state
        self.cache.lengths[rows] = starts + num_valid
        if last_only:
            hidden = hidden[torch.arange(batch, device=self.device), num_valid - 1]
        logits = self.model.get_output_embeddings()(hidden).float()
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits
