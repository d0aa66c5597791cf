"""A worker's options: what `minedraft target` and `minedraft draft` configure a model worker with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerOptions:
    model: str
    device: str = "cpu"
    dtype: str = "auto"
    max_batch_size: int = 32
    max_model_len: int | None = None  # None: the model's context, lowered where one sequence would not fit the cache
    block_size: int = 16  # --block-size: tokens per KV cache block
    kv_cache_memory: float | None = None  # --kv-cache-memory GiB (None: by --gpu-memory-utilization, or 1 on CPUs)
    gpu_memory_utilization: float = 0.9  # the fraction of the GPU's memory the worker may use, weights included
    prefix_caching: bool = True  # --enable-prefix-caching
    cuda_graphs: bool = True  # off with --eager, for debugging
    compile_layers: bool = False  # --compile
    profile_dir: str | None = None  # --profile-dir: Chrome traces of a few calls, for diagnosis
    profile_after: int = 100  # calls to skip first (warm-up, graph captures)
    synthetic_acceptance: float | None = None  # target only, benchmarks only: not lossless
    precapture_graphs: str = "auto"  # --precapture-graphs: every step shape run when the coordinator connects
    drain_timeout: float = 30.0  # --drain-timeout: after a SIGTERM, the most seconds it keeps serving (`drain`)
    # mTLS (`security.worker_credentials`): its certificate and key, and the CA its client's certificate must be of
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    lease_timeout: float = 5.0  # --lease-timeout: seconds a coordinator's lease lasts without a renewal
    tensor_parallel_size: int = 1  # --tensor-parallel-size: ranks the target is sharded over, one process each
    lease_secret: str | None = None  # --lease-secret: the deployment's, which a coordinator must present to lease
