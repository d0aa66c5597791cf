"""Structured outputs: grammars compiled by xgrammar, and per-sequence matchers whose bitmasks mask the target."""

from __future__ import annotations

import collections
import json
import math
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minedraft.errors import InternalError, InvalidRequest

if TYPE_CHECKING:
    import xgrammar

# What a request may constrain its output to (SamplingParams.structured_output's fields): the source of each is a
# JSON schema, nothing (any JSON object), a regular expression, a JSON list of strings, an EBNF grammar. A spec is
# (kind, source, compact): compact JSON allows no whitespace but one space after a comma and a colon.
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
COMPILED_GRAMMARS = 64  # distinct grammars a worker keeps compiled (least recently used dropped first)
_ENGINE_PREFIX = re.compile(r"^\s*\[[0-9:]+\] [^:]*\.cc:\d+: (Check failed: .*? is false: )?")

Spec = tuple[str, str, bool]  # SamplingConfig.grammar


def _engine_message(exc: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    return _ENGINE_PREFIX.sub("", str(exc).strip()).strip()


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose strings are exactly `choices`."""
    if not choices:
        raise InvalidRequest("choice needs at least one string", "structured_output.choice")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def parse(spec: Spec) -> xgrammar.Grammar:
    """The grammar `spec` names, not yet compiled for a tokenizer; InvalidRequest naming the field, with the
    engine's message, when it is not one."""
    import xgrammar

    kind, source, compact = spec
    try:
        if kind == "json_schema":
            return xgrammar.Grammar.from_json_schema(source, strict_mode=True, any_whitespace=not compact)
        if kind == "json_object":  # any object: without strict mode a schema's object takes any properties
            return xgrammar.Grammar.from_json_schema(
                '{"type": "object"}', strict_mode=False, any_whitespace=not compact
            )
        if kind == "regex":
            return xgrammar.Grammar.from_regex(source)
        if kind == "choice":
            return xgrammar.Grammar.from_ebnf(choice_ebnf(json.loads(source)))
        if kind == "grammar":
            return xgrammar.Grammar.from_ebnf(source)
    except InvalidRequest:
        raise
    except Exception as exc:  # the engine's errors are RuntimeErrors with its message
        raise InvalidRequest(f"invalid {kind}: {_engine_message(exc)}", f"structured_output.{kind}") from exc
    raise InvalidRequest(f"unknown structured output kind {kind!r}: one of {', '.join(KINDS)}", "structured_output")


class _Checked:
    """`parse` of the specs seen lately, remembered: a client repeating its schema pays for its check once."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._errors: collections.OrderedDict[Spec, InvalidRequest | None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, spec: Spec) -> None:
        with self._lock:
            if spec in self._errors:
                self._errors.move_to_end(spec)
                error = self._errors[spec]
                if error is not None:
                    raise error
                return
        try:
            parse(spec)
            error = None
        except InvalidRequest as exc:
            error = exc
        with self._lock:
            self._errors[spec] = error
            while len(self._errors) > self.size:
                self._errors.popitem(last=False)
        if error is not None:
            raise error


check = _Checked(256)  # the coordinator's, at admission (off its event loop)


class Grammars:
    """A target worker's: grammars compiled for its tokenizer (a bounded cache), and a matcher per constrained
    sequence, advanced by what the sequence emits.

    A verify's masks (`masks`) follow each row's drafts: position j's is the grammar's state after the row's
    committed tokens and drafts 1..j; the drafts are accepted into the matcher only to find the masks, then rolled
    back, and the matcher moves on by the tokens the step emitted (`advance`), once the host has read them.

    The matchers know only the tokenizer's ids (`grammar_vocab`): a model's vocabulary may be wider (padded, or a
    128,256-wide one with a 4,096-token tokenizer), and xgrammar takes ids it cannot decode for special tokens, which
    it searches one by one on every token accepted and every mask (30x slower fills, 10x slower accepts at that
    width). Ids past the tokenizer's are refused, as xgrammar refuses special tokens: their bits are 0."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], pin: bool = False) -> None:
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, list(eos_token_ids)
        # `pin` (a CUDA model's): masks in page-locked memory, so their copy in is asynchronous; a pageable one
        # waits for the DMA, which queues behind the other batch's forward and stalls the host
        self.pin = pin
        self.words = math.ceil(vocab_size / 32)  # int32 words of one position's bitmask
        self.grammar_vocab = vocab_size if tokenizer is None else _tokenizer_vocab(tokenizer, vocab_size, self.eos)
        self.grammar_words = math.ceil(self.grammar_vocab / 32)  # the words xgrammar fills
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiled: collections.OrderedDict[Spec, xgrammar.CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()  # compiles run on a thread of their own (`compile`), steps on the model's
        self.matchers: dict[int, xgrammar.GrammarMatcher] = {}
        self.unread: set[int] = set()  # sequences whose last step's tokens the matcher has not been given
        self._drafts_taken: dict[int, int] = {}  # the draft's: drafts its matchers took during a proposal

    def _compiler_for_tokenizer(self) -> xgrammar.GrammarCompiler:
        import xgrammar

        if self.tokenizer is None:
            raise InvalidRequest("this worker's model has no tokenizer: it cannot constrain output to a grammar")
        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.grammar_vocab, stop_token_ids=self.eos or None
            )
            # (the cache here is ours, bounded by count; one thread: compiles must not take the model's cores)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, spec: Spec) -> xgrammar.CompiledGrammar:
        """`spec` compiled for this tokenizer, once per distinct spec while it stays among the latest used."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
            compiler = self._compiler_for_tokenizer()
        compiled = compiler.compile_grammar(parse(spec))
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def admit(self, seq_ids: Sequence[int], specs: Sequence[Spec | None], outputs: Sequence[Sequence[int]]) -> None:
        """A matcher for each constrained sequence, past its `outputs` (tokens generated before a preemption)."""
        import xgrammar

        for seq_id, spec, output in zip(seq_ids, specs, outputs, strict=True):
            if spec is None:
                continue
            matcher = xgrammar.GrammarMatcher(self.compile(spec))
            for token in output:
                self._accepts(matcher, token)
            self.matchers[seq_id] = matcher

    def masks(self, seq_ids: Sequence[int], draft_ids: np.ndarray) -> torch.Tensor:
        """Bitmasks [B, k + 1, words] (int32, bit t of word w: token 32w + t allowed) of each row's k + 1 verified
        positions; all set for an unconstrained row, after a draft the grammar refuses (that draft is rejected, so
        nothing after it is used), and after the grammar's end."""
        batch, k = draft_ids.shape
        masks = self._all_set((batch, k + 1, self.grammar_words))
        filled = np.zeros((batch, k + 1), dtype=bool)
        for b, seq_id in enumerate(seq_ids):
            matcher = self.matchers.get(seq_id)
            if matcher is None:
                continue
            if seq_id in self.unread:  # (a failed call's result: what it committed is unknown here)
                raise InternalError(f"sequence {seq_id}: its grammar's state is lost (a step's result was not read)")
            self.unread.add(seq_id)
            row = masks[b]
            taken = 0
            for j in range(k + 1):
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(row, j)
                filled[b, j] = True
                if j == k or not self._accepts(matcher, int(draft_ids[b, j])):  # (-1: unselected)
                    break
                taken += 1
            if taken:
                matcher.rollback(taken)
        return self._widened(masks, filled)

    def _accepts(self, matcher: xgrammar.GrammarMatcher, token: int) -> bool:
        """Whether `matcher` took `token`; an id the tokenizer lacks (or -1) refused without asking xgrammar."""
        return 0 <= token < self.grammar_vocab and matcher.accept_token(token)

    def _widened(self, masks: torch.Tensor, filled: np.ndarray) -> torch.Tensor:
        """Bitmasks [..., grammar_words] as [..., words]: past the tokenizer's ids, 0 where `filled` (those ids are
        refused), all set elsewhere (unconstrained or ended)."""
        if self.grammar_vocab == self.vocab_size:
            return masks
        if self.grammar_vocab % 32 and filled.any():  # (the last word's bits past the tokenizer's ids)
            last = masks[..., -1]
            last[torch.from_numpy(filled)] &= (1 << (self.grammar_vocab % 32)) - 1
        # (numpy's copies: a torch one this wide may wake its threads, which then spin on a many-core host)
        wide = torch.empty((*masks.shape[:-1], self.words), dtype=torch.int32, pin_memory=self.pin)
        host = wide.numpy()
        host[..., : self.grammar_words] = masks.numpy()
        host[..., self.grammar_words :] = np.where(filled, 0, -1)[..., None]
        return wide

    def _all_set(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Bitmasks of `shape` (int32) allowing every token, to be filled; pinned where they go to the device as
        they are (no widening)."""
        masks = torch.empty(shape, dtype=torch.int32, pin_memory=self.pin and self.grammar_vocab == self.vocab_size)
        masks.numpy().fill(-1)
        return masks

    def first_masks(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """Each sequence's bitmask [B, words] of its next token (a prefill's)."""
        return self.masks(seq_ids, np.zeros((len(seq_ids), 0), dtype=np.int64))[:, 0]

    def advance(self, seq_ids: Sequence[int], emitted: Sequence[Sequence[int]]) -> None:
        """Each constrained sequence's matcher past the tokens it emitted."""
        for seq_id, tokens in zip(seq_ids, emitted, strict=True):
            matcher = self.matchers.get(seq_id)
            if matcher is not None:
                self.unread.discard(seq_id)
                for token in tokens:
                    if matcher.is_terminated():  # (with ignore_eos: the grammar ended; what follows is free)
                        break
                    self._accepts(matcher, token)

    def draft_masks(self, seq_ids: Sequence[int], drafted: Sequence[int] | None) -> torch.Tensor:
        """The draft's, between its forwards: each constrained row's matcher takes its last draft (`drafted`, None
        at a proposal's first position), then gives the bitmask [B, words] of its next position (all set where
        unconstrained or ended). `rollback_drafts` undoes the drafts taken."""
        masks = self._all_set((len(seq_ids), self.grammar_words))
        filled = np.zeros(len(seq_ids), dtype=bool)
        for b, seq_id in enumerate(seq_ids):
            matcher = self.matchers.get(seq_id)
            if matcher is None:
                continue
            if drafted is not None and not matcher.is_terminated() and self._accepts(matcher, int(drafted[b])):
                self._drafts_taken[seq_id] = self._drafts_taken.get(seq_id, 0) + 1
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(masks, b)
                filled[b] = True
        return self._widened(masks, filled)

    def rollback_drafts(self) -> None:
        """Each matcher back where it was before the drafts `draft_masks` took."""
        for seq_id, taken in self._drafts_taken.items():
            self.matchers[seq_id].rollback(taken)
        self._drafts_taken.clear()

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self.matchers.pop(seq_id, None)
            self.unread.discard(seq_id)


def _tokenizer_vocab(tokenizer: Any, vocab_size: int, eos: Sequence[int]) -> int:
    """The ids a grammar's matcher knows: the tokenizer's (its stop ids included), at most the model's."""
    ids = max(tokenizer.get_vocab().values(), default=-1) + 1
    return min(vocab_size, max(ids, len(tokenizer), *(e + 1 for e in eos)))


def allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bitmasks [..., words] (int32) as booleans [..., vocab]: graph-safe, on any device. Unpacked a byte at a time
    (the words' little-endian bytes: bit t of byte j is token 8j + t of the word's 32): uint8 intermediates a
    quarter of int32 ones, 1.4x faster over 128,256 tokens on a CPU, and their 0/1 read as booleans without a copy."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)  # (made here: a graph's pool may hold it)
    bits = (bitmask.contiguous().view(torch.uint8)[..., None] >> shifts) & 1
    return bits.flatten(-2)[..., :vocab].view(torch.bool)


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [B, n, V] with the tokens `bitmask` [B, n, words] does not allow at -inf: their p is 0. (xgrammar's
    CPU kernel is slower where most tokens are refused, as under a JSON schema: 3x at [4, 5, 4096].)"""
    return torch.where(allowed(bitmask, logits.shape[-1]), logits, float("-inf"))
