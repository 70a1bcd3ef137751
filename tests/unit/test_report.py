"""The benchmark report: report.md, PNG plots, missing fields, bad files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentspec.errors import BenchmarkError
from workflows.report.tables import MISSING, main, results_table, turn_speedups, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _turns(method: str, tps: float, metrics: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"workload": "delegate52", "method": method, "session_id": f"s{s}", "turn": t,
         "tokens": 100, "seconds": 100 / (tps * t), "tokens_per_s": tps * t,
         "identical_to_greedy": True, "loop_share": 0.0, "metrics": metrics}
        for s in range(2)
        for t in (1, 2, 3)
    ]


def _results() -> dict[str, Any]:
    return {
        "machine": {"processor": "x86_64", "cpus": 2},
        "model": "smollm2-135m-instruct",
        "config": {"turns": 3, "dtype": "float32"},
        "results": [
            {"workload": "delegate52", "method": "greedy", "requests": 6, "tokens": 600,
             "seconds": 35.0, "tokens_per_s": 17.1, "speedup_vs_greedy": 1.0,
             "mean_accepted_len": 1.0, "forwards_per_1k": 1000.0, "identical_to_greedy": True,
             "accepted_histogram": {"0": 600}, "loop_share": 0.02},
            {"workload": "delegate52", "method": "suffix", "requests": 6, "tokens": 600,
             "seconds": 10.0, "tokens_per_s": 60.0, "speedup_vs_greedy": 3.5,
             "mean_accepted_len": 5.2, "forwards_per_1k": 190.0, "identical_to_greedy": True,
             "accepted_histogram": {"0": 10, "1": 3, "7": 40}, "drafter_wins": {"suffix": 53},
             "loop_share": 0.05, "speedup_loop_free": 3.1, "oracle_fraction": 0.7},
            {"workload": "editeval", "method": "suffix", "tokens_per_s": 30.0,
             "speedup_vs_greedy": 1.8, "identical_to_greedy": False},
        ],
        "turns": _turns("greedy", 17.0, {"parse_failed": False, "similarity_to_input": 0.9})
        + _turns("suffix", 51.0, {"parse_failed": True, "similarity_to_input": 0.8})
        + [{"workload": "editeval", "method": "suffix", "session_id": "e0", "turn": 1,
            "tokens": 50, "seconds": 2.0, "metrics": {"tests_passed": True, "error": None}}],
    }


def _write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_write_report_makes_markdown_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "report"
    paths = write_report(_write(tmp_path, _results()), out)
    assert paths[0] == out / "results.report.md"  # named after results.json
    assert {p.name for p in paths[1:]} == {"results.speedup.png", "results.accepted_hist.png",
                                           "results.speedup_per_turn.png"}
    for png in paths[1:]:
        assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 5000
    md = paths[0].read_text(encoding="utf-8")
    assert "smollm2-135m-instruct" in md and "| delegate52 | suffix" in md
    assert "3.50×" in md and "70%" in md and "5.0%" in md
    assert "### delegate52" in md and "similarity_to_input" in md and "tests_passed" in md
    assert "![results.speedup](results.speedup.png)" in md


def test_missing_fields_render_as_dash(tmp_path: Path) -> None:
    table = results_table(_results()["results"])
    editeval_row = next(line for line in table.splitlines() if "editeval" in line)
    assert editeval_row.count(MISSING) == 10 and "no" in editeval_row
    assert results_table([{"workload": "w"}]).splitlines()[-1].count(MISSING) == 14
    # An old results file: no turns, no histograms, no speed-ups at all.
    old = {"results": [{"workload": "chat", "method": "greedy", "tokens_per_s": 17.0}]}
    paths = write_report(_write(tmp_path, old), tmp_path)
    assert [p.name for p in paths] == ["results.report.md"]
    assert "| chat" in paths[0].read_text(encoding="utf-8")


def test_turn_speedups_against_greedy() -> None:
    speedups = turn_speedups(_results()["turns"], "delegate52")
    assert set(speedups) == {"suffix"}
    assert speedups["suffix"] == pytest.approx({1: 3.0, 2: 3.0, 3: 3.0})
    no_greedy = [t for t in _results()["turns"] if t["method"] != "greedy"]
    assert turn_speedups(no_greedy, "delegate52")["suffix"][2] == pytest.approx(102.0)


def test_bad_results_files(tmp_path: Path) -> None:
    with pytest.raises(BenchmarkError, match="not found"):
        write_report(tmp_path / "missing.json", tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{oops", encoding="utf-8")
    with pytest.raises(BenchmarkError, match="not a results file"):
        write_report(bad, tmp_path)
    bad.write_text('{"results": 3}', encoding="utf-8")
    with pytest.raises(BenchmarkError, match="'results' list"):
        write_report(bad, tmp_path)


def test_main_prints_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(_write(tmp_path, _results())), "--out-dir", str(tmp_path / "o")]) == 0
    printed = capsys.readouterr().out
    assert "speed-up vs greedy" in printed and "wrote" in printed


def test_mixed_pools_workloads_per_method(tmp_path: Path) -> None:
    """The mixed-run view pools tokens and seconds per method over the chosen workloads,
    drops methods missing from one of them, and compares with the best single source."""
    import json

    from workflows.bench.mixed import best_single, load_rows, pooled

    def row(w: str, m: str, tokens: int, seconds: float, fwd: float) -> dict[str, object]:
        return {"workload": w, "method": m, "tokens": tokens, "seconds": seconds,
                "tokens_per_s": tokens / seconds, "forwards_per_1k": fwd,
                "identical_to_greedy": True}

    a = [row("delegate52", "greedy", 100, 10.0, 1000), row("delegate52", "suffix", 100, 2.0, 100),
         row("delegate52", "hybrid", 100, 2.5, 120)]
    b = [row("chat", "greedy", 50, 5.0, 1000), row("chat", "suffix", 50, 6.0, 900),
         row("chat", "hybrid", 50, 4.0, 700), row("chat", "model", 50, 4.5, 800)]
    (tmp_path / "a.json").write_text(json.dumps({"results": a}))
    (tmp_path / "b.json").write_text(json.dumps({"results": b}))
    rows = load_rows([tmp_path / "a.json", tmp_path / "b.json"])
    table = pooled(rows, ["delegate52", "chat"])
    assert set(table) == {"greedy", "suffix", "hybrid"}  # model ran on chat only
    assert table["suffix"]["tokens_per_s"] == round(150 / 8.0, 2)
    assert table["hybrid"]["forwards_per_1k"] == round(1000 * (12 + 35) / 150, 1)
    singles = best_single(rows, "hybrid")
    assert singles["chat"] == round((50 / 4.0) / (50 / 4.5), 3)  # model is the best single
    assert singles["delegate52"] == round((100 / 2.5) / (100 / 2.0), 3)


def test_two_runs_in_one_folder_do_not_overwrite(tmp_path: Path) -> None:
    old = {"results": [{"workload": "chat", "method": "greedy", "tokens_per_s": 17.0}]}
    first = tmp_path / "run1.json"
    second = tmp_path / "run2.json"
    for path in (first, second):
        path.write_text(json.dumps(old), encoding="utf-8")
    a, b = write_report(first), write_report(second)
    assert {p.name for p in a} == {"run1.report.md"} and {p.name for p in b} == {"run2.report.md"}
    assert all(p.exists() for p in (*a, *b))


def test_histogram_titles_match_the_table(tmp_path: Path) -> None:
    from workflows.report.plots import LAST_TITLES

    write_report(_write(tmp_path, _results()), tmp_path)
    # The table's "mean accepted len" column: 1.00 for greedy, 5.20 for suffix.
    assert LAST_TITLES == {"greedy": "greedy (mean accepted len 1.00)",
                           "suffix": "suffix (mean accepted len 5.20)"}
