"""vLLM plain vs vLLM suffix vs vLLM + agentspec proposer on the same agent sessions.

One DELEGATE-52 relay and one smoke JSON-editing session (3 turns each, every turn capped at
160 tokens), each configuration in its own engine process (``workflows.bench.vllm``). The
outputs must be token-identical to plain decoding in fp32 (also with the payoff gate, when
the shipped payoff predictor is present); tokens/s of each are written to
``results/vllm_bench.json`` (and the table to ``results/vllm_bench.txt``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm_env import GPU_MEMORY_UTILIZATION, SKIP_REASON, VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from agentspec.payoff.defaults import DEFAULT_PREDICTOR
from workflows.bench.vllm import main as bench_main
from workflows.bench.vllm import vllm_table

RESULTS = Path(__file__).resolve().parents[2] / "results"
CONFIGS = ["vllm_plain", "vllm_suffix", "agentspec_proposer"]
if DEFAULT_PREDICTOR.is_file():  # the payoff-gated proposer needs the shipped predictor
    CONFIGS.append("agentspec_payoff")


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    """Run the three configurations once for the module."""
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "vllm_bench.json"
    rep = bench_main([
        "--configs", ",".join(CONFIGS),
        "--workloads", "delegate52,smoke", "--limit", "1", "--turns", "3",
        "--max-tokens", "160", "--max-draft", "16",
        "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION), "--out", str(out),
    ])
    (RESULTS / "vllm_bench.txt").write_text(vllm_table(rep["results"]) + "\n")
    return rep


def _row(report: dict[str, Any], config: str) -> dict[str, Any]:
    return next(r for r in report["results"] if r["config"] == config)


def test_outputs_are_token_identical_in_fp32(report: dict[str, Any]) -> None:
    runs = {r["config"]: r for r in report["runs"]}
    assert set(runs) == set(CONFIGS)
    reference = [t["tokens"] for t in runs["vllm_plain"]["turns"]]
    assert len(reference) == 6 and sum(map(len, reference)) > 300
    for name, run in runs.items():
        assert [t["tokens"] for t in run["turns"]] == reference, name
        assert _row(report, name)["identical"], name


def test_drafting_commits_several_tokens_per_forward(report: dict[str, Any]) -> None:
    assert _row(report, "vllm_plain")["mean_accepted_len"] == pytest.approx(1.0)
    for name in CONFIGS[1:]:
        assert _row(report, name)["mean_accepted_len"] > 1.5, _row(report, name)


def test_speeds_are_recorded(report: dict[str, Any]) -> None:
    assert (RESULTS / "vllm_bench.json").is_file()
    for row in report["results"]:
        assert row["tokens_per_s"] > 0 and row["speedup"] is not None
        print(f"{row['config']}: {row['tokens_per_s']} tok/s ({row['speedup']}x)")
