"""The benchmark's plots: each row's speedup over target-only (``speedup.png``) and the replay check's predicted
against measured tokens/s (``replay_check.png``). matplotlib draws off screen (Agg), as in ``evaluation.plots``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from predictors.baselines import ENTROPY_KINDS  # noqa: E402


def plot_speedups(rows: list[dict[str, Any]], path: Path) -> None:
    """Each row's speedup over target-only with its interval, coloured by method."""
    vals = np.array([r["speedup"] or 0.0 for r in rows])
    lo = np.array([r["speedup_lo"] if r["speedup_lo"] is not None else v for r, v in zip(rows, vals)])
    hi = np.array([r["speedup_hi"] if r["speedup_hi"] is not None else v for r, v in zip(rows, vals)])
    target_only = ("target.generate", "target forward loop")
    colors = ["grey" if r["method"] in target_only else "tab:orange" if r["method"].startswith("transformers")
              else "tab:green" if r["kind"] in ENTROPY_KINDS else "tab:blue" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 4.5))
    ax.bar(range(len(rows)), vals, color=colors, yerr=[vals - lo, hi - vals], capsize=3)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(rows)), [r["row"] for r in rows], rotation=45, ha="right")
    ax.set_ylabel("speedup over target-only (95% CI over prompts)")
    ax.set_title("tokens/s relative to target-only (orange: transformers, green: entropy bounds, blue: engine)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_check(result: dict[str, Any], path: Path) -> None:
    """Predicted against measured tokens/s per engine row, the identity line and the +-10% band."""
    pts = [r for r in result["rows"] if r["ratio"] is not None]
    band = result["summary"]["band"]
    top = 1.1 * max([r["measured_tokens_per_s"] for r in pts] + [r["predicted_tokens_per_s"] for r in pts] + [1e-9])
    fig, ax = plt.subplots(figsize=(6.5, 6))
    ax.fill_between([0, top], [0, (1 - band) * top], [0, (1 + band) * top], color="tab:green", alpha=0.15,
                    label=f"within {band:.0%}")
    ax.plot([0, top], [0, top], color="black", lw=0.8, label="identity")
    for r in pts:
        inside = abs(r["ratio"] - 1) <= band
        ax.scatter(r["measured_tokens_per_s"], r["predicted_tokens_per_s"], color="tab:blue" if inside else "tab:red",
                   marker="o" if not r["note"] else "x", zorder=3)
        ax.annotate(r["row"], (r["measured_tokens_per_s"], r["predicted_tokens_per_s"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured tokens/s (engine)")
    ax.set_ylabel("predicted tokens/s (replayed speedup x target-only)")
    ax.set_title("replay check (x: the replay cannot follow the engine)", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
