"""The summary of scripts/gpu_check.sh (workflows.report.gpu_check) on small synthetic
results shaped like `agentspec bench` and `agentspec drive` output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workflows.report.gpu_check import compare_runs, main, summarize


def _result(workload: str, method: str, tps: float, speedup: float, acc: float,
            identical: bool, requests: int = 2) -> dict[str, Any]:
    return {"workload": workload, "method": method, "requests": requests, "tokens": 100,
            "seconds": 1.0, "tokens_per_s": tps, "speedup_vs_greedy": speedup,
            "mean_accepted_len": acc, "forwards_per_1k": 500.0,
            "identical_to_greedy": identical,
            "identical_turns": requests if identical else requests - 1}


def _turn(workload: str, method: str, session: str, turn: int, sha: str | None,
          ) -> dict[str, Any]:
    rec: dict[str, Any] = {"workload": workload, "method": method, "session_id": session,
                           "turn": turn, "tokens": 50, "identical_to_greedy": True}
    if sha is not None:
        rec["output_sha"] = sha
    return rec


def _bench(dtype: str, shas: dict[str, list[str | None]], cuda: str | None = "NVIDIA H200",
           ) -> dict[str, Any]:
    """A bench report on workload ``chat``: ``shas[method]`` the output hashes of turns
    (chat-00, 1) and (chat-00, 2)."""
    results = [_result("chat", "greedy", 40.0, 1.0, 1.0, True),
               _result("chat", "suffix", 120.0, 3.0, 3.2, dtype == "float32")]
    turns = [_turn("chat", m, "chat-00", k + 1, sha)
             for m, seq in shas.items() for k, sha in enumerate(seq)]
    return {"machine": {"cuda": cuda, "torch": "2.11.0+cu130"},
            "model": "smollm2-135m-instruct",
            "config": {"dtype": dtype, "workloads": ["chat"], "date": "2026-12-04 10:00:00"},
            "results": results, "turns": turns}


def _drive() -> dict[str, Any]:
    def m(lat: float, gen: int, fwd: int) -> dict[str, Any]:
        return {"latency_s": lat, "generated": gen, "forwards": fwd, "decode_tok_s": 10.0}

    rows = [{"session": "s", "turn": t, "prompt_tokens": 1000, "identical": True,
             "methods": {"plain+reuse": m(2.0, 64, 64), "suffix+reuse": m(1.0, 64, 16)}}
            for t in range(2)]
    summary = {"plain+reuse": {"mean_decode_tok_s": 50.0, "mean_latency_s": 2.0},
               "suffix+reuse": {"mean_decode_tok_s": 150.0, "mean_latency_s": 1.0}}
    return {"settings": {"workload": "traces", "model": "smollm2-135m-instruct",
                         "dtype": "float32", "turns": 2},
            "summary": summary, "baseline": "plain+reuse",
            "latency_speedup_vs_plain": {"plain+reuse_latency_vs_plain": 1.0,
                                         "suffix+reuse_latency_vs_plain": 2.0},
            "later_turns_latency_speedup_vs_plain": {"plain+reuse_latency_vs_plain": 1.0,
                                                     "suffix+reuse_latency_vs_plain": 2.5},
            "all_identical": True, "rows": rows}


def _write(folder: Path, name: str, data: dict[str, Any]) -> None:
    (folder / name).write_text(json.dumps(data))


def _row(summary: dict[str, Any], run: str, method: str) -> dict[str, Any]:
    return next(r for r in summary["rows"] if r["run"] == run and r["method"] == method)


def test_table_rows_pairs_and_failed_steps(tmp_path: Path) -> None:
    _write(tmp_path, "bench-fp32.json", _bench("float32", {"greedy": ["g1", "g2"]}))
    _write(tmp_path, "bench-bf16-a.json",
           _bench("bfloat16", {"greedy": ["g1", "g2"], "suffix": ["s1", "s2"]}))
    _write(tmp_path, "bench-bf16-b.json",
           _bench("bfloat16", {"greedy": ["g1", "g2"], "suffix": ["s1", "XX"]}))
    _write(tmp_path, "drive.json", _drive())
    (tmp_path / "env.txt").write_text("device=cuda\ngpu=NVIDIA H200\n")
    (tmp_path / "steps.tsv").write_text(
        "bench-fp32\tok\t0\t100\t150\t\n"
        "bench-bf16-a\tok\t0\t90\t96\t\n"
        "bench-bf16-b\tok\t0\t91\t96\t\n"
        "drive\tfailed\t1\t12\t96\tRuntimeError: boom\n"
        "drive-retry\tok\t0\t40\t60\t\n")
    (tmp_path / "drive.log").write_text("loading\rloading 50%\rloading 100%\n"
                                        "Traceback (most recent call last):\n"
                                        "RuntimeError: boom\n")
    summary = summarize(tmp_path)

    assert [r["run"] for r in summary["rows"]][:6] == ["fp32", "fp32", "bf16-a", "bf16-a",
                                                       "bf16-b", "bf16-b"]
    fp32 = _row(summary, "fp32", "suffix")
    assert (fp32["tokens_per_s"], fp32["speedup"], fp32["accepted_len"]) == (120.0, 3.0, 3.2)
    assert fp32["identical"] is True and fp32["pair_same"] is None  # no pair for fp32
    # bf16: greedy gave the same tokens in both runs, suffix differed on one turn of two.
    assert _row(summary, "bf16-a", "greedy")["pair_same"] is True
    suffix_a = _row(summary, "bf16-a", "suffix")
    assert (suffix_a["pair_same"], suffix_a["pair_same_turns"], suffix_a["pair_turns"]) == (
        False, 1, 2)
    assert _row(summary, "bf16-b", "suffix")["pair_same"] is False
    assert suffix_a["identical"] is False and suffix_a["identical_turns"] == 1
    # drive: later-turn latency ratio, tokens per forward from the per-turn rows.
    drive = _row(summary, "drive", "suffix+reuse")
    assert (drive["speedup"], drive["accepted_len"], drive["identical"]) == (2.5, 4.0, True)
    # The failed step is a problem and carries its log's tail (progress bars collapsed).
    failed = next(s for s in summary["steps"] if s["step"] == "drive")
    assert (failed["rc"], failed["seconds"], failed["timeout_s"]) == (1, 12, 96)
    assert failed["log_tail"][0] == "loading 100%"
    assert failed["log_tail"][-1] == "RuntimeError: boom"
    assert any("drive: failed (exit 1)" in p for p in summary["problems"])
    assert "log_tail" not in next(s for s in summary["steps"] if s["step"] == "drive-retry")


def test_main_prints_table_and_writes_json(tmp_path: Path, capsys: Any) -> None:
    _write(tmp_path, "bench-fp32.json", _bench("float32", {"greedy": ["g1"]}))
    (tmp_path / "steps.tsv").write_text("bench-fp32\tok\t0\t100\t150\t\n"
                                        "bench-bf16-a\tskipped\t\t0\t12\tonly 12 s left\n")
    assert main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    header = next(ln for ln in lines if ln.startswith("run "))
    for col in ("tok/s", "speed-up", "acc.len", "=greedy", "a=b"):
        assert col in header
    row = next(ln for ln in lines if ln.startswith("fp32") and " suffix " in ln)
    assert "120.0" in row and "3.00x" in row and "3.20" in row and "yes" in row
    assert "PROBLEM: step bench-bf16-a: skipped: only 12 s left" in text
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["steps"][1]["status"] == "skipped" and saved["steps"][1]["rc"] is None
    assert len(saved["rows"]) == 2


def test_missing_hashes_and_cpu_runs_are_reported(tmp_path: Path) -> None:
    # Results written before the harness recorded output_sha: a=b is unknown, not "yes".
    _write(tmp_path, "bench-bf16-a.json", _bench("bfloat16", {"suffix": [None]}, cuda=None))
    _write(tmp_path, "bench-bf16-b.json", _bench("bfloat16", {"suffix": [None]}, cuda=None))
    (tmp_path / "env.txt").write_text("device=cuda\n")
    summary = summarize(tmp_path)
    assert _row(summary, "bf16-a", "suffix")["pair_same"] is None
    assert any("lack output_sha" in p for p in summary["problems"])
    assert any("saw no CUDA" in p for p in summary["problems"])


def test_compare_runs_matches_turns_by_session_and_number() -> None:
    a = _bench("bfloat16", {"suffix": ["s1", "s2"]})
    b = _bench("bfloat16", {"suffix": ["s1"]})  # b has only the first turn
    cmp = compare_runs(a, b)
    assert cmp[("chat", "suffix")] == {"same": True, "turns": 1, "same_turns": 1}


def test_empty_folder(tmp_path: Path, capsys: Any) -> None:
    assert main([str(tmp_path)]) == 0
    assert "(no results)" in capsys.readouterr().out
    assert main([str(tmp_path / "missing")]) == 2


def test_step_profile_rows_and_a_mismatch_are_reported(tmp_path: Path) -> None:
    import json

    from workflows.report.gpu_check import format_table, summarize

    rows = [{"dtype": "bfloat16", "mode": m, "method": "plain", "tok_s": 400.0,
             "wall_ms_per_step": 2.5, "device_ms_per_step": 1.0, "host_ms_per_step": 1.5,
             "drafter_ms_per_step": 0.0, "accepted_per_step": 1.0, "graph": g,
             "output": out}
            for m, g, out in (("eager", None, [1, 2, 3]), ("stable", "9 replays", [1, 2, 4]))]
    (tmp_path / "step_profile.json").write_text(json.dumps(rows))
    summary = summarize(tmp_path)
    assert [r["mode"] for r in summary["profile"]] == ["eager", "stable"]
    assert any("did not all give the same tokens" in p for p in summary["problems"])
    text = format_table(summary)
    assert "step profile" in text and "9 replays" in text
