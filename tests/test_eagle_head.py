"""EAGLE-1 and EAGLE-3 heads in their published checkpoint formats: loaded and run by the drafter, they draft what
the same head computed by hand (plain tensor code over the checkpoint's tensors) on the target's HF hidden states."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen3Config

from draft_service import eagle as eagle_module
from draft_service.drafter import resolve_method
from draft_service.eagle import EagleProposer
from draft_service.eagle_head import load_eagle_head

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, DRAFT_VOCAB = 64, 4, 2, 16, 96, 128, 48
EPS, THETA = 1e-6, 10000.0


def make_target(root: Path, arch: str, layers: int) -> tuple[Path, PreTrainedModel]:
    torch.manual_seed(0)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
        rms_norm_eps=EPS,
    )
    config = LlamaConfig(**common) if arch == "llama" else Qwen3Config(**common)
    model = AutoModelForCausalLM.from_config(config).eval()
    directory = root / f"{arch}-target"
    model.save_pretrained(directory)
    return directory, model


def head_tensors(eagle3: bool, fc_inputs: int) -> dict[str, torch.Tensor]:
    """Random weights under the names the published heads use (norms not ones, so a misplaced norm shows)."""
    g = torch.Generator().manual_seed(1 if eagle3 else 2)

    def rand(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    attn_in = 2 * HIDDEN if eagle3 else HIDDEN
    prefix = "midlayer." if eagle3 else "layers.0."
    tensors = {
        "fc.weight": rand(HIDDEN, fc_inputs),
        f"{prefix}self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, attn_in),
        f"{prefix}self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, attn_in),
        f"{prefix}self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, attn_in),
        f"{prefix}self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
        f"{prefix}mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
        f"{prefix}mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE),
        f"{prefix}post_attention_layernorm.weight": 1 + rand(HIDDEN),
    }
    if eagle3:
        ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
        tensors |= {
            "midlayer.input_layernorm.weight": 1 + rand(HIDDEN),
            "midlayer.hidden_norm.weight": 1 + rand(HIDDEN),
            "norm.weight": 1 + rand(HIDDEN),
            "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN, scale=1.0),
            "d2t": ids - torch.arange(DRAFT_VOCAB),
            "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill(0, ids, True),
        }
    else:
        tensors |= {"fc.bias": rand(HIDDEN), "embed_tokens.weight": rand(VOCAB, HIDDEN)}
    return tensors


def save_head(root: Path, eagle3: bool, fc_inputs: int, aux_ids: list[int] | None) -> Path:
    directory = root / ("eagle3" if eagle3 else "eagle")
    directory.mkdir()
    config: dict[str, object] = dict(
        architectures=["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"],
        model_type="llama",
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_hidden_layers=1,
        rms_norm_eps=EPS,
        rope_theta=THETA,
        max_position_embeddings=256,
        vocab_size=VOCAB,
        hidden_act="silu",
    )
    if eagle3:
        config["draft_vocab_size"] = DRAFT_VOCAB
        if aux_ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = aux_ids
    (directory / "config.json").write_text(json.dumps(config))
    tensors = head_tensors(eagle3, fc_inputs)
    if eagle3:
        save_file(tensors, str(directory / "model.safetensors"))
    else:  # the published EAGLE-1 heads are pytorch_model.bin
        torch.save(tensors, directory / "pytorch_model.bin")
    return directory


# ------------------------------------------------------------------- the head by hand, over whole sequences


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = torch.cat([positions[:, None] * inv] * 2, dim=-1)  # [n, d]
    half = HEAD_DIM // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * angles.cos() + rotated * angles.sin()


def by_hand(w: dict[str, torch.Tensor], eagle3: bool, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The head's outputs at positions 0 .. n-1, each reading the next token's embedding and its hidden state."""
    p = "midlayer." if eagle3 else "layers.0."
    n = embeds.shape[0]
    if eagle3:
        residual = hidden
        x = torch.cat([rms(embeds, w[p + "input_layernorm.weight"]), rms(hidden, w[p + "hidden_norm.weight"])], -1)
    else:
        x = residual = torch.cat([embeds, hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
    positions = torch.arange(n, dtype=torch.float32)
    q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM).transpose(0, 1), positions)
    k = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM).transpose(0, 1), positions)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    scores = (q @ k.transpose(1, 2)) / HEAD_DIM**0.5 + torch.full((n, n), float("-inf")).triu(1)
    attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
    residual = residual + attended
    y = rms(residual, w[p + "post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[
        p + "mlp.down_proj.weight"
    ].T
    return residual + mlp


def logits_by_hand(
    w: dict[str, torch.Tensor], eagle3: bool, out: torch.Tensor, target: PreTrainedModel
) -> torch.Tensor:
    if not eagle3:
        return out @ target.lm_head.weight.T
    full = torch.full((VOCAB,), float("-inf"))
    ids = torch.arange(DRAFT_VOCAB) + w["d2t"]
    full[ids] = rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
    return full


def drafts_by_hand(
    w: dict[str, torch.Tensor], eagle3: bool, target: PreTrainedModel, tokens: list[int], features: torch.Tensor, k: int
) -> list[int]:
    """k greedy drafts after `tokens`, whose positions but the last have target `features`: each draft step
    appends (the draft, the head's last output) and runs the whole sequence again."""
    embed = torch.as_tensor(target.get_input_embeddings().weight)
    next_tokens, hidden = list(tokens[1:]), features
    drafts: list[int] = []
    for _ in range(k):
        out = by_hand(w, eagle3, embed[torch.tensor(next_tokens)], hidden)[-1]
        drafts.append(int(logits_by_hand(w, eagle3, out, target).argmax()))
        next_tokens.append(drafts[-1])
        hidden = torch.cat([hidden, out[None]])
    return drafts


def target_hidden(target: PreTrainedModel, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    with torch.inference_mode():
        states = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in layers], dim=-1)


@pytest.mark.parametrize(("arch", "eagle3"), [("llama", True), ("qwen3", True), ("llama", False)])
def test_head_drafts_as_by_hand(tmp_path: Path, arch: str, eagle3: bool) -> None:
    """Through a prefill and two proposals (the second after a verify that accepted 2 of 3 drafts), the drafts equal
    the head's by hand. Llama: EAGLE-3's default layers (2, N/2, N-3); Qwen3: the config's own ids."""
    layers = 6
    target_dir, target = make_target(tmp_path, arch, layers)
    aux = [1, 3, 4] if arch == "qwen3" else None
    fc_inputs = 3 * HIDDEN if eagle3 else 2 * HIDDEN
    head_dir = save_head(tmp_path, eagle3, fc_inputs, aux)
    assert resolve_method("auto", str(head_dir)) == ("eagle3" if eagle3 else "eagle")
    head, spec = load_eagle_head(str(head_dir), str(target_dir), eagle3)
    assert spec.layers == ((1, 3, 4) if aux else (2, 3, 3)) if eagle3 else spec.layers == (layers,)
    w = head_tensors(eagle3, fc_inputs)
    feature_of = (lambda h: h @ w["fc.weight"].T) if eagle3 else (lambda h: h)
    proposer = EagleProposer(head, spec, num_slots=4)
    rng = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, VOCAB, (11,), generator=rng).tolist()

    proposer.add_hidden([7], [target_hidden(target, prompt, spec.layers)], admitting=True)  # the target's prefill
    proposer.prefill([7], [prompt], [])
    first_token = 17
    k = 3
    got = proposer.propose([7], torch.tensor([0]), torch.tensor([first_token]), k).draft_ids[0].tolist()
    tokens = prompt + [first_token]
    want = drafts_by_hand(w, eagle3, target, tokens, feature_of(target_hidden(target, prompt, spec.layers)), k)
    assert got == want

    # The verify ran [first_token, d1, d2, d3]; it accepted d1, d2 and emitted 5: hidden states of 3 positions.
    verified = tokens + got[:2]
    proposer.add_hidden([7], [target_hidden(target, verified, spec.layers)[len(prompt) :]])
    again = proposer.propose([7], torch.tensor([2]), torch.tensor([5]), k).draft_ids[0].tolist()
    hidden = feature_of(target_hidden(target, verified, spec.layers))
    assert again == drafts_by_hand(w, eagle3, target, verified + [5], hidden, k)
    assert proposer.sequences[7].kv_len == len(verified)


def test_positions_without_target_states_run_on_the_heads_own(tmp_path: Path) -> None:
    """Tokens decoded while no proposal was asked for come without the target's states: the head runs them on its
    own last output (as its drafts), and later states line up again."""
    target_dir, target = make_target(tmp_path, "llama", 6)
    head, spec = load_eagle_head(str(save_head(tmp_path, True, 3 * HIDDEN, None)), str(target_dir), True)
    proposer = EagleProposer(head, spec, num_slots=2)
    prompt = list(range(3, 14))
    proposer.add_hidden([1], [target_hidden(target, prompt, spec.layers)], admitting=True)
    proposer.prefill([1], [prompt], [])
    drafts = proposer.propose([1], torch.tensor([0]), torch.tensor([9]), 2).draft_ids[0].tolist()
    # The verify accepted one draft, then the target decoded 7, 8, 9 and 4 alone: the proposal gets the states of
    # the last such step only (at the last 9), labelled by sequence as the channel brings them.
    history = prompt + [9, drafts[0], 7, 8, 9]
    proposer.add_states([1], target_hidden(target, history, spec.layers)[-1:])
    again = proposer.propose([1], torch.tensor([1]), torch.tensor([4]), 2, missed=[[7, 8, 9]])
    sequence = proposer.sequences[1]
    assert again.draft_ids.shape == (1, 2) and sequence.kv_len == len(sequence.tokens) - 1
    assert sequence.tokens == history + [4]
    # A sequence admitted without its prompt's states (a draft back after a loss) drafts valid ids, then takes up
    # the states that come, its earlier positions left out of the head's keys.
    proposer.prefill([2], [prompt], [])
    assert proposer.propose([2], torch.tensor([0]), torch.tensor([9]), 2).draft_ids.tolist() == [[9, 9]]
    proposer.add_states([2, 2, 2], target_hidden(target, prompt + [9, 9, 9], spec.layers)[-3:])
    proposer.propose([2], torch.tensor([2]), torch.tensor([6]), 2)
    assert proposer.sequences[2].kv_len == len(prompt) + 3


@pytest.mark.usefixtures("single_thread")
def test_sampled_output_with_a_head_keeps_the_targets_distribution(tiny_models: Any) -> None:
    """Sampled speculative decoding with an EAGLE-3 head drafting from the target's exported states (in-process, as
    the services pass them) draws sequences from exactly the target's distribution: the chi-square test of the
    sampled tests, on a vocab-8 target, the head reading layers (0, 1, 1)."""
    from test_engine_sampling import CONFIGS, LENGTH, P_FLOOR, PROMPT, SAMPLES, exact_distribution, goodness_of_fit

    from draft_service.eagle_head import EagleHead, HeadSpec
    from minedraft.engine.model_runner import ModelRunner
    from minedraft_app.offline import OfflineRequest, generate_offline
    from target_service.verifier import Verifier

    target = tiny_models.get("llama", 0, vocab=8, hidden=32, layers=1)
    tc = target.config
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.hidden_size // tc.num_attention_heads,
        vocab_size=8,
        num_hidden_layers=1,
    )
    torch.manual_seed(3)
    head = EagleHead(config, eagle3=True, fc_inputs=3 * 32).eval()
    head.embed = torch.nn.Embedding.from_pretrained(target.get_input_embeddings().weight.detach().float())
    name = "t0.8-topk6-topp0.9"
    count = SAMPLES * 3 // 4  # (the head drafts row by row: fewer rows than the other sampled tests)
    requests = [
        OfflineRequest(PROMPT, replace(CONFIGS[name], seed=7_000_001 + i, max_tokens=LENGTH)) for i in range(count)
    ]
    verifier = Verifier(ModelRunner(target, count, 16), [])
    proposer = EagleProposer(head, HeadSpec(True, (0, 1, 1)), num_slots=count)
    results = generate_offline(verifier, proposer, requests, 2, count)
    assert sum(r.accepted for r in results) > count // 4  # the head's drafts were verified, many accepted
    fit = goodness_of_fit([tuple(r.tokens) for r in results], exact_distribution(target, CONFIGS[name]))
    assert fit.impossible == 0 and fit.p_value > P_FLOOR, fit


def _scenario(width: int, k: int, rounds: int) -> list[tuple[Any, ...]]:
    """A draft service's calls for five sequences: prompts of several lengths, admitted with all of their states,
    with the last 4 only (a bounded reverse buffer), or with none (a draft back after a loss); then proposals after
    random verdicts, with spells the target decoded alone (`missed`, the states of its last step only), each round
    some rows left out and the rest listed in a shuffled order. Random states: what is compared is the batching."""
    g = torch.Generator().manual_seed(11)
    lengths, seq_ids = [5, 9, 40, 17, 11], [10, 11, 12, 13, 14]
    prompts = {s: torch.randint(1, VOCAB, (n,), generator=g).tolist() for s, n in zip(seq_ids, lengths, strict=True)}
    states = {s: len(p) for s, p in prompts.items()} | {13: 4, 14: 0}
    events: list[tuple[Any, ...]] = [
        ("states", s, torch.randn(n, width, generator=g), True) for s, n in states.items() if n
    ]
    events.append(("prefill", seq_ids, [prompts[s] for s in seq_ids]))
    accepted = dict.fromkeys(seq_ids, 0)
    for round_ in range(rounds):
        listed = [seq_ids[int(i)] for i in torch.randperm(5, generator=g)][: 5 if round_ < 2 else 3 + round_ % 3]
        missed = {
            s: torch.randint(1, VOCAB, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
            for s in listed
            if round_ % 3 == 2 and s != 14
        }
        tokens = {s: int(torch.randint(1, VOCAB, (1,), generator=g)) for s in listed}
        events.append(
            (
                "propose",
                listed,
                [accepted[s] for s in listed],
                [tokens[s] for s in listed],
                [missed.get(s, []) for s in listed],
                k,
            )
        )
        for s in listed:
            accepted[s] = int(torch.randint(0, k + 1, (1,), generator=g))
            rows = 1 if s in missed else accepted[s] + 1
            events.append(("states", s, torch.randn(rows, width, generator=g), False))
    return events


def _play(
    proposer: EagleProposer, events: list[tuple[Any, ...]], only: int | None = None
) -> dict[int, list[list[int]]]:
    """The events (those of sequence `only`, if named) through `proposer`: each sequence's drafts, in order."""
    drafts: dict[int, list[list[int]]] = {}
    for event in events:
        if event[0] == "states" and only in (None, event[1]):
            proposer.add_states([event[1]] * len(event[2]), event[2], admitting=event[3])
        elif event[0] in ("prefill", "propose"):
            picked = [i for i, s in enumerate(event[1]) if only in (None, s)]
            if not picked:
                continue
            args = [[column[i] for i in picked] for column in event[1:-1]] if event[0] == "propose" else []
            if event[0] == "prefill":
                proposer.prefill([event[1][i] for i in picked], [event[2][i] for i in picked], [])
                continue
            seq_ids, accepted, tokens, missed = args
            got = proposer.propose(seq_ids, torch.tensor(accepted), torch.tensor(tokens), event[-1], missed=missed)
            for seq_id, row in zip(seq_ids, got.draft_ids.tolist(), strict=True):
                drafts.setdefault(seq_id, []).append(row)
    return drafts


@pytest.mark.parametrize(("eagle3", "floor"), [(True, None), (False, None), (True, 8)])
def test_batched_rows_draft_as_each_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, eagle3: bool, floor: int | None
) -> None:
    """Rows of several lengths, states and verdicts in one batched proposal draft what each drafts alone (the
    by-hand test holds one row to the head's math), their head outputs and keys equal too: padding, each row's
    mask and slot, and the rollback of drafted keys leave no trace across rows. In float64: a random EAGLE-1 head
    fed its own outputs grows them step by step, and float32's last bits with them (to 1e-5 relative). `floor`:
    rows of lengths far apart (the 40-token prompt beside the others) split into groups of similar ones."""
    if floor is not None:
        monkeypatch.setattr(eagle_module, "PADDED_POSITIONS_FLOOR", floor)
    target_dir, _ = make_target(tmp_path, "llama", 6)
    fc_inputs = 3 * HIDDEN if eagle3 else 2 * HIDDEN
    head_dir = save_head(tmp_path, eagle3, fc_inputs, None)
    head, spec = load_eagle_head(str(head_dir), str(target_dir), eagle3, torch.float64)
    events = _scenario(fc_inputs if eagle3 else HIDDEN, k=3, rounds=6)
    batched = EagleProposer(head, spec, num_slots=6, max_len=8)  # (a small first cache: it grows)
    together = _play(batched, events)
    assert batched.cache.capacity > 8
    for seq_id in together:
        alone = EagleProposer(head, spec, num_slots=1)
        assert _play(alone, events, only=seq_id)[seq_id] == together[seq_id]
        mine, theirs = batched.sequences[seq_id], alone.sequences[seq_id]
        assert (mine.tokens, mine.kv_len, mine.cached) == (theirs.tokens, theirs.kv_len, theirs.cached)
        torch.testing.assert_close(batched.outputs[mine.slot], alone.outputs[0], rtol=1e-9, atol=1e-9)
        keys = batched.cache.keys[mine.slot, :, : mine.cached]
        torch.testing.assert_close(keys, alone.cache.keys[0, :, : mine.cached], rtol=1e-9, atol=1e-9)
    assert sum(len(rows) for rows in together.values()) > 20
    assert any(batched.sequences[s].kv_len > batched.sequences[s].cached for s in together)  # some left out
