"""Figures (matplotlib, headless): per-request timelines like the chapter's figures
8-5..8-7, and the two helpers every figure of the project starts and ends with."""
from __future__ import annotations

from typing import Dict, Sequence


def pyplot():
  """matplotlib.pyplot on the headless Agg backend (imported only when plotting)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def save(fig, path: str, dpi: int = 120) -> None:
  """Lay out, write and close a figure."""
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  pyplot().close(fig)


def plot_timeline(requests: Sequence[Dict], steps: Sequence[Dict], path: str,
                  title: str = "") -> None:
  """requests: metrics.request_record dicts; steps: metrics.step_records dicts.
  One row per request: prefill bars, decode bars, an arrival mark and token ticks."""
  plt = pyplot()
  ids = [r["request_id"] for r in requests]
  row = {rid: i for i, rid in enumerate(ids)}
  fig, ax = plt.subplots(figsize=(10, 0.6 * len(ids) + 1.5))
  for s in steps:
    for rid, n, is_prefill in s["members"]:
      if rid not in row:
        continue
      color = "tab:orange" if is_prefill else "tab:blue"
      ax.broken_barh([(s["start"] * 1e3, s["duration"] * 1e3)], (row[rid] - 0.3, 0.6),
                     facecolors=color, edgecolor="white", linewidth=0.5)
  for r in requests:
    y = row[r["request_id"]]
    ax.plot([r["arrival_s"] * 1e3], [y], marker="v", color="black", markersize=8)
    for t in r.get("token_times_s", []):
      ax.plot([t * 1e3, t * 1e3], [y - 0.35, y + 0.35], color="black", linewidth=0.6)
  ax.set_yticks(range(len(ids)))
  ax.set_yticklabels([f"r{rid}" if isinstance(rid, int) else str(rid) for rid in ids])
  ax.invert_yaxis()
  ax.set_xlabel("time (ms)")
  from matplotlib.patches import Patch
  from matplotlib.lines import Line2D
  ax.legend(handles=[Patch(color="tab:orange", label="prefill"),
                     Patch(color="tab:blue", label="decode"),
                     Line2D([], [], marker="v", color="black", linestyle="", label="arrival"),
                     Line2D([], [], color="black", label="token")],
            loc="upper right", fontsize=8)
  if title:
    ax.set_title(title)
  save(fig, path, dpi=110)
