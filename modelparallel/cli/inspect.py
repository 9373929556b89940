"""``modelparallel inspect PATH``: what a checkpoint directory holds, and whether it is intact.

Lists every complete checkpoint (partial and full) with the layout it was saved with, the model,
its size and the result of checking every file against the manifest's CRC32 checksums; marks
the one ``newest`` names; reports leftovers of interrupted saves and directories that are not
checkpoints. A checkpoint whose manifest does not parse or is malformed, or that holds files its
manifest does not list, is reported BROKEN and the listing goes on. A ``newest`` that cannot be
read, or that is there but empty (a write of it that never finished), is reported as such, naming
the file (``train --resume`` then takes the intact checkpoint committed last, as without one).
Exit status 1 if anything is broken, ``newest`` is unreadable, empty or names nothing, or no
checkpoint is there at all (a half-written one without its manifest, a mistyped path). Reads
JSON manifests and raw bytes only (checksums): nothing in a checkpoint is unpickled, so
inspecting one never runs code from it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from . import user_path

HELP = "list the checkpoints in a directory (tags, newest, layout, sizes) and verify their checksums"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=user_path, help="the path given to smp.save_checkpoint (or one checkpoint in it)")
    p.add_argument("--no-verify", action="store_true", help="skip reading every file for its checksum")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def describe(directory: Path, verify: bool) -> dict:
    """One checkpoint's report: kind, tag, saved time, model, layout, size, checksum problems."""
    from ..checkpoint.safety import commit

    try:
        m = commit.read_manifest(directory)
    except (OSError, ValueError) as e:
        return {"name": directory.name, "kind": "BROKEN", "tag": None, "saved_at_ns": None, "model": "?",
                "layout": "?", "parts": [], "files": 0, "bytes": 0, "problems": [str(e)]}
    files = m["files"]
    problems = [p for rel, entry in files.items() if (p := commit.verify_file(directory, rel, entry))] \
        if verify else None
    if verify:
        problems += commit.unlisted_files(directory, m)
    if verify and "user_content" in m:
        entry = m["user_content"]
        problems += [p] if (p := commit.verify_file(directory.parent, entry["file"], entry)) else []
    layout = m.get("layout", {})
    return {"name": directory.name, "kind": "partial" if m.get("format", "").endswith("partial") else "full",
            "tag": m.get("tag"), "saved_at_ns": m.get("saved_at_ns"),
            "model": f"{m.get('model_type')} {m.get('model_class')}",
            "layout": f"tp {layout.get('tensor_parallel_degree')} x dp {layout.get('dp_degree')}",
            "parts": m.get("parts", ["weights"]), "files": len(files),
            "bytes": sum(e["size"] for e in files.values()), "problems": problems}


def scan(path: Path, verify: bool) -> dict:
    """The whole directory's report."""
    from ..checkpoint.safety import commit
    from ..checkpoint.safety.failure import CheckpointError
    from .resume import newest_is_empty

    if (path / commit.MANIFEST).is_file():
        return {"path": str(path), "newest": None, "checkpoints": [describe(path, verify)], "leftovers": [],
                "not_checkpoints": []}
    entries = sorted(p for p in path.iterdir() if (p.is_dir() or p.name.startswith(commit.HIDDEN))
                     and p.name != commit.LOCK)
    complete = [p for p in entries if not p.name.startswith(commit.HIDDEN) and (p / commit.MANIFEST).is_file()]
    reports = sorted((describe(p, verify) for p in complete), key=lambda r: r["saved_at_ns"] or 0, reverse=True)
    try:
        newest, unreadable = commit.read_newest(path), None
    except (OSError, ValueError, CheckpointError) as e:  # a directory, FIFO or link, too large, not text
        newest, unreadable = None, str(e)
    empty = str(path / commit.NEWEST) if newest is None and unreadable is None and newest_is_empty(path) else None
    return {"path": str(path), "newest": newest, "newest_unreadable": unreadable, "newest_empty": empty,
            "checkpoints": reports,
            "leftovers": [p.name for p in entries if p.name.startswith(commit.HIDDEN)],
            "not_checkpoints": [p.name for p in entries if p.is_dir() and p not in complete
                                and not p.name.startswith(commit.HIDDEN)]}


def _print(report: dict) -> None:
    print(report["path"])
    names = [c["name"] for c in report["checkpoints"]]
    newest = report["newest"]
    if newest is not None:
        print(f"newest: {newest}" + ("" if newest in names else "  (MISSING: no such complete checkpoint)"))
    if report.get("newest_unreadable"):
        print(f"newest: UNREADABLE: {report['newest_unreadable']}")
    if report.get("newest_empty"):
        print(f"newest: EMPTY: {report['newest_empty']} names no checkpoint (train --resume takes the intact "
              "checkpoint committed last)")
    print(f"  {'checkpoint':<28} {'kind':<8} {'saved (UTC)':<20} {'model':<28} {'layout':<12} {'size':>9}  checksums")
    for c in report["checkpoints"]:
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(c["saved_at_ns"] / 1e9)) if c["saved_at_ns"] else "?"
        status = "BROKEN (manifest)" if c["kind"] == "BROKEN" else "not checked" if c["problems"] is None else \
            f"ok ({c['files']} files)" if not c["problems"] else f"FAILED ({len(c['problems'])})"
        mark = "*" if c["name"] == newest else " "
        print(f"{mark} {c['name']:<28} {c['kind']:<8} {saved:<20} {c['model']:<28} {c['layout']:<12} "
              f"{_size(c['bytes']):>9}  {status}")
        for p in c["problems"] or []:
            print(f"      {p}")
    if report["leftovers"]:
        print("leftovers of interrupted saves (the next save removes them): " + ", ".join(report["leftovers"]))
    if report["not_checkpoints"]:
        print("directories without a manifest (not complete checkpoints; never deleted): "
              + ", ".join(report["not_checkpoints"]))
    if not report["checkpoints"]:
        print(f"no complete checkpoint in {report['path']} (a checkpoint directory holds {_manifest()}; one "
              "without it is a save that never finished, or not a checkpoint)")


def _manifest() -> str:
    from ..checkpoint.safety import commit

    return commit.MANIFEST


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print the report; exit status 1 when something is broken or nothing is there to list
    (a checkpoint cut short before its manifest, a mistyped path)."""
    if not args.path.is_dir():
        parser.error(f"{args.path} is not a directory")
    report = scan(args.path, not args.no_verify)
    print(json.dumps(report, indent=1)) if args.json else _print(report)
    bad = any(c["problems"] for c in report["checkpoints"])
    dangling = report["newest"] is not None and report["newest"] not in {c["name"] for c in report["checkpoints"]}
    empty = not report["checkpoints"]
    return 1 if bad or dangling or empty or report.get("newest_unreadable") or report.get("newest_empty") else 0
