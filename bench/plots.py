"""Plots of the saved bench results (no measuring here): PNGs beside the JSONs they come from.

* ``tp_efficiency.png`` (``tp_vs_hf.json``, ``tp_vs_hf_families.json``): TP=2 efficiency per
  architecture, against a perfect split and against the 2-process ceiling of the machine;
* ``checkpoint_save_speed.png`` (``checkpoint_disk.json``): a synchronous partial save's MB/s
  per repeat beside the disk's limit, the same tensors written raw, and DCP;
* ``checkpoint_async_blocked.png`` (``checkpoint_async_pages_small.json``,
  ``checkpoint_async_pages_medium.json``, ``v2_async_save_pages_large.json``): the time an
  asynchronous save blocks training, as a share of a synchronous save, per repeat: with the
  kernel's write tracking, with the call reading the tensors instead, and (v1) with everything
  copied in the call, against the 5% goal;
* ``scaling.png`` (``pipeline.json``, ``moe_ep.json``): tokens/s of pipeline parallelism
  (P=1, P=2 simple and interleaved, every repeat) and of expert parallelism (E=1, E=2 medians,
  the spread of their ratio in the title).

Usage: ``python bench/plots.py [--results bench/results]``. A result file that is missing is
skipped with a line saying so.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def _load(results: Path, name: str) -> dict | None:
    path = results / name
    if not path.exists():
        print(f"skipped: {path} not found")
        return None
    return json.loads(path.read_text())


def tp_efficiency(results: Path) -> Path | None:
    rows = {}
    for name in ("tp_vs_hf.json", "tp_vs_hf_families.json"):
        data = _load(results, name)
        rows.update((data or {}).get("efficiency", {}))
    if not rows:
        return None
    archs = sorted(rows, key=lambda a: rows[a]["efficiency"])
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(archs) + 1.2))
    y = range(len(archs))
    ax.barh([i + 0.2 for i in y], [rows[a]["efficiency"] for a in archs], 0.4, label="vs a perfect split (t1 / 2 t2)")
    ax.barh([i - 0.2 for i in y], [rows[a]["efficiency_vs_ceiling"] for a in archs], 0.4,
            label="vs the machine's 2-process ceiling")
    ax.set_yticks(list(y), archs)
    ax.set_xlim(0.5, 1.0)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("TP=2 efficiency (best of the repeats)")
    ax.set_title("Tensor parallelism, TP=2 on 2 CPU ranks (hidden 1024, 4 layers)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.5 / len(archs)), ncol=2, fontsize=8)
    return _save(fig, results / "tp_efficiency.png")


def checkpoint_speed(results: Path) -> Path | None:
    data = _load(results, "checkpoint_disk.json")
    if data is None:
        return None
    nbytes = data["checkpoint_bytes"]
    methods = [("disk", "disk limit (best raw pattern)"), ("tensors", "same tensors, raw"),
               ("sync", "smp.save_checkpoint"), ("dcp", "DCP save")]
    methods = [(k, label) for k, label in methods if k in data]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, (key, label) in enumerate(methods):
        speeds = [nbytes / 1e6 / s for s in data[key]["seconds"]]
        ax.scatter(speeds, [i] * len(speeds), s=18, alpha=0.7)
        ax.plot([nbytes / 1e6 / data[key]["median_s"]] * 2, [i - 0.3, i + 0.3], color="black")
    ax.set_yticks(range(len(methods)), [label for _, label in methods])
    ax.set_xlim(left=0)
    ax.set_xlabel("MB/s (dots: repeats; bar: median)")
    ax.set_title(f"Synchronous partial save, {data['preset']} preset ({nbytes / 1e9:.2f} GB, 2 ranks): "
                 f"{data['sync_vs_disk']:.2f}x the disk", fontsize=9)
    return _save(fig, results / "checkpoint_save_speed.png")


def async_blocked(results: Path) -> Path | None:
    rows = []  # (label, {way: [blocked / sync per repeat]})
    for preset in ("small", "medium"):
        data = _load(results, f"checkpoint_async_pages_{preset}.json")
        if data is not None:
            sync = sorted(data["seconds"]["sync"])[len(data["seconds"]["sync"]) // 2]
            ways = {way: [r["blocked_s"] / sync for r in data["seconds"][key]]
                    for way, key in (("tracked", "async"), ("read", "async_read"), ("copied in the call", "async_sync_staging"))}
            rows.append((f"v1 {preset}\n{data['staged_in_background_bytes'] / 1e6:.0f} MB/rank", ways))
    v2 = _load(results, "v2_async_save_pages_large.json")
    for kind, rec in (v2 or {}).get("result", {}).items():
        rounds = rec["rounds"]
        rows.append((f"v2 {kind}\n{rec['median']['staging_bytes'] / 1e6:.0f} MB/rank",
                     {"tracked": [r["async_blocked_s"] / r["sync_s"] for r in rounds],
                      "read": [r["read_async_blocked_s"] / r["sync_s"] for r in rounds]}))
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    colors = {"tracked": "tab:green", "read": "tab:orange", "copied in the call": "tab:gray"}
    for i, (_, ways) in enumerate(rows):
        for j, (way, values) in enumerate(ways.items()):
            x = i + (j - 1) * 0.22
            ax.scatter([x] * len(values), [100 * v for v in values], s=18, alpha=0.7, color=colors[way],
                       label=way if i == 0 else None)
            ax.plot([x - 0.08, x + 0.08], [100 * sorted(values)[len(values) // 2]] * 2, color="black")
    ax.axhline(5, color="red", linestyle="--", linewidth=1, label="goal: 5%")
    ax.set_xticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("blocked, % of a sync save\n(dots: repeats; bar: median)", fontsize=8)
    ax.set_title("Asynchronous save: time training is blocked (2 ranks, CPU, 2026-11-28)", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, results / "checkpoint_async_blocked.png")


def scaling(results: Path) -> Path | None:
    pipeline, moe = _load(results, "pipeline.json"), _load(results, "moe_ep.json")
    panels = [(pipeline, "Pipeline parallelism", [("p1", "P=1"), ("p2_simple", "P=2 simple"),
                                                  ("p2_interleaved", "P=2 interleaved")]),
              (moe, "Expert parallelism\nE=2 / E=1: " + _ratio(moe), [("E=1", "E=1"), ("E=2", "E=2")])]
    panels = [p for p in panels if p[0] is not None]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
    for ax, (data, title, keys) in zip(axes[0], panels):
        for i, (key, label) in enumerate(keys):
            values = _tokens_per_s(data, key)
            ax.scatter([i] * len(values), values, s=18, alpha=0.7)
            ax.plot([i - 0.25, i + 0.25], [sorted(values)[len(values) // 2]] * 2, color="black")
        ax.set_xticks(range(len(keys)), [label for _, label in keys])
        ax.set_ylim(bottom=0)
        ax.set_ylabel("tokens/s (dots: repeats; bar: median)")
        ax.set_title(title, fontsize=9)
    return _save(fig, results / "scaling.png")


def _ratio(moe: dict | None) -> str:
    spread = (moe or {}).get("spread", {}).get("tokens_per_s_E2_over_E1")
    return f"{spread['median']:.2f}x ({spread['min']:.2f}-{spread['max']:.2f})" if spread else ""


def _tokens_per_s(data: dict, key: str) -> list[float]:
    """Every repeat's tokens/s of ``key`` (pipeline.json keeps them per variant; moe_ep.json keeps
    the median per variant, and the spread of their ratio, shown in the panel's title)."""
    spread = data.get("spread", {}).get(key, {}).get("tokens_per_s")
    return spread["values"] if spread else [data["tokens_per_s"][key]]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args()
    for plot in (tp_efficiency, checkpoint_speed, async_blocked, scaling):
        plot(args.results)


if __name__ == "__main__":
    main()
