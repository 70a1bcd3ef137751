"""`agentspec train-predictor` end to end on the embedded model: greedy traces of real relay
and chat sessions (leaving out the benchmarked ones), trace replay, a residual MLP, a report, and a
predictor file that the hybrid drafter loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentspec.payoff.predictor import PayoffPredictor
from agentspec.targets.hf import HFTarget
from agentspec.training.payoff_traces import read_traces
from workflows.workloads.training_data import bench_session_ids

pytestmark = pytest.mark.integration


def test_train_predictor_cli_end_to_end(embedded_target: HFTarget, tmp_path: Path) -> None:
    from agentspec.drafters.hybrid_build import build_hybrid

    out, report, traces = tmp_path / "p.json", tmp_path / "r.json", tmp_path / "t.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "agentspec.cli", "train-predictor", "--workloads",
         "delegate52,chat", "--limit", "2", "--turns", "1", "--max-tokens", "24", "--exclude-bench",
         "--epochs", "30", "--out", str(out), "--report", str(report),
         "--save-traces", str(traces), "--no-progress"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "precision(>=6)" in proc.stdout and "predictor written to" in proc.stdout
    got = read_traces(traces, vocab_size=embedded_target.vocab_size)
    ids = {t.session_id for t in got.traces}
    assert len(ids) == 4 and not ids & set(bench_session_ids(["delegate52", "chat"]))
    data = json.loads(report.read_text())
    assert data["config"]["max_draft"] == 32 and data["config"]["residual"] is True
    assert data["sessions"]["validation"] >= 1 and data["validation"]["rows"] > 0
    pred = PayoffPredictor.load(out)
    assert pred.residual and pred.meta["model"] == embedded_target.name
    hybrid = build_hybrid(embedded_target, predictor=pred)
    assert hybrid.policy.name == "cost_aware"
