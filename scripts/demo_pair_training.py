"""The demo pair's models: their shapes, training (the draft distilled from the target), evaluation."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

TARGET_SHAPE = dict(
    hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, intermediate_size=768
)


def draft_shape(hidden: int, layers: int) -> dict:
    """The draft: `layers` Llama blocks of width `hidden`, heads of 32, 2 KV heads, MLP 3x wide."""
    if hidden % 32:
        raise SystemExit("--draft-hidden must be a multiple of 32")
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=2,
        intermediate_size=3 * hidden,
    )


STARTED = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - STARTED:7.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# models


def make_model(shape: dict, vocab_size: int, eos_id: int, seed: int):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        **shape,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    return model


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied embeddings counted once


def lr_at(step: int, steps: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model, lr: float, weight_decay: float, device: str):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"fused": True} if device.startswith("cuda") else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **kwargs)


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch_size: int, device: str, autocast: bool) -> float:
    """Mean next-token cross-entropy over the windows ([n, seq+1] token ids)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        chunk = windows[i : i + batch_size].to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=chunk[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += chunk[:, 1:].numel()
    model.train()
    return total / max(1, count)


def train(
    name: str,
    model,
    stream: torch.Tensor,
    val_windows: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    weight_decay: float,
    device: str,
    seed: int,
    log_every: int,
    eval_every: int,
    teacher=None,
    ce_weight: float = 0.0,
    temperature: float = 1.0,
) -> dict:
    """Train `model` on random windows of `stream`: cross-entropy, or distillation from `teacher` when given."""
    autocast = device.startswith("cuda")
    model.to(device)
    model.train()
    opt = make_optimizer(model, lr, weight_decay, device)
    warmup = max(1, min(200, steps // 10))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    stream = stream.to(device)
    offsets = torch.arange(seq_len + 1, device=device)
    running = torch.zeros((), device=device)
    running_n = 0
    history: list[dict] = []
    log(
        f"{name}: {n_params(model) / 1e6:.2f} M params, {steps} steps x {batch_size} x {seq_len} tokens, "
        f"peak lr {lr:g}" + (", distilling from the target" if teacher is not None else "")
    )
    t_start = time.time()
    t_last, step_last = t_start, 0
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=gen).to(device)
        chunk = stream[starts[:, None] + offsets]
        x, y = chunk[:, :-1], chunk[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x).logits.float()
            vocab = logits.shape[-1]
            if teacher is None:
                loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
            else:
                with torch.no_grad():
                    t_logits = teacher(input_ids=x).logits.float()
                t_logp = F.log_softmax(t_logits.reshape(-1, vocab) / temperature, dim=-1)
                s_logp = F.log_softmax(logits.reshape(-1, vocab) / temperature, dim=-1)
                loss = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean") * temperature**2
                if ce_weight:
                    loss = loss + ce_weight * F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running += loss.detach()
        running_n += 1
        last = step == steps - 1
        if (step + 1) % log_every == 0 or last:
            mean = float(running) / running_n
            now = time.time()
            rate = (step + 1 - step_last) / max(1e-9, now - t_last)
            entry = {"step": step + 1, "loss": round(mean, 4), "lr": opt.param_groups[0]["lr"]}
            msg = (
                f"{name} step {step + 1}/{steps}  {'kl' if teacher is not None else 'loss'} {mean:.4f}  "
                f"lr {entry['lr']:.2e}  {rate:.2f} steps/s  {rate * batch_size * seq_len:,.0f} tok/s"
            )
            if eval_every and ((step + 1) % eval_every == 0 or last) and val_windows.numel():
                val = heldout_loss(model, val_windows, batch_size, device, autocast)
                entry["heldout_loss"] = round(val, 4)
                msg += f"  held-out loss {val:.4f}"
            log(msg)
            history.append(entry)
            running.zero_()
            running_n = 0
            t_last, step_last = time.time(), step + 1
    seconds = time.time() - t_start
    model.eval()
    return {
        "steps": steps,
        "seconds": round(seconds, 1),
        "steps_per_s": round(steps / max(1e-9, seconds), 3),
        "tokens_per_s": round(steps * batch_size * seq_len / max(1e-9, seconds), 1),
        "tokens_seen": steps * batch_size * seq_len,
        "history": history,
    }


# ----------------------------------------------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def greedy_generate(model, ids: list[int], n: int, eos_id: int, device: str) -> list[int]:
    """The model's own greedy decoding through `generate()` (KV cache): the reference for the speculative output."""
    input_ids = torch.tensor([ids], device=device)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    return out[0, len(ids) :].tolist()


@torch.no_grad()
def speculative_greedy(target, draft, ids: list[int], n: int, k: int, eos_id: int, device: str):
    """Greedy speculative decoding by full recomputation (no KV cache: an evaluation only).

    Each verify step: the draft proposes k tokens greedily; the target scores prompt + drafts in one pass; drafts
    are accepted while they equal the target's argmax, then the target's argmax is emitted (the correction, or the
    bonus token after k accepts). Returns (new tokens, verify steps, accepted drafts).
    """
    out = list(ids)
    steps = accepted = 0
    while len(out) - len(ids) < n:
        proposal = list(out)
        for _ in range(k):
            logits = draft(input_ids=torch.tensor([proposal], device=device), logits_to_keep=1).logits[0, -1]
            proposal.append(int(logits.argmax()))
        drafts = proposal[len(out) :]
        t_logits = target(input_ids=torch.tensor([proposal], device=device), logits_to_keep=k + 1).logits[0]
        t_best = t_logits.argmax(-1).tolist()  # the target's choice after out, out + d1, ..., out + d1..dk
        n_ok = 0
        while n_ok < k and drafts[n_ok] == t_best[n_ok]:
            n_ok += 1
        emitted = drafts[:n_ok] + [t_best[n_ok]]
        steps += 1
        accepted += n_ok
        if eos_id in emitted:
            out.extend(emitted[: emitted.index(eos_id) + 1])
            break
        out.extend(emitted)
    return out[len(ids) :][:n], steps, accepted
