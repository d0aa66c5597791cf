"""A worker's options: what `minedraft target` and `minedraft draft` configure a model worker with, and their flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from minedraft.demo_models import DRAFT_DIR, TARGET_DIR
from minedraft.flag_spec import (
    BATCHES,
    FLAG_KEY,
    LEASE_SECRET_HELP,
    MODEL_COMMANDS,
    MODELS,
    SERVICE,
    SPECULATION,
    STACKS,
    TO_WORKERS,
    WORKERS,
    Flag,
    PassTo,
    flag,
)

PRECAPTURE_CHOICES = ("auto", "on", "off")
# The draft service's drafters (draft_service.drafter.SPECULATIVE_METHODS: this layer cannot import it)
SPECULATIVE_METHOD_CHOICES = ("auto", "draft-model", "eagle", "eagle3", "ngram")
DRAFTER_COMMANDS = ("serve", "draft", "bench")


@dataclass
class WorkerOptions:
    """Each field with a flag is set by it (`minedraft_app.flags`); the field's default is the flag's."""

    model: str = field(
        metadata={
            FLAG_KEY: Flag(
                "--model",
                "Hugging Face model directory, or a .gguf file (dequantized; the gguf extra)",
                WORKERS,
                MODELS,
                defaults={"target": str(TARGET_DIR), "draft": str(DRAFT_DIR)},
                helm=WORKERS,
            )
        }
    )
    device: str = flag("cpu", "--device", "cpu, cuda, cuda:1 ...", WORKERS, MODELS, helm=WORKERS)
    dtype: str = flag(
        "auto",
        "--dtype",
        "the models' dtype (auto: bfloat16 on a GPU, float32 on a CPU)",
        MODEL_COMMANDS,
        MODELS,
        choices=("auto", "float32", "bfloat16", "float16"),
        passes_to=TO_WORKERS,
        helm=WORKERS,
    )
    # serve's and bench's --max-batch-size is the coordinator's, which they pass on to the workers too
    max_batch_size: int = flag(
        32,
        "--max-batch-size",
        "sequences per batch (psd runs two batches, so a worker holds twice as many)",
        WORKERS,
        BATCHES,
        helm=WORKERS,
    )
    # None: the model's context, lowered where one sequence would not fit the cache
    max_model_len: int | None = flag(
        None,
        "--max-model-len",
        "tokens per sequence, prompt and output (default: the model's context, lowered to what the KV cache holds)",
        MODEL_COMMANDS,
        BATCHES,
        helps={"bench": "tokens per sequence (default: room for --prompt-len and --output-len)"},
        passes_to=TO_WORKERS,
        helm=WORKERS,
    )
    block_size: int = flag(
        16, "--block-size", "tokens per KV cache block", MODEL_COMMANDS, BATCHES, passes_to=TO_WORKERS, helm=WORKERS
    )
    kv_cache_memory: float | None = flag(
        None,
        "--kv-cache-memory",
        "GiB of KV cache blocks per worker, allocated at start-up (default: by --gpu-memory-utilization on a GPU, "
        "1 GiB on a CPU)",
        MODEL_COMMANDS,
        BATCHES,
        passes_to=TO_WORKERS,
        helm=WORKERS,
    )
    gpu_memory_utilization: float = flag(
        0.9,
        "--gpu-memory-utilization",
        "the fraction of its GPU's memory a worker may use, weights, graphs and KV cache included",
        MODEL_COMMANDS,
        BATCHES,
        passes_to=TO_WORKERS,
        helm=WORKERS,
    )
    prefix_caching: bool = True  # --enable-prefix-caching on (its flag, in minedraft_app/flags.py, takes on/off)
    cuda_graphs: bool = True  # off with --eager (minedraft_app/flags.py), for debugging
    compile_layers: bool = flag(
        False,
        "--compile",
        "torch.compile the decoder layers (fused kernels inside the CUDA graphs); compiling at start-up takes minutes",
        MODEL_COMMANDS,
        MODELS,
        environment=MODEL_COMMANDS,
        passes_to=TO_WORKERS,
        helm=WORKERS,
    )
    deterministic: bool = flag(
        False,
        "--deterministic",
        "bit-identical output whatever the batch and mode (ar, sd, psd): matmuls, norms and attention computed alike "
        "for each row whatever the step holds; layers uncompiled (docs/design.md section 15)",
        MODEL_COMMANDS,
        MODELS,
        environment=MODEL_COMMANDS,
        passes_to=TO_WORKERS,
    )
    profile_dir: str | None = flag(
        None,
        "--profile-dir",
        "write PyTorch profiler traces of 5 model calls here, after --profile-after calls (diagnosis)",
        WORKERS,
        MODELS,
    )
    profile_after: int = flag(100, "--profile-after", "model calls before the profiled ones", WORKERS, MODELS)
    synthetic_acceptance: float | None = flag(
        None,
        "--synthetic-acceptance",
        "BENCHMARK ONLY, not lossless: the target accepts each draft token with this probability",
        ("target", "bench"),
        MODELS,
        passes_to=(PassTo("target"),),
    )
    synthetic_row_acceptance: str | None = flag(
        None,
        "--synthetic-row-acceptance",
        "BENCHMARK ONLY, not lossless: comma-separated rates (0.9,0.3); the target accepts each row's drafts with "
        "the rate its seed picks, and the draft scores them by it for --tetris, as a draft that predicts acceptance",
        ("target", "draft", "bench"),
        MODELS,
        passes_to=TO_WORKERS,
    )
    synthetic_rate_by: str = flag(
        "request",
        "--synthetic-rate-by",
        "BENCHMARK ONLY: with --synthetic-row-acceptance, whether a row's rate is its request's for every step, or "
        "drawn anew at each step (step: easy and hard rows stay mixed in every batch, as drafts whose confidence "
        "varies token by token)",
        ("target", "draft", "bench"),
        MODELS,
        choices=("request", "step"),
        passes_to=TO_WORKERS,
    )
    precapture_graphs: str = flag(
        "auto",
        "--precapture-graphs",
        "run every batch and key-length shape when a coordinator connects, so that CUDA graphs are captured then, "
        "not while requests wait; auto: where CUDA graphs are (the bare flag means on)",
        MODEL_COMMANDS,
        MODELS,
        choices=PRECAPTURE_CHOICES,
        const="on",
        environment=MODEL_COMMANDS,
        passes_to=TO_WORKERS,
        helm=WORKERS,
    )
    drain_timeout: float = flag(
        30.0,
        "--drain-timeout",
        "on SIGTERM, the most seconds it keeps serving, reporting NOT_SERVING; it stops sooner once no call has come "
        "for 5 s (its coordinator drained); SIGINT (Ctrl-C) stops at once",
        WORKERS,
        SERVICE,
    )
    # mTLS (`security.worker_credentials`): its certificate and key, and the CA its client's certificate must be of
    tls_cert: str | None = flag(
        None,
        "--tls-cert",
        "PEM certificate of this worker: with --tls-key and --tls-ca, it serves mTLS only",
        WORKERS,
        SERVICE,
    )
    tls_key: str | None = flag(None, "--tls-key", "PEM private key of --tls-cert", WORKERS, SERVICE)
    tls_ca: str | None = flag(
        None,
        "--tls-ca",
        "PEM CA certificate(s) of the mTLS with the coordinator: with --tls-cert and --tls-key the worker refuses "
        "a client without a certificate that this CA signed",
        WORKERS,
        SERVICE,
    )
    lease_timeout: float = flag(
        5.0,
        "--lease-timeout",
        "seconds a coordinator's lease on this worker lasts without a renewal (its calls and heartbeats renew it): "
        "after that the worker frees what the coordinator held and takes another; until then a second coordinator "
        "is refused",
        ("serve", *WORKERS),
        SERVICE,
        passes_to=TO_WORKERS,
    )
    tensor_parallel_size: int = flag(
        1,
        "--tensor-parallel-size",
        "shard the model over this many ranks, one process per device (the next GPUs after --device's; gloo on a "
        "CPU): attention heads and MLP columns split, two all-reduces per layer; rank 0 serves",
        ("target", "draft", "serve", "bench"),
        MODELS,
        helps={s: "the target's --tensor-parallel-size" for s in STACKS},
        passes_to=(PassTo("target"),),
    )
    speculative_method: str = flag(
        "auto",
        "--speculative-method",
        "what drafts: a draft model, an EAGLE-1 or EAGLE-3 head over the target's hidden states, or n-gram lookup "
        "in each request's own tokens (no model, on the CPU); auto: read from the draft checkpoint's config",
        DRAFTER_COMMANDS,
        SPECULATION,
        choices=SPECULATIVE_METHOD_CHOICES,
        passes_to=(PassTo("draft"),),
    )
    target_model_for_draft: str | None = flag(
        None,
        "--target-model-for-draft",
        "the target's model directory, which a drafter without a vocabulary of its own reads (n-gram: the tokenizer; "
        "an EAGLE head: the embeddings); default: --model",
        ("draft",),
        MODELS,
    )
    ngram_min: int = flag(
        1,
        "--ngram-min",
        "n-gram drafting: the shortest match it looks up",
        DRAFTER_COMMANDS,
        SPECULATION,
        passes_to=(PassTo("draft"),),
    )
    ngram_max: int = flag(
        4,
        "--ngram-max",
        "n-gram drafting: the longest match it looks up (the longest found wins)",
        DRAFTER_COMMANDS,
        SPECULATION,
        passes_to=(PassTo("draft"),),
    )
    lease_secret: str | None = flag(  # (also the coordinator's: `coordinator.options`)
        None,
        "--lease-secret",
        LEASE_SECRET_HELP,
        WORKERS,
        SERVICE,
    )

    def row_acceptance_rates(self) -> tuple[float, ...]:
        """--synthetic-row-acceptance's rates (none when unset), each in (0, 1]."""
        if not self.synthetic_row_acceptance:
            return ()
        try:
            rates = tuple(float(r) for r in self.synthetic_row_acceptance.split(","))
        except ValueError:
            rates = ()
        if not rates or any(not 0 < r <= 1 for r in rates):
            raise ValueError(
                f"--synthetic-row-acceptance {self.synthetic_row_acceptance!r}: give comma-separated rates in (0, 1], "
                "such as 0.9,0.3"
            )
        return rates
