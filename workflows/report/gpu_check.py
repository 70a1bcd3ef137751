"""The summary of ``scripts/gpu_check.sh``: one table from the runs in its output folder.

    python -m workflows.report.gpu_check results/gpu_check

Reads what the script leaves in the folder: ``bench-<run>.json`` (``agentspec bench``, e.g.
``bench-fp32.json``, ``bench-bf16-a.json``, ``bench-bf16-b.json``), ``drive.json``
(``agentspec drive``), ``steps.tsv`` (one line per step: name, status, exit code, seconds,
time limit, note) and ``env.txt`` (``key=value`` lines). Prints one row per run x workload x
method (tokens/s, speed-up over greedy or plain decoding, mean tokens per target forward,
token-identical to greedy, and for a pair of runs ``<x>-a`` / ``<x>-b`` whether both produced
the same tokens turn by turn), then every step that did not end well with the last lines of
its log; writes the same as ``summary.json`` in the folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

#: Columns of ``steps.tsv``, as ``scripts/gpu_check.sh`` writes them.
STEP_FIELDS = ("step", "status", "rc", "seconds", "timeout_s", "note")
#: Lines of a step's log kept for a step that did not end ``ok``.
LOG_TAIL = 8


def log_tail(path: Path, lines: int = LOG_TAIL) -> list[str]:
    """The last ``lines`` non-empty lines of ``path`` (a progress bar's carriage-return
    updates reduced to their last state), each cut to 300 characters."""
    if not path.is_file():
        return []
    text = path.read_bytes().decode(errors="replace")  # keeps the "\r"s
    kept = [ln.rsplit("\r", 1)[-1].rstrip() for ln in text.split("\n")]
    return [ln[:300] for ln in kept if ln.strip()][-lines:]


def read_env(folder: Path) -> dict[str, str]:
    """``env.txt``: what the script found (device, python, torch, GPU, deadline)."""
    path = folder / "env.txt"
    if not path.is_file():
        return {}
    pairs = (ln.split("=", 1) for ln in path.read_text().splitlines() if "=" in ln)
    return {k.strip(): v.strip() for k, v in pairs}


def read_steps(folder: Path) -> list[dict[str, Any]]:
    """``steps.tsv`` as records; steps that did not end ``ok`` carry their log's tail."""
    path = folder / "steps.tsv"
    if not path.is_file():
        return []
    steps: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        cells = line.split("\t")
        rec: dict[str, Any] = dict(zip(STEP_FIELDS, cells + [""] * len(STEP_FIELDS),
                                       strict=False))
        for key in ("rc", "seconds", "timeout_s"):
            rec[key] = int(rec[key]) if rec[key].lstrip("-").isdigit() else None
        if rec["status"] != "ok":
            rec["log_tail"] = log_tail(folder / f"{rec['step']}.log")
        steps.append(rec)
    return steps


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _load_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON list (``scripts/step_profile.py``'s file); none when absent or
    unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [r for r in data if isinstance(r, dict)] if isinstance(data, list) else []


def compare_runs(a: dict[str, Any], b: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per ``(workload, method)``: did runs ``a`` and ``b`` produce the same tokens?

    Turns are matched by session and turn number and compared by their ``output_sha``
    (the harness's per-turn hash of the output token ids). ``same`` is ``None`` when a turn
    record lacks the hash (results written before the harness recorded it) or the runs share
    no turn.
    """
    def index(report: dict[str, Any]) -> dict[tuple[str, str], dict[tuple[str, int], Any]]:
        out: dict[tuple[str, str], dict[tuple[str, int], Any]] = {}
        for t in report.get("turns", []):
            key = (t["workload"], t["method"])
            out.setdefault(key, {})[(t["session_id"], t["turn"])] = t.get("output_sha")
        return out

    ia, ib = index(a), index(b)
    result: dict[tuple[str, str], dict[str, Any]] = {}
    for key in ia.keys() & ib.keys():
        common = ia[key].keys() & ib[key].keys()
        hashes = [(ia[key][k], ib[key][k]) for k in sorted(common)]
        if not hashes or any(x is None or y is None for x, y in hashes):
            result[key] = {"same": None, "turns": len(hashes), "same_turns": None}
            continue
        same = sum(x == y for x, y in hashes)
        result[key] = {"same": same == len(hashes), "turns": len(hashes), "same_turns": same}
    return result


def bench_rows(run: str, report: dict[str, Any],
               pair: dict[tuple[str, str], dict[str, Any]] | None) -> list[dict[str, Any]]:
    """One row per workload x method of an ``agentspec bench`` results file."""
    rows = []
    for r in report.get("results", []):
        cmp = (pair or {}).get((r["workload"], r["method"]))
        rows.append({
            "run": run, "workload": r["workload"], "method": r["method"],
            "tokens_per_s": r.get("tokens_per_s"),
            "speedup": r.get("speedup_vs_greedy"), "speedup_basis": "greedy",
            "accepted_len": r.get("mean_accepted_len"),
            "identical": r.get("identical_to_greedy"),
            "identical_turns": r.get("identical_turns"), "turns": r.get("requests"),
            "pair_same": None if cmp is None else cmp["same"],
            "pair_same_turns": None if cmp is None else cmp["same_turns"],
            "pair_turns": None if cmp is None else cmp["turns"],
        })
    return rows


def drive_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant of an ``agentspec drive`` report: decode tokens/s, the later
    turns' latency speed-up over plain decoding (all turns' when there are no later turns),
    tokens per target forward, and whether all variants produced the same tokens."""
    settings = report.get("settings", {})
    basis = report.get("baseline", "plain")
    later = report.get("later_turns_latency_speedup_vs_plain", {})
    every = report.get("latency_speedup_vs_plain", {})
    turns = report.get("rows", [])
    rows = []
    for name, s in report.get("summary", {}).items():
        per = [t["methods"][name] for t in turns if name in t.get("methods", {})]
        generated = sum(p.get("generated", 0) for p in per)
        forwards = sum(p.get("forwards", 0) for p in per)
        key = f"{name}_latency_vs_plain"
        rows.append({
            "run": "drive", "workload": settings.get("workload", "traces"), "method": name,
            "tokens_per_s": s.get("mean_decode_tok_s"),
            "speedup": later.get(key, every.get(key)),
            "speedup_basis": f"{basis} (turn latency, {'later turns' if key in later else 'all'})",
            "accepted_len": round(generated / forwards, 3) if forwards else None,
            "identical": report.get("all_identical"),
            "identical_turns": sum(bool(t.get("identical")) for t in turns), "turns": len(turns),
            "pair_same": None, "pair_same_turns": None, "pair_turns": None,
        })
    return rows


def _run_name(path: Path) -> str:
    return path.stem[len("bench-"):]


def _run_order(name: str) -> tuple[int, str]:
    return (0 if name == "fp32" else 1, name)


def summarize(folder: Path) -> dict[str, Any]:
    """Everything the table shows, as one JSON-ready dict."""
    env = read_env(folder)
    steps = read_steps(folder)
    runs: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for path in sorted(folder.glob("bench-*.json"), key=lambda p: _run_order(_run_name(p))):
        data = _load(path)
        if data is None or "results" not in data:
            problems.append(f"{path.name}: not a bench results file")
            continue
        runs[_run_name(path)] = data
    rows: list[dict[str, Any]] = []
    info: dict[str, dict[str, Any]] = {}
    for name, data in runs.items():
        pair: dict[tuple[str, str], dict[str, Any]] | None = None
        if name.endswith(("-a", "-b")):
            other = runs.get(name[:-1] + ("b" if name.endswith("-a") else "a"))
            pair = compare_runs(data, other) if other is not None else None
        rows.extend(bench_rows(name, data, pair))
        machine, config = data.get("machine", {}), data.get("config", {})
        info[name] = {"model": data.get("model"), "dtype": config.get("dtype"),
                      "device": config.get("device"), "cuda": machine.get("cuda"),
                      "torch": machine.get("torch"), "date": config.get("date")}
        if env.get("device") == "cuda" and not machine.get("cuda"):
            problems.append(f"{name}: torch saw no CUDA device (machine.cuda is empty)")
        if pair is not None and any(v["same"] is None for v in pair.values()):
            problems.append(f"{name}: turns lack output_sha: cannot tell whether runs a and b "
                            "produced the same tokens")
    drive = _load(folder / "drive.json") if (folder / "drive.json").is_file() else None
    if drive is not None:
        rows.extend(drive_rows(drive))
        st = drive.get("settings", {})
        info["drive"] = {"model": st.get("model"), "dtype": st.get("dtype"),
                         "device": st.get("device"), "turns_done": len(drive.get("rows", [])),
                         "turns_planned": st.get("turns"), "load_s": st.get("load_s")}
        if not drive.get("all_identical", True):
            problems.append("drive: variants produced different tokens")
    prof = folder / "step_profile.json"
    profile = _load_rows(prof)
    for r in profile:
        if r.get("error"):
            problems.append(f"profile {r.get('dtype')} {r.get('mode')}: {r['error']}")
    for dtype in {r.get("dtype") for r in profile if "output" in r}:
        outs = [r["output"] for r in profile if r.get("dtype") == dtype and "output" in r]
        if any(o != outs[0] for o in outs[1:]):
            problems.append(f"profile {dtype}: eager and stable, plain and suffix did not all "
                            "give the same tokens")
    for s in steps:
        if s["status"] != "ok":
            problems.append(f"step {s['step']}: {s['status']}"
                            + (f" (exit {s['rc']})" if s["rc"] not in (None, 0) else "")
                            + (f": {s['note']}" if s.get("note") else ""))
    profile_rows = [{k: r.get(k) for k in ("dtype", "mode", "method", "tok_s",
                                           "wall_ms_per_step", "device_ms_per_step",
                                           "host_ms_per_step", "drafter_ms_per_step",
                                           "accepted_per_step", "graph")}
                    for r in profile if "output" in r]
    return {"folder": str(folder), "env": env, "runs": info, "rows": rows, "steps": steps,
            "profile": profile_rows, "problems": problems}


def _yes_no(ok: bool | None, part: int | None, whole: int | None, unit: str) -> str:
    if ok is None:
        return "?" if whole else "-"
    if ok:
        return "yes"
    return f"no ({part}/{whole} {unit})" if part is not None and whole else "no"


def format_table(summary: dict[str, Any]) -> str:
    """The summary as plain text: environment, one table, then steps and problems."""
    out: list[str] = []
    env = summary["env"]
    if env:
        out.append("gpu_check: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    for name, i in summary["runs"].items():
        where = i.get("cuda") or i.get("device") or "cpu"
        out.append(f"  {name}: {i.get('model')}, {i.get('dtype')}, on {where}")
    head = ("run", "workload", "method", "tok/s", "speed-up", "acc.len", "=greedy", "a=b")
    table = [head]
    for r in summary["rows"]:
        tps, sp, acc = r["tokens_per_s"], r["speedup"], r["accepted_len"]
        table.append((
            r["run"], r["workload"], r["method"],
            f"{tps:.1f}" if tps is not None else "-",
            f"{sp:.2f}x" if sp is not None else "-",
            f"{acc:.2f}" if acc is not None else "-",
            _yes_no(r["identical"], r["identical_turns"], r["turns"], "turns"),
            _yes_no(r["pair_same"], r["pair_same_turns"], r["pair_turns"], "turns"),
        ))
    widths = [max(len(str(row[c])) for row in table) for c in range(len(head))]
    out.append("")
    for k, row in enumerate(table):
        cells = [str(v).ljust(w) if c < 3 else str(v).rjust(w)
                 for c, (v, w) in enumerate(zip(row, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    if not summary["rows"]:
        out.append("(no results)")
    if any(r["run"] == "drive" for r in summary["rows"]):
        out.append("drive: tok/s = decode tokens/s; speed-up = turn latency vs plain decoding "
                   "(later turns); =greedy = all variants gave the same tokens")
    out.append("acc.len = tokens per target forward; a=b = runs <x>-a and <x>-b produced the "
               "same tokens")
    if summary.get("profile"):
        out.append("")
        out.append("step profile (ms per step; host = wall - device):")
        for r in summary["profile"]:
            def ms(key: str, row: dict[str, Any] = r) -> str:
                v = row.get(key)
                return f"{v:7.2f}" if isinstance(v, (int, float)) else "      -"
            out.append(f"  {r['dtype']:9} {r['mode']:7} {r['method']:7} "
                       f"{(r.get('tok_s') or 0):8.1f} tok/s  wall {ms('wall_ms_per_step')}  "
                       f"device {ms('device_ms_per_step')}  host {ms('host_ms_per_step')}  "
                       f"drafter {ms('drafter_ms_per_step')}  graph: {r.get('graph')}")
    if summary["steps"]:
        out.append("")
        out.append("steps: " + ", ".join(
            f"{s['step']} {s['status']}"
            + (f" {s['seconds']} s" if s["seconds"] is not None and s["status"] != "skipped"
               else "")
            for s in summary["steps"]))
    for p in summary["problems"]:
        out.append(f"PROBLEM: {p}")
    for s in summary["steps"]:
        if s.get("log_tail"):
            out.append(f"--- last lines of {s['step']}.log ---")
            out.extend(f"    {ln}" for ln in s["log_tail"])
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Print the table of ``folder`` and write ``folder/summary.json``."""
    p = argparse.ArgumentParser(prog="python -m workflows.report.gpu_check",
                                description="Summarise the runs of scripts/gpu_check.sh.")
    p.add_argument("folder", type=Path, help="the script's OUT_DIR (default results/gpu_check)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON summary (default: FOLDER/summary.json)")
    args = p.parse_args(argv)
    if not args.folder.is_dir():
        print(f"gpu_check summary: no folder {args.folder}", file=sys.stderr)
        return 2
    summary = summarize(args.folder)
    (args.out or args.folder / "summary.json").write_text(json.dumps(summary, indent=1))
    print(format_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
