"""Train an EAGLE head for the demo target from its own hidden states on the stdlib corpus (a CPU, under an hour).

    python scripts/train_demo_eagle.py --eagle3 --intermediate 2560 --bf16 --threads 2 --lr 3e-3 --warmup 30 \
        --steps 20000 --cpu-budget 5500 --greedy-windows 16384 --corpus-windows 16384 [--out DIR]

Self-distillation (EAGLE's data): windows of a training prompt (`--prompt-len` corpus tokens) and the target's own
greedy continuation, the target's states of them computed once (it is frozen) and reused every epoch. The head reads
the target's layers 1, 3 and 5 (`--eagle3`; HF `output_hidden_states` numbering, design section 13) or its last
hidden state after its norm (EAGLE-1) and learns the target's next-token distribution (KL; EAGLE-1 also regresses
the target's next feature, smooth L1, the KL weighted `--cls-weight`). Training runs the head as the server drafts
with it (`EagleProposer`), unrolled over `--unroll` draft steps ("training-time test"): step 0 at each position reads
the target's features; step j reads the head's own output of step j - 1 one position earlier, at rotary position
p + j, attending to the target-fed keys up to p and to its own keys of steps 1..j (`unrolled_forward`, checked
against the serving path at start). The LM head and final norm start from the target's (the LM head frozen unless
`--train-lm-head`), `fc` from its last layer read. AdamW, linear warm-up, cosine decay over `--steps` or
`--cpu-budget` CPU seconds, whichever ends first. Saved in the published format (EAGLE-3: `midlayer.*`, `fc`,
`norm`, `lm_head`, `d2t`; EAGLE-1: `fc`, `layers.0.*`), float16, so `minedraft serve --draft <out>` serves it.
Evaluated as the demo pair is (`train_demo_pair.py`): greedy speculative decoding of held-out prompts at k=4, mean
accepted length and draft time per step (the head through `EagleProposer`, the demo draft with its KV cache), beside
the demo draft's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # its modules beside it, run from anywhere

from draft_service.eagle import EagleProposer  # noqa: E402
from draft_service.eagle_head import EagleHead, HeadSpec, _rotate_half  # noqa: E402
from minedraft.demo_models import DRAFT_DIR, TARGET_DIR  # noqa: E402
from scripts.demo_pair_data import collect_corpus, encode_docs, pick_prompts, token_stream  # noqa: E402

EAGLE1_LAYERS = (6,)  # EAGLE-1 reads the target's last hidden state (normed); EAGLE-3 reads --layers
STARTED = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - STARTED:7.1f}s] {msg}", flush=True)


def make_head(target: Any, eagle3: bool, layers: tuple[int, ...], intermediate: int = 0) -> EagleHead:
    """A head of the target's width. EAGLE-1: `fc` starts passing the target's feature through, its LM head is the
    target's (frozen). EAGLE-3: its LM head and final norm start as the target's, `fc` reading its last layer read."""
    from transformers import LlamaConfig

    tc = target.config
    config = LlamaConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=intermediate or tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim,
        num_hidden_layers=1,
        rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings,
        vocab_size=tc.vocab_size,
        initializer_range=0.02,
    )
    hidden = tc.hidden_size
    if eagle3:
        config.draft_vocab_size = tc.vocab_size  # (the whole vocabulary: d2t all zeros)
    head = EagleHead(config, eagle3=eagle3, fc_inputs=(len(layers) if eagle3 else 2) * hidden, fc_bias=not eagle3)
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
    with torch.no_grad():
        head.fc.weight[:, -hidden:] += torch.eye(hidden)
        head.self_attn.o_proj.weight.mul_(0.1)
        head.mlp.down_proj.weight.mul_(0.1)
        if eagle3:
            head.lm_head.weight.copy_(target.get_output_embeddings().weight.float())
            head.norm.weight.copy_(target.model.norm.weight.float())
    head.embed = torch.nn.Embedding.from_pretrained(target.get_input_embeddings().weight.detach().float().clone())
    if not eagle3:
        head.target_head = torch.nn.Linear(hidden, tc.vocab_size, bias=False).requires_grad_(False)
        head.target_head.weight.data = target.get_output_embeddings().weight.detach().float().clone()
    return head


def _rope(head: EagleHead, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, heads, n, d] at positions [n]."""
    cos, sin = head.rotary(x.new_zeros(1, 1), positions[None])
    return x * cos[0] + _rotate_half(x) * sin[0]


def unrolled_forward(head: EagleHead, aux: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's outputs [B, n, H] for each draft step j < `steps` over windows: `aux` [B, n + steps - 1, 3H] the
    target's layers, `tokens` [B, n + steps] with tokens[:, p + 1] the token after position p. Step j at index p is
    the draft at position p + j of a proposal whose last target-fed position is p (as `EagleProposer._chain` runs)."""
    attn = head.self_attn
    batch, n = aux.shape[0], aux.shape[1] - steps + 1
    groups = attn.heads // attn.kv_heads
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    hidden = head.features(aux[:, :n])
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs = []
    for j in range(steps):
        embeds = head.embed(tokens[:, j + 1 : j + 1 + n])
        if not head.eagle3:
            x = residual = head.fc(torch.cat([embeds, hidden], dim=-1))
        elif head.norm_before_residual:
            normed = residual = head.hidden_norm(hidden)
            x = torch.cat([head.input_layernorm(embeds), normed], dim=-1)
        else:
            residual, normed = hidden, head.hidden_norm(hidden)
            x = torch.cat([head.input_layernorm(embeds), normed], dim=-1)
        positions = torch.arange(j, j + n)
        q = _rope(head, attn.q_proj(x).view(batch, n, attn.heads, attn.head_dim).transpose(1, 2), positions)
        k = _rope(head, attn.k_proj(x).view(batch, n, attn.kv_heads, attn.head_dim).transpose(1, 2), positions)
        v = attn.v_proj(x).view(batch, n, attn.kv_heads, attn.head_dim).transpose(1, 2)
        keys.append(k.repeat_interleave(groups, dim=1))
        values.append(v.repeat_interleave(groups, dim=1))
        scale = 1.0 / math.sqrt(attn.head_dim)
        scores = (q @ keys[0].transpose(-1, -2)) * scale  # the target-fed positions up to p
        scores = scores.masked_fill(~causal, float("-inf"))
        own = [(q * key).sum(-1, keepdim=True) * scale for key in keys[1:]]  # steps 1..j at index p
        weights = torch.softmax(torch.cat([scores, *own], dim=-1), dim=-1)
        mixed = weights[..., :n] @ values[0]
        for i, value in enumerate(values[1:]):
            mixed = mixed + weights[..., n + i : n + i + 1] * value
        attended = attn.o_proj(mixed.transpose(1, 2).reshape(batch, n, -1))
        residual = residual + attended
        out = residual + head.mlp(head.post_attention_layernorm(residual))
        outs.append(out)
        hidden = out
    return outs


@torch.no_grad()
def check_against_serving(head: EagleHead, aux: torch.Tensor, tokens: torch.Tensor, steps: int) -> None:
    """`unrolled_forward` equals the serving path (`EagleHead.forward` with its keys, as `EagleProposer` chains)."""
    outs = unrolled_forward(head, aux[None], tokens[None], steps)
    n = aux.shape[0] - steps + 1
    features = head.features(aux[:n])
    first, kv_all = head(tokens[1 : n + 1], features, torch.arange(n), None)
    for p in range(n):
        kv = (kv_all[0][:, : p + 1], kv_all[1][:, : p + 1])
        out = first[p]
        for j in range(1, steps):
            step, kv = head(tokens[p + j + 1 : p + j + 2], out[None], torch.tensor([p + j]), kv)
            out = step[-1]
            error = float((out - outs[j][0, p]).abs().max())
            if error > 1e-4:
                raise SystemExit(f"training forward differs from serving at position {p}, step {j}: {error}")
    if float((first - outs[0][0]).abs().max()) > 1e-4:
        raise SystemExit("training forward differs from serving at step 0")


@torch.no_grad()
def greedy_windows(
    target: Any,
    stream: torch.Tensor,
    count: int,
    prompt_len: int,
    new: int,
    seed: int,
    made: torch.Tensor | None = None,
) -> torch.Tensor:
    """`count` windows of a training prompt and the target's greedy continuation ([count, prompt_len + new]); `made`:
    the first windows of the same draw, made before (the offsets of a longer draw begin with a shorter one's)."""
    gen = torch.Generator().manual_seed(seed + 1)
    offsets = torch.randint(0, stream.numel() - prompt_len, (count,), generator=gen)
    skip = 0 if made is None else len(made)
    prompts = torch.stack([stream[o : o + prompt_len] for o in offsets[skip:].tolist()])
    windows = [] if made is None else [made]
    for chunk in prompts.split(256):  # per window 17 ms at 256 against 23 at 64 (2 threads)
        out = target.generate(
            chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
        windows.append(out[:, : prompt_len + new])
        log(f"  {sum(len(w) for w in windows)}/{count} windows generated")
    return torch.cat(windows)


@torch.no_grad()
def target_states(target: Any, windows: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's features the head reads ([N, W, len(layers) H]) and its last hidden state after its norm (what
    its LM head reads, [N, W, H]), float16 (computed once: the target is frozen, so every epoch reuses them)."""
    aux, final = [], []
    for chunk in windows.split(64):
        out = target.model(chunk, output_hidden_states=True)
        aux.append(torch.cat([out.hidden_states[i] for i in layers], dim=-1).half())
        final.append(out.hidden_states[-1].half())
    return torch.cat(aux), torch.cat(final)


def batch_loss(
    head: EagleHead,
    target: Any,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    steps: int,
    decay: float,
    cls_weight: float,
    noise: float,
    bf16: bool = False,
) -> tuple[torch.Tensor, list[float], float, list[float]]:
    """Summed over the draft steps (step j weighted decay^j): EAGLE-3, KL to the target's next-token distribution;
    EAGLE-1, the regression of the target's next feature (smooth L1) plus `cls_weight` x that KL (the LM head is the
    target's, frozen). `batch`: windows' tokens [B, W], the target's features [B, W, F] and last normed hidden
    states [B, W, H]; uniform noise of `noise` x the features' RMS on the target-fed features (EAGLE's). Returns
    the loss, each step's KL, the mean regression and each step's rate of drafts that chain-match the target's
    greedy choice (step j right and every step before it: what greedy verification accepts). `bf16`: the head's
    matmuls in bfloat16 (CPU autocast; about 1.4x a step where the CPU has AVX-512 BF16), the KL in float32."""
    windows, aux_all, final_all = batch
    n = windows.shape[1] - steps
    aux = aux_all[:, : n + steps - 1].float()
    if noise:
        aux = aux + (torch.rand_like(aux) * 2 - 1) * noise * aux.pow(2).mean().sqrt()
    final = final_all.float()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        outs = unrolled_forward(head, aux, windows, steps)
    lm_head = target.get_output_embeddings()
    with torch.no_grad():  # the target's at positions 1..W-1, shared by every step (each reads a slice)
        want_all = F.log_softmax(lm_head(final[:, 1:]), dim=-1)
        probs_all = want_all.exp()
        neg_entropy = (probs_all * want_all).sum(-1)  # KL(p || q) = sum p log p - sum p log q
        best_all = want_all.argmax(-1)
    loss, kls, reg_sum, chain, rates = torch.zeros(()), [], 0.0, None, []
    for j, hidden in enumerate(outs):
        want_feature = final[:, j + 1 : j + 1 + n]  # the target's at p + j + 1, after the token there
        probs = probs_all[:, j : j + n]
        if head.eagle3:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = head.lm_head(head.norm(hidden))
            got = F.log_softmax(logits.float(), dim=-1)
            reg = torch.zeros(())
        else:
            reg = F.smooth_l1_loss(hidden.float(), want_feature)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = lm_head(hidden)
            got = F.log_softmax(logits.float(), dim=-1)
        kl = (neg_entropy[:, j : j + n].sum() - (probs * got).sum()) / (got.shape[0] * n)  # batchmean
        loss = loss + decay**j * (kl if head.eagle3 else reg + cls_weight * kl)
        with torch.no_grad():
            right = got.argmax(-1) == best_all[:, j : j + n]
            chain = right if chain is None else chain & right
            rates.append(float(chain.float().mean()))
        kls.append(float(kl.detach()))
        reg_sum += float(reg) / steps
    return loss, kls, reg_sum, rates


def save_head(head: EagleHead, layers: tuple[int, ...], target: Any, out: Path, report: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in head.state_dict().items():
        if name.startswith(("embed.", "rotary.", "target_head.")):
            continue
        top = name in ("fc.weight", "fc.bias", "norm.weight", "lm_head.weight", "d2t")
        value = tensor if name == "d2t" else tensor.to(torch.float16)
        prefix = "midlayer." if head.eagle3 else "layers.0."
        tensors[name if top else prefix + name] = value.contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    tc = target.config
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3" if head.eagle3 else "LlamaForCausalLMEagle"],
        "model_type": "llama",
        "hidden_size": tc.hidden_size,
        "intermediate_size": head.mlp.down_proj.in_features,
        "num_attention_heads": tc.num_attention_heads,
        "num_key_value_heads": tc.num_key_value_heads,
        "head_dim": tc.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": tc.rms_norm_eps,
        "max_position_embeddings": tc.max_position_embeddings,
        "vocab_size": tc.vocab_size,
        "torch_dtype": "float16",
        "minedraft_demo": {"command": report["command"], "target": "minedraft/demo_models/target"},
    }
    if head.eagle3:
        config.update(draft_vocab_size=tc.vocab_size, eagle_aux_hidden_state_layer_ids=list(layers))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


@torch.no_grad()
def eagle_speculative(target: Any, proposer: EagleProposer, prompt: list[int], n: int, k: int):
    """Greedy speculative decoding with the head (the target by full recomputation, an evaluation only): (tokens,
    verify steps, accepted drafts, seconds in the head's proposals)."""

    def states(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        out = target(torch.tensor([tokens]), output_hidden_states=True)
        return torch.cat([out.hidden_states[i][0] for i in proposer.spec.layers], -1), out.logits[0].argmax(-1)

    proposer.release([0])
    hidden, best = states(prompt)
    proposer.add_hidden([0], [hidden], admitting=True)
    proposer.prefill([0], [prompt], [])
    tokens, accepted_total, steps, verdict, draft_s = list(prompt), 0, 0, (0, int(best[-1])), 0.0
    while len(tokens) - len(prompt) < n:
        start = time.perf_counter()
        proposal = proposer.propose([0], torch.tensor([verdict[0]]), torch.tensor([verdict[1]]), k)
        draft_s += time.perf_counter() - start
        drafts = proposal.draft_ids[0].tolist()
        tokens.append(verdict[1])
        hidden, best = states(tokens + drafts)
        choices = best[len(tokens) - 1 :].tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == choices[accepted]:
            accepted += 1
        proposer.add_hidden([0], [hidden[len(tokens) - 1 : len(tokens) + accepted]])
        tokens += drafts[:accepted]
        verdict = (accepted, choices[accepted])
        steps, accepted_total = steps + 1, accepted_total + accepted
    return (tokens + [verdict[1]])[len(prompt) :][:n], steps, accepted_total, draft_s


@torch.no_grad()
def draft_speculative(target: Any, draft: Any, prompt: list[int], n: int, k: int):
    """The same with the demo draft model drafting from its KV cache (as the draft service runs it): (tokens,
    verify steps, accepted drafts, seconds in the draft's proposals)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    best = target(torch.tensor([prompt])).logits[0].argmax(-1)
    tokens, accepted_total, steps, draft_s = list(prompt), 0, 0, 0.0
    pending = [int(best[-1])]
    cached = 0  # tokens whose keys the draft's cache holds
    while len(tokens) - len(prompt) < n:
        start = time.perf_counter()
        tokens.append(pending[-1])
        feed = tokens[cached:]
        drafts: list[int] = []
        for _ in range(k):
            logits = draft(torch.tensor([feed]), past_key_values=cache, use_cache=True).logits[0, -1]
            drafts.append(int(logits.argmax()))
            feed = drafts[-1:]
        extra = cache.get_seq_length() - len(tokens)  # the drafts' keys (the verify decides which stay)
        if extra:
            cache.crop(-extra)
        cached = len(tokens)
        draft_s += time.perf_counter() - start
        choices = target(torch.tensor([tokens + drafts])).logits[0].argmax(-1)[len(tokens) - 1 :].tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == choices[accepted]:
            accepted += 1
        tokens += drafts[:accepted]
        pending = [choices[accepted]]
        steps, accepted_total = steps + 1, accepted_total + accepted
    return (tokens + pending)[len(prompt) :][:n], steps, accepted_total, draft_s


def evaluate(target: Any, head: EagleHead, layers: tuple[int, ...], prompts: list[list[int]], k: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    proposer = EagleProposer(head, HeadSpec(head.eagle3, layers), num_slots=1)
    draft = AutoModelForCausalLM.from_pretrained(DRAFT_DIR, dtype=torch.float32).eval()
    totals = {"eagle": [0, 0, 0.0], "draft": [0, 0, 0.0]}
    same = 0
    for prompt in prompts:
        got, steps, accepted, seconds = eagle_speculative(target, proposer, prompt, 64, k)
        ref, ref_steps, ref_accepted, ref_seconds = draft_speculative(target, draft, prompt, 64, k)
        same += got == ref
        for name, figures in (("eagle", (steps, accepted, seconds)), ("draft", (ref_steps, ref_accepted, ref_seconds))):
            totals[name] = [a + b for a, b in zip(totals[name], figures)]
    return {
        "mean_accepted_length": {name: round(acc / max(st, 1) + 1, 3) for name, (st, acc, _) in totals.items()},
        "draft_ms_per_step": {name: round(1000 * s / max(st, 1), 2) for name, (st, _, s) in totals.items()},
        "output_equals_draft_model_run": f"{same}/{len(prompts)}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "minedraft" / "demo_models" / "eagle"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=96)
    parser.add_argument("--unroll", type=int, default=4, help="draft steps trained per position (k at eval)")
    parser.add_argument("--decay", type=float, default=0.8, help="weight of step j's loss: decay^j")
    parser.add_argument("--greedy-windows", type=int, default=4096, help="windows of the target's own output")
    parser.add_argument("--prompt-len", type=int, default=32, help="corpus tokens before each greedy continuation")
    parser.add_argument("--corpus-windows", type=int, default=0, help="raw corpus windows beside the greedy ones")
    parser.add_argument("--noise", type=float, default=0.0, help="uniform noise on the target's features (x RMS)")
    parser.add_argument("--warmup", type=int, default=50, help="steps of linear learning-rate warm-up")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--cpu-budget", type=float, default=0, help="CPU seconds of training at most (0: no limit)")
    parser.add_argument("--wall-budget", type=float, default=0, help="wall seconds of training at most (0: none)")
    parser.add_argument("--train-lm-head", action="store_true", help="EAGLE-3: train its LM head (else frozen)")
    parser.add_argument(
        "--windows-cache",
        default="",
        help="a file keeping the greedy windows between runs (grown by a run that asks for more)",
    )
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--intermediate", type=int, default=0, help="the head's MLP width (0: the target's)")
    parser.add_argument("--eagle3", action="store_true", help="an EAGLE-3 head (--layers) instead of EAGLE-1")
    parser.add_argument("--layers", default="1,3,5", help="EAGLE-3: the target's layers it reads (HF numbering)")
    parser.add_argument("--cls-weight", type=float, default=0.2, help="EAGLE-1: weight of the KL beside regression")
    parser.add_argument("--eval-prompts", type=int, default=20)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", default="", help="a head this script saved, to train on from")
    parser.add_argument("--bf16", action="store_true", help="the head's matmuls in bfloat16 (CPU autocast)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    target = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval().requires_grad_(False)
    tokenizer = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json"))
    eos = int(target.config.eos_token_id)
    train_docs, heldout_docs = collect_corpus(Path(sysconfig.get_paths()["stdlib"]), 0.05)
    stream = token_stream(encode_docs(tokenizer, train_docs), eos)
    heldout = encode_docs(tokenizer, heldout_docs)
    log(f"corpus: {len(train_docs)} train files ({stream.numel():,} tokens), {len(heldout_docs)} held out")
    layers = tuple(int(i) for i in args.layers.split(",")) if args.eagle3 else EAGLE1_LAYERS
    head = make_head(target, args.eagle3, layers, args.intermediate)
    if args.resume:  # training goes on from a head this script saved
        from safetensors.torch import load_file

        saved = load_file(str(Path(args.resume) / "model.safetensors"))
        state = {k.removeprefix("layers.0.").removeprefix("midlayer."): v.float() for k, v in saved.items()}
        missing = set(head.load_state_dict(state, strict=False).missing_keys)
        assert not {k for k in missing if not k.startswith(("embed.", "rotary.", "target_head."))}, missing
    window = args.seq_len + args.unroll
    probe = stream[: 12 + args.unroll]
    with torch.no_grad():
        probe_out = target(probe[None, :-1], output_hidden_states=True)
    check_against_serving(head, torch.cat([probe_out.hidden_states[i][0] for i in layers], -1), probe, args.unroll)
    start = time.time()
    prompt_len = min(args.prompt_len, window - 1)
    cached = Path(args.windows_cache) if args.windows_cache else None
    key = [args.greedy_windows, prompt_len, window, args.seed]
    kept = torch.load(cached) if cached and cached.is_file() else None
    if kept is not None and kept["key"][0] >= key[0] and kept["key"][1:] == key[1:]:
        windows = kept["windows"][: args.greedy_windows]
    else:
        made = kept["windows"] if kept is not None and kept["key"][1:] == key[1:] else None  # grown, not made again
        windows = greedy_windows(target, stream, args.greedy_windows, prompt_len, window - prompt_len, args.seed, made)
        if cached:
            torch.save({"key": key, "windows": windows}, cached)
    log(f"{len(windows)} windows of the target's greedy output in {time.time() - start:.1f}s")
    if args.corpus_windows:  # raw corpus windows beside them (the target's distribution on text it did not write)
        offsets = torch.randint(0, stream.numel() - window, (args.corpus_windows,), generator=gen)
        windows = torch.cat([windows, torch.stack([stream[o : o + window] for o in offsets.tolist()])])
    aux_all, final_all = target_states(target, windows, layers)
    data_s = time.time() - start
    log(f"the target's states of {len(windows)} windows ({aux_all.numel() * 2 / 2**20:.0f} MB) in {data_s:.1f}s")
    frozen = ("embed.", "target_head.") + (() if args.train_lm_head else ("lm_head.",))
    params = [p for name, p in head.named_parameters() if not name.startswith(frozen)]
    for name, param in head.named_parameters():
        param.requires_grad_(not name.startswith(frozen))
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start = time.time()
    running, rate_sum, curve = torch.zeros(3), torch.zeros(args.unroll), []
    cpu_start = time.process_time()
    steps_run = 0
    for step in range(args.steps):
        # The schedule runs on whichever ends first: the steps, the CPU-time or the wall-time budget.
        progress = max(
            step / args.steps,
            (time.process_time() - cpu_start) / args.cpu_budget if args.cpu_budget else 0,
            (time.time() - start) / args.wall_budget if args.wall_budget else 0,
        )
        if progress >= 1:
            break
        warm = min(1.0, (step + 1) / args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * warm * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
        steps_run = step + 1
        picks = torch.randint(0, len(windows), (args.batch,), generator=gen)
        batch = (windows[picks], aux_all[picks], final_all[picks])
        loss, kls, reg, rates = batch_loss(
            head, target, batch, args.unroll, args.decay, args.cls_weight, args.noise, args.bf16
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        running += torch.tensor([float(loss), sum(kls) / len(kls), reg])
        rate_sum += torch.tensor(rates)
        if (step + 1) % args.log_every == 0:
            loss_, kl_, reg_ = (running / args.log_every).tolist()
            chain = (rate_sum / args.log_every).tolist()
            point = {
                "step": step + 1,
                "seconds": round(time.time() - start, 1),
                "cpu_seconds": round(time.process_time() - cpu_start, 1),
                "loss": round(loss_, 4),
                "kl_per_step": round(kl_, 4),
                "regression": round(reg_, 5),
                "train_chain_match": [round(r, 3) for r in chain],
                "train_accepted_length": round(1 + sum(chain), 3),
            }
            curve.append(point)
            log(json.dumps(point))
            running.zero_()
            rate_sum.zero_()
    train_s, train_cpu_s = time.time() - start, time.process_time() - cpu_start
    head.eval().requires_grad_(False)
    with torch.no_grad():  # evaluate the weights as shipped (float16)
        for name, param in head.named_parameters():
            if not name.startswith(("embed.", "target_head.")):
                param.copy_(param.half().float())
    prompts = pick_prompts(heldout, args.eval_prompts, 64, 64, args.seed)
    report: dict[str, Any] = {
        "command": "python scripts/train_demo_eagle.py " + " ".join(sys.argv[1:]),
        "corpus": f"stdlib of Python {sys.version.split()[0]}, {stream.numel()} train tokens",
        "steps": steps_run,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "unroll": args.unroll,
        "format": "EAGLE-3" if args.eagle3 else "EAGLE-1",
        "resumed_from": args.resume or None,
        "greedy_windows": args.greedy_windows,
        "corpus_windows": args.corpus_windows,
        "prompt_len": prompt_len,
        "lr": args.lr,
        "warmup": args.warmup,
        "decay": args.decay,
        "cls_weight": args.cls_weight,
        "noise": args.noise,
        "bf16": args.bf16,
        "cpu_budget": args.cpu_budget,
        "wall_budget": args.wall_budget,
        "positions_trained": steps_run * args.batch * args.seq_len,
        "lm_head": "trained" if args.train_lm_head else "the target's, frozen",
        "threads": torch.get_num_threads(),
        "data_seconds": round(data_s, 1),
        "train_seconds": round(train_s, 1),
        "train_cpu_seconds": round(train_cpu_s, 1),
        "k": args.k,
        "prompts": len(prompts),
    }
    report["curve"] = curve
    save_head(head, layers, target, Path(args.out), report)  # (before the evaluation: minutes more on a busy CPU)
    log(f"saved {args.out}; evaluating on {len(prompts)} held-out prompts")
    report |= evaluate(target, head, layers, prompts, args.k)
    log(f"k={args.k}: {json.dumps(report)}")
    save_head(head, layers, target, Path(args.out), report)
    log(f"saved {args.out}: {json.dumps(report)}")


if __name__ == "__main__":
    main()
