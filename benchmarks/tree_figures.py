"""The served figures of several commits side by side, from what `gpu_run.sh trees served` printed for each run.

`python benchmarks/tree_figures.py DIR COMMIT...`: DIR holds COMMIT_1.txt and COMMIT_2.txt per commit (the stage's
output of its two runs). Per mode, each commit's output tokens/s in both runs, their geometric mean and its ratio to
the first commit's; per mode, kind of call and batch size, each commit's median worker time and the time outside it
(the mean of its runs), so that a commit where a call grows shows which side of the call grew.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

MODE_LINE = re.compile(r"^(psd|sd|ar) +([\d.]+) +([\d.]+) ")
CALL_LINE = re.compile(r"^ *(\w+) +(propose|verify) B=(\d+) +call +[\d.]+ ms +worker +([\d.]+) ms +outside +([\d.]+)")


def read_run(path: Path) -> tuple[dict[str, float], dict[tuple[str, str, int], tuple[float, float]]]:
    """(output tokens/s per mode, (worker ms, outside ms) per mode, call and batch) of one run's output."""
    throughput: dict[str, float] = {}
    calls: dict[tuple[str, str, int], tuple[float, float]] = {}
    for line in path.read_text().splitlines():
        if m := MODE_LINE.match(line):
            throughput[m[1]] = float(m[3])
        elif m := CALL_LINE.match(line):
            calls[m[1], m[2], int(m[3])] = (float(m[4]), float(m[5]))
    return throughput, calls


def main(folder: str, commits: list[str]) -> None:
    runs = {c: [read_run(p) for p in sorted(Path(folder).glob(f"{c}_*.txt"))] for c in commits}
    modes = sorted({m for c in commits for t, _ in runs[c] for m in t}, key=["psd", "sd", "ar"].index)
    if not modes:
        print("tree_figures: no served figures in", folder)
        return
    print(f"{'output tokens/s':<16}" + "".join(f"{c:>26}" for c in commits))
    for mode in modes:
        cells, base = [], None
        for c in commits:
            values = [t[mode] for t, _ in runs[c] if mode in t]
            if not values:
                cells.append(f"{'-':>26}")
                continue
            mean = math.exp(sum(map(math.log, values)) / len(values))
            base = base or mean
            both = "/".join(f"{v:.0f}" for v in values)
            cells.append(f"{both:>15} {mean / base:5.2f}x   ")
        print(f"{mode:<16}" + "".join(cells))
    keys = sorted({k for c in commits for _, calls in runs[c] for k in calls})
    print(f"\n{'worker | outside, ms':<22}" + "".join(f"{c:>16}" for c in commits))
    for key in keys:
        cells = []
        for c in commits:
            seen = [calls[key] for _, calls in runs[c] if key in calls]
            if not seen:
                cells.append(f"{'-':>16}")
                continue
            worker, outside = (sum(s[i] for s in seen) / len(seen) for i in (0, 1))
            cells.append(f"{worker:9.2f} |{outside:5.2f}")
        print(f"{key[0]:>4} {key[1]:>7} B={key[2]:<5}   " + "".join(cells))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
