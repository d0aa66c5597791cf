"""cuBLASLt's candidate algorithms for the 8B target's projections, each timed in a CUDA graph against torch's.

A verify's GEMMs run at ~76% of HBM bandwidth at 40-80 rows. Under cuBLASLt, `torch.nn.functional.linear` takes the
first algorithm of cuBLASLt's heuristic; the heuristic ranks more candidates, and at few rows another may be faster
(TensorRT-LLM profiles cuBLASLt's algorithms per shape rather than trusting the first). Here cuBLASLt is bound with
ctypes, each candidate checked against torch's output and timed: 32 calls, each on its own weight (as 32 layers),
replayed in a CUDA graph.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, ".")
from benchmarks.attention_bench import graph_ms  # noqa: E402

# (name, output features, input features) of the Llama-3-8B shape, fused as engine.fused_projections fuses them
SHAPES = [
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
    ("lm_head", 128256, 4096),
]

# cublasLt.h / library_types.h
CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF = 68, 0, 14
CUBLASLT_MATMUL_DESC_TRANSA, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N, CUBLAS_OP_T = 3, 4, 0, 1
CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1
CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_SPLITK_NUM = 0, 1, 2
WORKSPACE_BYTES = 32 << 20


class MatmulAlgo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: an opaque algorithm and its configuration."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: one candidate of the heuristic."""

    _fields_ = [
        ("algo", MatmulAlgo),
        ("workspaceSize", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("wavesCount", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


P, SIZE = ctypes.c_void_p, ctypes.c_size_t
SIGNATURES: dict[str, list[type]] = {
    "cublasLtCreate": [ctypes.POINTER(P)],
    "cublasLtMatmulDescCreate": [ctypes.POINTER(P), ctypes.c_int, ctypes.c_int],
    "cublasLtMatmulDescSetAttribute": [P, ctypes.c_int, P, SIZE],
    "cublasLtMatrixLayoutCreate": [ctypes.POINTER(P), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
    "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(P)],
    "cublasLtMatmulPreferenceSetAttribute": [P, ctypes.c_int, P, SIZE],
    "cublasLtMatmulAlgoGetHeuristic": [P] * 7
    + [ctypes.c_int, ctypes.POINTER(HeuristicResult), ctypes.POINTER(ctypes.c_int)],
    "cublasLtMatmul": [P] * 12 + [ctypes.POINTER(MatmulAlgo), P, SIZE, P],
    "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(MatmulAlgo), ctypes.c_int, P, SIZE, ctypes.POINTER(SIZE)],
}


def load_cublaslt() -> tuple[ctypes.CDLL, str]:
    """The libcublasLt torch loaded (after one linear under cuBLASLt), else the one the loader finds by soname."""
    torch.backends.cuda.preferred_blas_library("cublaslt")
    x = torch.ones(8, 64, device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.linear(x, x)
    torch.cuda.synchronize()
    # The same copy as torch's: the candidates are then those torch's own heuristic call chooses among.
    with open("/proc/self/maps") as maps:
        paths = [line.split(maxsplit=5)[-1].strip() for line in maps if "libcublasLt.so" in line]
    for path in paths[:1] + ["libcublasLt.so.13", "libcublasLt.so.12"]:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name, argtypes in SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = ctypes.c_int
        return lib, path
    raise RuntimeError("libcublasLt not found")


class LtLinear:
    """y = x @ w.T on bf16 CUDA tensors through cuBLASLt with a chosen algorithm, capturable in a CUDA graph."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        """A handle, the matmul descriptor (T, N), a preference capped at the workspace, and the workspace."""
        self.lib = lib
        self.handle, self.op, self.pref = P(), P(), P()
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)  # kept alive: cuBLASLt reads them per call
        self.layouts: dict[tuple[int, int, int], tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]] = {}
        self.lt("cublasLtCreate", ctypes.byref(self.handle))
        self.lt("cublasLtMatmulDescCreate", ctypes.byref(self.op), CUBLAS_COMPUTE_32F, CUDA_R_32F)
        for attr, op in ((CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T), (CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N)):
            value = ctypes.c_int32(op)
            self.lt("cublasLtMatmulDescSetAttribute", self.op, attr, ctypes.byref(value), ctypes.sizeof(value))
        self.lt("cublasLtMatmulPreferenceCreate", ctypes.byref(self.pref))
        limit = ctypes.c_uint64(WORKSPACE_BYTES)
        self.lt(
            "cublasLtMatmulPreferenceSetAttribute",
            self.pref,
            CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            ctypes.byref(limit),
            ctypes.sizeof(limit),
        )

    def lt(self, name: str, *args: object) -> None:
        """Call a cuBLASLt function, raising on a status other than CUBLAS_STATUS_SUCCESS."""
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name} returned cublasStatus_t {status}")

    def layout(self, m: int, n: int, k: int) -> tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]:
        """Layouts of A = w [K, N], B = x [K, M] and C = D = y [N, M], column-major: D = A^T @ B is x @ w.T."""
        if (m, n, k) not in self.layouts:
            a, b, c = P(), P(), P()
            self.lt("cublasLtMatrixLayoutCreate", ctypes.byref(a), CUDA_R_16BF, k, n, k)
            self.lt("cublasLtMatrixLayoutCreate", ctypes.byref(b), CUDA_R_16BF, k, m, k)
            self.lt("cublasLtMatrixLayoutCreate", ctypes.byref(c), CUDA_R_16BF, n, m, n)
            self.layouts[(m, n, k)] = (a, b, c)
        return self.layouts[(m, n, k)]

    def candidates(self, m: int, n: int, k: int, count: int = 32) -> list[HeuristicResult]:
        """The heuristic's candidates for x [m, k] @ w[n, k].T, in its order, less those it cannot run here."""
        a, b, c = self.layout(m, n, k)
        results, returned = (HeuristicResult * count)(), ctypes.c_int(0)
        self.lt(
            "cublasLtMatmulAlgoGetHeuristic",
            self.handle,
            self.op,
            a,
            b,
            c,
            c,
            self.pref,
            count,
            results,
            ctypes.byref(returned),
        )
        return [
            HeuristicResult.from_buffer_copy(r)
            for r in results[: returned.value]
            if r.state == 0 and r.workspaceSize <= WORKSPACE_BYTES
        ]

    def label(self, result: HeuristicResult) -> str:
        """The candidate's algorithm id, tile id and splits of K ('?' where cuBLASLt does not say)."""
        values = []
        for attr in (CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_SPLITK_NUM):
            value, written = ctypes.c_int32(0), SIZE(0)
            status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(result.algo), attr, ctypes.byref(value), ctypes.sizeof(value), ctypes.byref(written)
            )
            values.append(str(value.value) if status == 0 else "?")
        return f"(algo {values[0]}, tile {values[1]}, splitK {values[2]}, waves {result.wavesCount:.2f})"

    def __call__(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, algo: MatmulAlgo) -> None:
        """out = x @ w.T with `algo`, one launch on the current stream (the capturing one, inside a graph)."""
        (m, k), n = x.shape, w.shape[0]
        a, b, c = self.layout(m, n, k)
        self.lt(
            "cublasLtMatmul",
            self.handle,
            self.op,
            ctypes.byref(self.alpha),
            w.data_ptr(),
            a,
            x.data_ptr(),
            b,
            ctypes.byref(self.beta),
            out.data_ptr(),
            c,
            out.data_ptr(),
            c,
            ctypes.byref(algo),
            self.workspace.data_ptr(),
            WORKSPACE_BYTES,
            torch.cuda.current_stream().cuda_stream,
        )


def sweep(
    lt: LtLinear, name: str, n: int, k: int, rows: int, weights: list[torch.Tensor], args: argparse.Namespace
) -> tuple[float, float, float]:
    """Time torch's linear and each candidate at one shape and row count; print them; return the us per call of
    torch, the heuristic's first candidate and the fastest correct candidate (torch's where none is)."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
    reference = torch.nn.functional.linear(x, weights[0]).float()
    tolerance = 0.05 * reference.abs().max().item()
    torch_us = graph_ms([functools.partial(torch.nn.functional.linear, x, w) for w in weights], args.repeats) * 1e3
    timed: list[tuple[float, int, str, float, bool]] = []  # us, index, label, max diff, correct
    for i, result in enumerate(lt.candidates(rows, n, k, args.count)):
        try:
            lt(x, weights[0], outs[0], result.algo)
            diff = (outs[0].float() - reference).abs().max().item()
            calls: list[Callable[[], object]] = [
                functools.partial(lt, x, w, out, result.algo) for w, out in zip(weights, outs)
            ]
            timed.append((graph_ms(calls, args.repeats) * 1e3, i, lt.label(result), diff, diff <= tolerance))
        except RuntimeError as error:  # torch's CUDA errors (AcceleratorError, OutOfMemoryError) are RuntimeErrors
            print(f"    #{i} {lt.label(result)} failed: {error}", flush=True)
            with contextlib.suppress(RuntimeError):
                torch.cuda.synchronize()
    first_us = next((t[0] for t in timed if t[1] == 0), float("nan"))
    correct = sorted(t for t in timed if t[4])
    layers = 1 if name == "lm_head" else 32
    head = f"{name:>8} {n}x{k} {rows:>3} rows: torch {torch_us:.1f} us, heuristic #0 {first_us:.1f} us"
    if not correct:
        print(f"{head}, no correct candidate", flush=True)
        return torch_us, first_us, torch_us
    best_us, best_i, best_label, _, _ = correct[0]
    gain = torch_us - best_us
    print(
        f"{head}, best #{best_i} {best_us:.1f} us {best_label}: {gain:+.1f} us per call, "
        f"{gain * layers / 1e3:+.3f} ms per step (x {layers} layers)",
        flush=True,
    )
    for us, i, label, diff, ok in [t for t in sorted(timed) if t[1] != best_i][: args.top]:
        print(f"    #{i:<2} {us:7.1f} us {label} max diff {diff:.4f}{'' if ok else ' WRONG'}", flush=True)
    return torch_us, first_us, best_us


def main() -> None:
    """Sweep the chosen projections and row counts; print a verify step's GEMM time under torch and the best."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="5,40,80", help="rows per call (a verify of k=4: 5 per sequence)")
    parser.add_argument("--shapes", default=",".join(name for name, *_ in SHAPES))
    parser.add_argument("--count", type=int, default=32, help="candidates requested of the heuristic")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--top", type=int, default=5, help="candidates printed per shape besides the fastest")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    lib, path = load_cublaslt()
    lt = LtLinear(lib)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {path}; us per call, 32 weights per graph "
        f"(LM head 1)",
        flush=True,
    )
    totals = {r: [0.0, 0.0, 0.0] for r in rows}  # torch, heuristic's first, best: ms per verify step
    for name, n, k in (shape for shape in SHAPES if shape[0] in args.shapes.split(",")):
        layers = 1 if name == "lm_head" else 32
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        for r in rows:
            for j, us in enumerate(sweep(lt, name, n, k, r, weights, args)):
                totals[r][j] += us * layers / 1e3
        del weights
        torch.cuda.empty_cache()
    for r in rows:
        torch_ms, first_ms, best_ms = totals[r]
        print(
            f"a verify's GEMMs at {r} rows (x32 layers, LM head x1), ms: torch {torch_ms:.3f}, heuristic #0 "
            f"{first_ms:.3f}, best candidates {best_ms:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
