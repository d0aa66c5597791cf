"""Plots which verifies of served loads checked drafts and which were the target's step alone (--speculation)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def verifies(trace: Path) -> list[tuple[float, float, int, bool]]:
    """(start s, duration ms, batch size, drafted) of each verify in a coordinator's step trace (--step-trace): a
    verify checked drafts if its batch was proposed since its last verify."""
    events = sorted((json.loads(line) for line in trace.read_text().splitlines() if line.strip()),
                    key=lambda e: e["start"])
    t0 = events[0]["start"] if events else 0.0
    proposed: dict[int, bool] = {}
    out = []
    for e in events:
        if e["kind"] == "propose":
            proposed[e["batch_id"]] = True
        elif e["kind"] == "verify":
            out.append((e["start"] - t0, 1e3 * (e["end"] - e["start"]), e["batch_size"],
                        proposed.pop(e["batch_id"], False)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("traces", nargs="+", help="LABEL=PATH of a step trace (JSON lines)")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(args.traces), 1, figsize=(11, 2.2 * len(args.traces)), sharex=True, squeeze=False)
    for ax, spec in zip(axes[:, 0], args.traces):
        label, path = spec.split("=", 1)
        steps = verifies(Path(path))
        for drafted, color, name in ((True, "tab:blue", "verify of drafts"), (False, "tab:orange", "target alone")):
            chosen = [s for s in steps if s[3] == drafted]
            ax.scatter([s[0] for s in chosen], [s[1] for s in chosen], s=4, color=color,
                       label=f"{name} ({len(chosen)})")
        ax.set_title(label, fontsize=9)
        ax.set_ylabel("verify ms")
        ax.legend(loc="upper right", fontsize=8, markerscale=3)
    axes[-1, 0].set_xlabel("seconds since the coordinator's first call (the bench's two warm-up requests first)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
