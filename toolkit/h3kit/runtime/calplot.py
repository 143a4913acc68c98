"""Draw a calibration report: measured against modeled, bandwidth against message size, speed-up per tier.

    python -m h3kit.runtime.calplot REPORT.json OUT.png

matplotlib is imported only inside plot(): it is not part of the ComfyUI environment, and h3kit runs
without it. `h3kit calibrate --plot` calls require() before measuring, so a missing matplotlib is said
at once, not after a long run.
"""

from __future__ import annotations

import sys

from h3kit.errors import H3kitError
from h3kit.runtime import calibration


class NoMatplotlib(H3kitError):
    code = "no_matplotlib"


def require() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise NoMatplotlib(f"--plot needs matplotlib, which is not installed in {sys.executable}",
                           hint=f"{sys.executable} -m pip install 'h3kit[plot]' (or matplotlib: h3kit's interpreter "
                                "only; ComfyUI does not need it), or calibrate without --plot and draw the saved report "
                                "anywhere matplotlib is: python -m h3kit.runtime.calplot REPORT.json OUT.png") from None


def plot(report: dict, path: str) -> None:
    require()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_block, ax_bw, ax_speed) = plt.subplots(1, 3, figsize=(16, 5.2))
    kind = report["device_type"].upper() + (" (simulated devices)" if report.get("simulated") else "")
    fig.suptitle(f"h3kit calibrate on {kind}: {calibration.label(report)}\n{report['note']}"
                 + ("\nCPU run: shows the method and this host, no speed claim for NPUs or GPUs"
                    if report["device_type"] == "cpu" else ""), fontsize=9)

    _plot_blocks(ax_block, report)
    _plot_bandwidth(ax_bw, report)
    _plot_speedup(ax_speed, report)

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_blocks(ax, report: dict) -> None:
    """The DiT block per tier: measured, and the two-term compute model fitted on all points."""
    blocks = report["blocks"]
    labels = [f"{b['geometry']}\n{b['world']} dev, s={b['shard']}" for b in blocks]
    xs = range(len(blocks))
    ax.bar(xs, [b["seconds"] * 1e3 for b in blocks], color="#4c72b0", label="measured")
    ax.plot(xs, [b["modeled_seconds"] * 1e3 for b in blocks], "o", color="#dd8452",
               label=f"modeled ({report['fit']['compute']['tflops_linear']:.3g} / "
                     f"{report['fit']['compute']['tflops_attention']:.3g} TFLOP/s linear / attention)")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("one DiT block, ms (rank 0's shard)")
    ax.set_title("DiT block at each tier's shard", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")


def _plot_bandwidth(ax, report: dict) -> None:
    """Bandwidth against message size, with the fitted latency + bytes / bandwidth lines."""
    styles = {("threads", "all_to_all"): ("o", "#4c72b0"), ("threads", "all_gather"): ("s", "#4c72b0"),
              ("process", "all_to_all"): ("o", "#c44e52"), ("process", "all_gather"): ("s", "#c44e52")}
    for transport in calibration.TRANSPORTS:
        rows = report["collectives"][transport]
        for name, ops in (("all_to_all", ("scatter", "gather")), ("all_gather", ("final",))):
            pts = sorted((r["bytes"], r["gbs"]) for r in rows if r["op"] in ops)
            if not pts:
                continue
            marker, color = styles[(transport, name)]
            backend = f" ({report['backend']})" if transport == "process" else ""
            ax.plot([p[0] / 2**20 for p in pts], [p[1] for p in pts], marker, color=color, mfc="none" if
                    name == "all_gather" else color, label=f"{name}, {transport}{backend}")
            fit = report["fit"]["exchange"].get(transport, {}).get(name)
            if fit:
                grid = [pts[0][0] * (pts[-1][0] / pts[0][0]) ** (i / 40) for i in range(41)]
                ax.plot([g / 2**20 for g in grid], [g / calibration.line_seconds(fit, g) / 1e9 for g in grid],
                        "-", color=color, alpha=0.4)
    pairs = [p["gbs"] for p in report["copy"]["pairs"]]
    if pairs:
        ax.axhline(sorted(pairs)[len(pairs) // 2], color="#55a868", ls="--",
                   label=f"copy, one pair at a time ({report['copy']['pairs'][0]['bytes'] / 2**20:.0f} MiB)")
    for r in report["copy"]["ring"]:
        ax.plot([r["bytes"] / 2**20], [r["gbs"]], "^", color="#55a868", label=f"copy, {r['world']} at once (ring)")
    ax.set_xscale("log")
    ax.set_xlabel("bytes per rank, MiB (the message sizes h3kit plan predicts)")
    ax.set_ylabel("GB/s per rank")
    ax.set_title("links and collectives", fontsize=10)
    ax.legend(fontsize=7)


def _plot_speedup(ax, report: dict) -> None:
    """Projected forward speed-up per tier (50 blocks: measured block + measured exchange)."""
    tiers = report["tiers"]
    worlds = sorted({t["world"] for t in tiers})
    for g, ls in zip([g["name"] for g in report["geometries"]], ("-", "--")):
        for transport, color in (("threads", "#4c72b0"), ("process", "#c44e52")):
            pts = [(t["world"], t["speedup"][transport]) for t in tiers if t["geometry"] == g and transport in t["speedup"]]
            if len(pts) > 1:
                ax.plot(*zip(*pts), ls, marker="o", color=color, label=f"{g}, {transport}")
    ax.plot(worlds, worlds, ":", color="gray", label="ideal")
    ax.set_xticks(worlds)
    ax.set_xlabel("devices")
    ax.set_ylabel("projected forward speed-up vs 1 device")
    ax.set_title("projected speed-up per tier", fontsize=10)
    ax.legend(fontsize=7)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m h3kit.runtime.calplot REPORT.json OUT.png", file=sys.stderr)
        return 2
    try:
        plot(calibration.load(argv[0]), argv[1])
    except H3kitError as e:
        print(f"h3kit: error [{e.code}]: {e.message}" + (f"\n  fix: {e.hint}" if e.hint else ""), file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
