"""Profile one draft step and one verify step on the GPU, to see where eager time goes (CPU or kernels)."""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from benchmarks.gpu_bench import Pair, build  # noqa: E402


def main() -> None:
    device = "cuda:0"
    target = build("8b", device)
    for shape in ("68m", "1b"):
        draft = build(shape, device)
        pair = Pair(target, draft, 1, 4, 512, 0.7, 8)
        for _ in range(3):
            pair.propose(0)
            pair.verify(0)
        torch.cuda.synchronize()
        for name in ("propose", "verify"):
            fn = pair.propose if name == "propose" else pair.verify
            times = []
            for _ in range(5):
                if name == "verify":
                    pair.propose(0)
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn(0)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            print(shape, name, [round(x * 1e3, 1) for x in times], flush=True)
            if name == "verify":
                pair.propose(0)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn(0)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18), flush=True)
        # the raw model, for reference: one decode step of the HF forward with a DynamicCache
        ids = torch.randint(0, 1000, (1, 512), device=device)
        with torch.inference_mode():
            out = draft(ids, use_cache=True)
            cache = out.past_key_values
            step = torch.randint(0, 1000, (1, 1), device=device)
            for _ in range(3):
                draft(step, past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                draft(step, past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
            print(shape, "raw HF decode step ms", (time.perf_counter() - t) * 100, flush=True)
        del pair, draft
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
