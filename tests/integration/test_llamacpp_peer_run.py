"""``agentspec peer llamacpp`` end to end on the embedded model, cut small: llama.cpp and
agentspec's plain w8a16 loop at one context point, then one agent turn with plain decoding
and the default. Skipped only where the peer is not installed (`make llamacpp`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workflows.bench.llamacpp import PeerUnavailableError, load_library


def test_the_peer_runs_both_systems_after_a_warm_up(tmp_path: Path) -> None:
    try:
        load_library()
    except PeerUnavailableError as exc:
        pytest.skip(f"the llama.cpp peer is not installed (`make llamacpp`): {exc}")
    from workflows.bench.llamacpp_bench import PeerConfig, run_peer

    out = tmp_path / "peer.json"
    report = run_peer(PeerConfig(contexts=(96,), decode_tokens=6, repeats=1, dtypes=("auto",),
                                 turns=2, max_tokens=6, threads=2, out=out, progress=False))
    systems = {row["system"] for row in report["contexts"]}
    assert "llama.cpp" in systems and any(s.startswith("agentspec plain") for s in systems)
    assert all(row["decode_tok_s"] > 0 for row in report["contexts"])
    # Every system warmed up (a short decode; agentspec's kernel trials) before the timing.
    assert set(report["warm_up_s"]) == systems
    turns = report["turns"]
    plain = next(v for k, v in turns.items() if k.startswith("agentspec plain"))
    default = next(v for k, v in turns.items() if k.startswith("agentspec default"))
    assert len(plain) == len(default) == len(turns["llama.cpp"]) == 2
    assert json.loads(out.read_text())["settings"]["contexts"] == [96]
