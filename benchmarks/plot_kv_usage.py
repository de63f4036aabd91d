"""Plot the KV-cache use of a bench.py run: live tokens, allocated block capacity and what
static batching would reserve for the same requests, over the timed run.

    python benchmarks/plot_kv_usage.py bench.json kv_usage.png

bench.json: what `bench.py --json` wrote (its "kv_usage" field). matplotlib is an optional
dependency, imported only here.
"""

from __future__ import annotations

import json
import sys


def plot_kv_usage(res: dict, out_png: str) -> None:
    """Write the plot of `res["kv_usage"]` (a bench.py result) to `out_png`. ValueError when
    the result holds no KV-use series (a bench.py from before it, or a run of no steps)."""
    kv = res.get("kv_usage") or {}
    series, summary = kv.get("series"), kv.get("summary")
    if not series or not series.get("t_s"):
        raise ValueError("the result has no kv_usage series (run bench.py with --json from this version)")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    t = series["t_s"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(t, series["allocated_tokens"], label="allocated (blocks x block size)", color="tab:orange")
    ax.plot(t, series["live_tokens"], label="live tokens", color="tab:blue")
    ax.axhline(summary["static_batching_tokens"], color="tab:red", linestyle="--",
               label="static batching reservation (padded prompt + max_tokens)")
    top = max(max(series["allocated_tokens"]), summary["static_batching_tokens"])
    if summary["capacity_tokens"] <= 4 * top:  # else it would flatten everything else
        ax.axhline(summary["capacity_tokens"], color="gray", linestyle=":", label="KV cache capacity")
    else:
        ax.plot([], [], " ", label=f"(KV cache capacity: {summary['capacity_tokens']:,} tokens)")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds into the timed run")
    ax.set_ylabel("KV tokens")
    ax.set_title(f"{res.get('model', '')}: KV-cache use (fragmentation {summary['fragmentation_of_allocated']:.1%} "
                 f"of allocated, peak {summary['running_peak']} requests)")
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: python benchmarks/plot_kv_usage.py bench.json out.png")
    with open(argv[0]) as f:
        plot_kv_usage(json.load(f), argv[1])


if __name__ == "__main__":
    main()
