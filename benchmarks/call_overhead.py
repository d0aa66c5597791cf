"""Where a worker call's time goes outside the worker, per batch size, from a coordinator's step traces.

`python benchmarks/call_overhead.py TRACE_DIR` (written by `minedraft bench --step-trace-dir`): for each mode and
kind of call, the median call time the coordinator saw, the worker's handler time, and the rest (gRPC, both event
loops, and what the coordinator's loop ran before sending the request or after the reply came back); then the
handler's time split: on the worker's compute thread (host work and, on a GPU, the waits for the device), waiting
for that thread (another call's work, or work left after a reply), and the rest on the worker's event loop.
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
from pathlib import Path


def main(trace_dir: str, min_calls: int = 5) -> None:
    for path in sorted(Path(trace_dir).glob("*.jsonl")):
        calls: dict[tuple[str, int], list[tuple[float, float, float, float]]] = collections.defaultdict(list)
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["kind"] in ("propose", "verify") and "worker_s" in event:
                call = event["end"] - event["start"]
                compute, queue = event.get("worker_compute_s", 0.0), event.get("worker_queue_s", 0.0)
                calls[event["kind"], event["batch_size"]].append((call, event["worker_s"], compute, queue))
        for (kind, batch), times in sorted(calls.items()):
            if len(times) >= min_calls:
                call, worker, compute, queue = (statistics.median(t[i] * 1e3 for t in times) for i in range(4))
                outside = statistics.median((c - w) * 1e3 for c, w, _, _ in times)
                loop = statistics.median((w - c - q) * 1e3 for _, w, c, q in times)
                print(
                    f"{path.stem:>4} {kind:>7} B={batch:<3} call {call:7.2f} ms  worker {worker:7.2f} ms  "
                    f"outside {outside:5.2f} ms  ({len(times)} calls)  worker: compute {compute:6.2f} queue "
                    f"{queue:5.2f} loop {loop:5.2f} ms"
                )


if __name__ == "__main__":
    main(sys.argv[1])
