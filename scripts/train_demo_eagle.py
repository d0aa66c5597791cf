"""Train an EAGLE-3 head for the demo target from its own hidden states on the stdlib corpus (CPU, minutes).

    python scripts/train_demo_eagle.py [--steps 400] [--out minedraft/demo_models/eagle3]

The head reads the target's layers 1, 3 and 5 (HF `output_hidden_states` numbering, design section 13) and learns the
target's next-token distribution (KL), at the target's positions and, as its drafts run, on its own last output (a
second pass: "training-time test"). Saved in the published EAGLE-3 format (`midlayer.*`, `fc`, `norm`, `lm_head`,
`d2t`), so `minedraft serve --draft <out>` serves it. Evaluated as the demo pair is (`train_demo_pair.py`): greedy
speculative decoding of held-out prompts at k=4, mean accepted length, beside the demo draft's on the same prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # its modules beside it, run from anywhere

from draft_service.eagle import EagleHead, EagleProposer, HeadSpec  # noqa: E402
from minedraft.demo_models import DRAFT_DIR, TARGET_DIR  # noqa: E402
from scripts.demo_pair_data import collect_corpus, encode_docs, pick_prompts, token_stream  # noqa: E402
from scripts.demo_pair_training import speculative_greedy  # noqa: E402

LAYERS = (1, 3, 5)
STARTED = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - STARTED:7.1f}s] {msg}", flush=True)


def make_head(target: Any) -> EagleHead:
    from transformers import LlamaConfig

    tc = target.config
    config = LlamaConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim,
        num_hidden_layers=1,
        rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings,
        vocab_size=tc.vocab_size,
        initializer_range=0.02,
    )
    config.draft_vocab_size = tc.vocab_size  # (the whole vocabulary: d2t all zeros)
    head = EagleHead(config, eagle3=True, fc_inputs=len(LAYERS) * tc.hidden_size)
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    head.embed = torch.nn.Embedding.from_pretrained(target.get_input_embeddings().weight.detach().float().clone())
    return head


def head_loss(head: EagleHead, target: Any, window: torch.Tensor) -> torch.Tensor:
    """KL to the target's next-token distribution over one window [L + 1]: at the target's states, then on the
    head's own previous output (as a draft's second step runs)."""
    with torch.no_grad():
        out = target(window[None, :-1], output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in LAYERS], dim=-1)
        want = F.log_softmax(out.logits[0, 1:].float(), dim=-1)  # the target's at p + 1, for position p
    n = window.shape[0] - 2
    tokens, positions = window[1:-1], torch.arange(n)
    features = head.fc(aux[:n])
    first, _ = head(tokens, features, positions, None)
    own = torch.cat([features[:1], first[:-1]])  # position p on the head's output at p - 1
    second, _ = head(tokens, own, positions, None)
    loss = torch.zeros(())
    for hidden, weight in ((first, 1.0), (second, 0.5)):
        got = F.log_softmax(head.lm_head(head.norm(hidden)), dim=-1)
        loss = loss + weight * F.kl_div(got, want[:n], log_target=True, reduction="batchmean")
    return loss


def save_head(head: EagleHead, target: Any, out: Path, report: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in head.state_dict().items():
        if name.startswith(("embed.", "rotary.")):
            continue
        top = name in ("fc.weight", "norm.weight", "lm_head.weight", "d2t")
        value = tensor if name == "d2t" else tensor.to(torch.float16)
        tensors[name if top else "midlayer." + name] = value.contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    tc = target.config
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": tc.hidden_size,
        "intermediate_size": tc.intermediate_size,
        "num_attention_heads": tc.num_attention_heads,
        "num_key_value_heads": tc.num_key_value_heads,
        "head_dim": tc.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": tc.rms_norm_eps,
        "max_position_embeddings": tc.max_position_embeddings,
        "vocab_size": tc.vocab_size,
        "draft_vocab_size": tc.vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(LAYERS),
        "torch_dtype": "float16",
        "minedraft_demo": {"command": report["command"], "target": "minedraft/demo_models/target"},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


@torch.no_grad()
def eagle_speculative(target: Any, proposer: EagleProposer, prompt: list[int], n: int, k: int):
    """Greedy speculative decoding with the head (the target by full recomputation, an evaluation only): (tokens,
    verify steps, accepted drafts)."""

    def states(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        out = target(torch.tensor([tokens]), output_hidden_states=True)
        return torch.cat([out.hidden_states[i][0] for i in proposer.spec.layers], -1), out.logits[0].argmax(-1)

    proposer.release([0])
    hidden, best = states(prompt)
    proposer.add_hidden([0], [hidden], admitting=True)
    proposer.prefill([0], [prompt], [])
    tokens, accepted_total, steps, verdict = list(prompt), 0, 0, (0, int(best[-1]))
    while len(tokens) - len(prompt) < n:
        drafts = proposer.propose([0], torch.tensor([verdict[0]]), torch.tensor([verdict[1]]), k).draft_ids[0].tolist()
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
    return (tokens + [verdict[1]])[len(prompt) :][:n], steps, accepted_total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "minedraft" / "demo_models" / "eagle3"))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-prompts", type=int, default=20)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    target = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval().requires_grad_(False)
    tokenizer = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json"))
    eos = int(target.config.eos_token_id)
    train_docs, heldout_docs = collect_corpus(Path(sysconfig.get_paths()["stdlib"]), 0.05)
    stream = token_stream(encode_docs(tokenizer, train_docs), eos)
    heldout = encode_docs(tokenizer, heldout_docs)
    log(f"corpus: {len(train_docs)} train files ({stream.numel():,} tokens), {len(heldout_docs)} held out")
    head = make_head(target)
    params = [p for name, p in head.named_parameters() if not name.startswith("embed.")]
    head.embed.requires_grad_(False)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    start = time.time()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 20) * (1 - 0.9 * step / args.steps)
        offset = int(torch.randint(0, stream.numel() - args.seq_len - 2, (1,), generator=gen))
        loss = head_loss(head, target, stream[offset : offset + args.seq_len + 2])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 50 == 0:
            log(f"step {step + 1}/{args.steps}: loss {float(loss):.3f}")
    train_s = time.time() - start
    head.eval().requires_grad_(False)
    proposer = EagleProposer(head, HeadSpec(True, LAYERS), num_slots=1)
    draft = AutoModelForCausalLM.from_pretrained(DRAFT_DIR, dtype=torch.float32).eval()
    prompts = pick_prompts(heldout, args.eval_prompts, 64, 64, args.seed)
    totals = {"eagle": [0, 0], "draft": [0, 0]}
    same = 0
    for prompt in prompts:
        got, steps, accepted = eagle_speculative(target, proposer, prompt, 64, args.k)
        ref, ref_steps, ref_accepted = speculative_greedy(target, draft, prompt, 64, args.k, eos, "cpu")
        same += got == ref[: len(got)]
        totals["eagle"] = [totals["eagle"][0] + steps, totals["eagle"][1] + accepted]
        totals["draft"] = [totals["draft"][0] + ref_steps, totals["draft"][1] + ref_accepted]
    lengths = {name: round(acc / max(steps, 1) + 1, 3) for name, (steps, acc) in totals.items()}
    log(f"mean accepted length at k={args.k}: EAGLE-3 head {lengths['eagle']}, demo draft {lengths['draft']}")
    report = {
        "command": "python scripts/train_demo_eagle.py " + " ".join(sys.argv[1:]),
        "corpus": f"stdlib of Python {sys.version.split()[0]}, {stream.numel()} train tokens",
        "steps": args.steps,
        "seq_len": args.seq_len,
        "train_seconds": round(train_s, 1),
        "k": args.k,
        "prompts": len(prompts),
        "mean_accepted_length": lengths,
        "output_equals_draft_model_run": f"{same}/{len(prompts)}",
    }
    save_head(head, target, Path(args.out), report)
    log(f"saved {args.out}: {json.dumps(report)}")


if __name__ == "__main__":
    main()
