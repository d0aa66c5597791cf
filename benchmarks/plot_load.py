"""A whole load's timeline from coordinator step traces (`--step-trace`, JSON lines), one panel per trace.

Each panel: prefills, verifies and proposals over time, from the load's first call (after the warm-up's, the longest
idle gap); with `--verifies`, each verify's time instead, marked by whether it checked drafts or was the target's
step alone (`--speculation auto`)."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def load_events(path: Path) -> list[dict]:
    """The trace's calls from the load's start, with times relative to it (a `.gz` trace is read as gzip)."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    events = sorted((json.loads(line) for line in text.splitlines() if line.strip()), key=lambda e: e["start"])
    end, gap, first = events[0]["end"], -1.0, 0
    for i, event in enumerate(events[1:], 1):
        if event["start"] - end > gap:
            gap, first = event["start"] - end, i
        end = max(end, event["end"])
    t0 = events[first]["start"]
    return [dict(e, start=e["start"] - t0, end=e["end"] - t0) for e in events[first:]]


def verifies(events: list[dict]) -> list[tuple[float, float, bool]]:
    """(start s, milliseconds, drafted) of each verify: drafted if its batch was proposed since its last verify."""
    proposed: set[int] = set()
    out = []
    for e in events:
        if e["kind"] == "propose":
            proposed.add(e["batch_id"])
        elif e["kind"] == "verify":
            out.append((e["start"], 1e3 * (e["end"] - e["start"]), e["batch_id"] in proposed))
            proposed.discard(e["batch_id"])
    return out


def plot_verifies(ax: Axes, events: list[dict]) -> None:
    steps = verifies(events)
    for drafted, color, name in ((True, "C0", "verify of drafts"), (False, "C1", "target alone")):
        chosen = [s for s in steps if s[2] == drafted]
        ax.scatter(
            [s[0] for s in chosen],
            [s[1] for s in chosen],
            s=4,
            color=color,
            label=f"{name} ({len(chosen)})",
        )
    ax.set_ylabel("verify ms")
    ax.legend(loc="upper right", fontsize=8, markerscale=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("traces", nargs="+", help="LABEL=PATH of a step trace (JSON lines, or gzipped)")
    parser.add_argument("--out", default="load_timeline.png")
    parser.add_argument(
        "--verifies",
        action="store_true",
        help="each verify's time, drafted or the target's step alone, instead of every call's span",
    )
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(label, load_events(Path(path))) for label, _, path in (t.partition("=") for t in args.traces)]
    height = 2.2 if args.verifies else 1.5
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 0.6 + height * len(runs)), sharex=True, squeeze=False)
    for ax, (label, events) in zip(axes[:, 0], runs, strict=True):
        ax.set_title(f"{label}: load ends at {max(e['end'] for e in events):.2f} s", fontsize=9)
        if args.verifies:
            plot_verifies(ax, events)
            continue
        for event in events:
            y = 0 if event["kind"] == "propose" else 1
            color = "grey" if event["kind"] == "prefill" else "C0" if event["batch_id"] == 0 else "C1"
            ax.barh(y, event["end"] - event["start"], left=event["start"], color=color, height=0.7)
        ax.set_yticks([0, 1], ["draft: Propose", "target: Prefill, Verify"])
    axes[-1, 0].set_xlabel(
        "seconds from the load's first call" + ("" if args.verifies else " (grey: prefill; blue / orange: batch 0 / 1)")
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
