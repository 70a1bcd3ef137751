"""Regenerate the packaged workload fixture (``workflows/data``) from the full data folder.

Usage::

    python -m workflows.workloads.make_fixture --src ../shared/data --out workflows/data

What it keeps, so tests and the demo run on a 135M model on a CPU without ``../shared``:

* DELEGATE-52: the domains in :data:`DOMAINS` (eight file formats). Each seed excerpt is cut
  to its first :data:`MAX_LINES` lines and at most :data:`MAX_CHARS` characters (at a line
  end), so a relay prompt stays around 700 tokens. Edits are reordered so that in-place
  pairs (instructions that name no file, i.e. one document in, one document out) come
  first, keeping the original order otherwise, and at most :data:`MAX_EDITS` are kept.
  Every other field is copied unchanged.
* The prompt template: copied unchanged.
* EditEval: the :data:`EDITEVAL_ROWS` rows with the shortest inputs among those whose
  reference ``output`` passes its test and whose unedited ``input`` fails it (checked by
  running them, unless ``--no-verify``), in file order.

``ATTRIBUTION.md`` is written alongside, listing every source and license.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from workflows.workloads.datasets import (
    DELEGATE52_FILE,
    EDITEVAL_FILE,
    TEMPLATE_FILE,
    load_editeval,
    read_jsonl,
)
from workflows.workloads.delegate52 import mentioned_files
from workflows.workloads.instructedit import run_test

DOMAINS = (
    "accounting",
    "audiosyn",
    "crystal",
    "mathlean",
    "musicsheet",
    "python",
    "spreadsheet",
    "subtitles",
)
MAX_LINES = 25
MAX_CHARS = 1400
MAX_EDITS = 6
EDITEVAL_ROWS = 20


def trim_excerpt(text: str, max_lines: int = MAX_LINES, max_chars: int = MAX_CHARS) -> str:
    """The first ``max_lines`` lines of ``text``, cut at a line end to ``max_chars``.

    A single line longer than ``max_chars`` is cut at the last space before the limit.

    Args:
        text: The seed excerpt.
        max_lines: Most lines kept.
        max_chars: Most characters kept.

    Returns:
        The trimmed excerpt without trailing blank lines.
    """
    lines = text.split("\n")[:max_lines]
    kept: list[str] = []
    size = 0
    for line in lines:
        if size + len(line) + 1 > max_chars:
            if not kept:  # one huge line (e.g. a transcript paragraph): cut at a word
                cut = line[:max_chars].rsplit(" ", 1)[0]
                kept.append(cut)
            break
        kept.append(line)
        size += len(line) + 1
    return "\n".join(kept).rstrip()


def select_edits(edits: list[dict[str, Any]], max_edits: int = MAX_EDITS) -> list[dict[str, Any]]:
    """In-place edit pairs first (stable), then the rest; at most ``max_edits``."""
    def in_place(edit: dict[str, Any]) -> bool:
        return not mentioned_files(edit["forward"]) and not mentioned_files(edit["backward"])

    ordered = [e for e in edits if in_place(e)] + [e for e in edits if not in_place(e)]
    return ordered[:max_edits]


def make_fixture(src: Path, out: Path, verify: bool = True) -> dict[str, Any]:
    """Write the fixture files and ``ATTRIBUTION.md`` into ``out``.

    Args:
        src: The full data folder (``../shared/data``).
        out: The fixture folder (created if needed).
        verify: Run EditEval tests to select rows (reference passes, input fails).

    Returns:
        A summary: domain and row counts, sizes.
    """
    out.mkdir(parents=True, exist_ok=True)
    by_name = {row["domain"]: row for row in read_jsonl(src / DELEGATE52_FILE, ("domain",))}
    domains = []
    for name in DOMAINS:
        row = {k: v for k, v in by_name[name].items() if k != "_line"}
        row["seed_excerpt"] = trim_excerpt(row["seed_excerpt"])
        row["edits"] = select_edits(row["edits"])
        domains.append(row)
    _write_jsonl(out / DELEGATE52_FILE, domains)
    shutil.copyfile(src / TEMPLATE_FILE, out / TEMPLATE_FILE)

    tasks = load_editeval(src)
    raw = {row["task_id"]: row for row in read_jsonl(src / EDITEVAL_FILE, ("task_id",))}
    candidates = sorted(tasks, key=lambda t: (len(t.input), t.task_id))
    chosen: list[str] = []
    for task in candidates:
        if len(chosen) == EDITEVAL_ROWS:
            break
        if verify and (not run_test(task, task.output).passed or run_test(task, task.input).passed):
            continue
        chosen.append(task.task_id)
    rows = [{k: v for k, v in raw[t.task_id].items() if k != "_line"}
            for t in tasks if t.task_id in chosen]
    _write_jsonl(out / EDITEVAL_FILE, rows)

    (out / "ATTRIBUTION.md").write_text(_attribution(domains, rows), encoding="utf-8")
    return {
        "domains": len(domains),
        "edits": sum(len(d["edits"]) for d in domains),
        "seed_chars": {d["domain"]: len(d["seed_excerpt"]) for d in domains},
        "editeval_rows": len(rows),
    }


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _attribution(domains: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Attribution of the workload fixture",
        "",
        "This folder is a small derived subset of public data, regenerated by",
        "`python -m workflows.workloads.make_fixture --src ../shared/data --out workflows/data`",
        "(see that script for the exact selection).",
        "",
        "## delegate52_domains.jsonl, delegate52_prompt_template.txt",
        "",
        "From the DELEGATE-52 benchmark (microsoft/delegate52 on GitHub, MIT License; paper",
        '"LLMs Corrupt Your Documents When You Delegate", arXiv 2604.15597): domain',
        "descriptions, edit instructions and the document-editing prompt template (copied",
        "unchanged). Trimmed: only the domains below are kept; each seed excerpt is cut to",
        f"its first {MAX_LINES} lines and at most {MAX_CHARS} characters; edits are reordered",
        f"with in-place pairs first and at most {MAX_EDITS} are kept per domain.",
        "",
        "Each seed excerpt stays under its own license, as named by the benchmark:",
        "",
        "| domain | seed file | source and license | excerpt chars | edits |",
        "|---|---|---|---|---|",
    ]
    for d in domains:
        lines.append(
            f"| {d['domain']} | `{d['seed_file']}` | {d.get('seed_source', '')} "
            f"| {len(d['seed_excerpt'])} | {len(d['edits'])} |"
        )
    ids = ", ".join(r["task_id"] for r in rows)
    lines += [
        "",
        "## editeval.jsonl",
        "",
        "From EditEval in InstructCoder (qishenghu/InstructCoder on GitHub, MIT License,",
        "`edit_eval/edit_eval.jsonl`), rows copied unchanged. Trimmed: only the",
        f"{len(rows)} rows with the shortest inputs whose reference output passes its test and",
        f"whose unedited input fails it: {ids}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", type=Path, required=True, help="full data folder")
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "data")
    parser.add_argument("--no-verify", action="store_true", help="skip running EditEval tests")
    args = parser.parse_args(argv)
    print(json.dumps(make_fixture(args.src, args.out, verify=not args.no_verify), indent=2))


if __name__ == "__main__":
    main()
