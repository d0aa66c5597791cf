"""The GPU benches' plots: PSD's step timeline (in process or served) and tokens/s against batch size."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.step_bench import Row


def plot_timelines(timelines: dict[str, list[dict]], out_dir: Path) -> None:
    """timeline.png: draft and verify spans over time per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 1.6 + 1.4 * len(timelines)), squeeze=False)
    for ax, (label, events) in zip(axes[:, 0], timelines.items()):
        for event in events:
            y = 1 if event["kind"] == "verify" else 0
            ax.barh(y, event["end"] - event["start"], left=event["start"], color="C0" if event["batch"] == 0 else "C1")
        ax.set_yticks([0, 1], ["draft: Propose", "target: Verify"])
        ax.set_title(f"PSD step timeline, {label}", fontsize=9)
    axes[-1, 0].set_xlabel("seconds (blue: batch 0, orange: batch 1)")
    fig.tight_layout()
    fig.savefig(out_dir / "timeline.png", dpi=120)


def plot_throughput(rows: list[Row], out_dir: Path) -> None:
    """throughput_vs_batch.png: tokens/s per mode against batch size, from in-process step times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (draft, compiled) in enumerate(sorted({(r.draft, r.compiled) for r in rows})):
        how = ", compiled" if compiled else ""
        for k in sorted({r.k for r in rows}):
            sel = [r for r in rows if (r.draft, r.compiled, r.k) == (draft, compiled, k)]
            sd = [r.batch * (r.mean_accepted + 1) / (r.t_draft_ms + r.t_verify_ms) * 1e3 for r in sel]
            ax.plot([r.batch for r in sel], sd, marker="o", color=f"C{i}", label=f"SD, {draft} draft{how}, k={k}")
            psd = [
                (r.batch, r.batch * (r.mean_accepted + 1) / r.t_psd_step_ms * 1e3)
                for r in sel
                if r.t_psd_step_ms == r.t_psd_step_ms
            ]
            if psd:
                ax.plot(*zip(*psd), marker="s", ls="--", color=f"C{i}", label=f"PSD (one process), {draft}{how}, k={k}")
    for compiled in sorted({r.compiled for r in rows}):
        ar = {r.batch: r.batch / r.t_ar_ms * 1e3 for r in rows if r.compiled == compiled}
        ax.plot(
            sorted(ar),
            [ar[b] for b in sorted(ar)],
            marker="^",
            color="grey",
            ls=":" if compiled else "-",
            label="AR (target alone)" + (", compiled" if compiled else ""),
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s (synthetic acceptance)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "throughput_vs_batch.png", dpi=120)
