"""Where a worker call's time goes outside the worker, per batch size, from a coordinator's step traces.

`python benchmarks/call_overhead.py TRACE_DIR` (written by `minedraft bench --step-trace-dir`): for each mode and
kind of call, the median call time the coordinator saw, the worker's handler time, and the rest (gRPC, both event
loops, and what the coordinator's loop ran before sending the request or after the reply came back).
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
from pathlib import Path


def main(trace_dir: str, min_calls: int = 5) -> None:
    for path in sorted(Path(trace_dir).glob("*.jsonl")):
        calls: dict[tuple[str, int], list[tuple[float, float]]] = collections.defaultdict(list)
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["kind"] in ("propose", "verify") and "worker_s" in event:
                call = event["end"] - event["start"]
                calls[event["kind"], event["batch_size"]].append((call * 1e3, event["worker_s"] * 1e3))
        for (kind, batch), times in sorted(calls.items()):
            if len(times) >= min_calls:
                call = statistics.median(c for c, _ in times)
                worker = statistics.median(w for _, w in times)
                outside = statistics.median(c - w for c, w in times)
                print(
                    f"{path.stem:>4} {kind:>7} B={batch:<3} call {call:7.2f} ms  worker {worker:7.2f} ms  "
                    f"outside {outside:5.2f} ms  ({len(times)} calls)"
                )


if __name__ == "__main__":
    main(sys.argv[1])
