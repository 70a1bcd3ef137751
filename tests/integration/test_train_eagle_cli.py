"""`agentspec train-drafter --kind eagle` end to end on the embedded model: a one-minute
budget collects real teacher data, extracts features, trains a few steps and writes an
artifact that loads and drafts losslessly; a second run continues training that head
(``--init-from``, the command docs/hvd.md gives) from the stored teacher data."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.targets.hf import HFTarget

pytestmark = pytest.mark.integration


def test_train_eagle_cli_end_to_end(embedded_target: HFTarget, tmp_path: Path) -> None:
    from agentspec.chat.templates import render_prompt
    from agentspec.drafters.model.eagle import load_eagle

    out, again = tmp_path / "head.safetensors", tmp_path / "again.safetensors"
    teacher = tmp_path / "teacher.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "agentspec.cli", "train-drafter", "--kind", "eagle",
         "--minutes", "1", "--prompts", "4", "--max-new-tokens", "16", "--steps", "3",
         "--teacher-cache", str(teacher), "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "EAGLE head written to" in proc.stdout
    assert "held-out top-1 agreement" in proc.stdout
    # Continue training the head just written (it used to crash after saving).
    proc = subprocess.run(
        [sys.executable, "-m", "agentspec.cli", "train-drafter", "--kind", "eagle",
         "--minutes", "1", "--steps", "2", "--teacher-cache", str(teacher),
         "--init-from", str(out), "--out", str(again), "--no-progress"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "EAGLE head written to" in proc.stdout and again.is_file()
    first = load_eagle(embedded_target, out)
    assert load_eagle(embedded_target, again).head.spec == first.head.spec
    drafter = load_eagle(embedded_target, out)
    tok = embedded_target.tokenizer
    prompt = render_prompt(tok, [{"role": "user", "content": "Name two planets."}])
    plain = SpeculativeDecoder(embedded_target, eos_token_ids=[tok.eos_token_id])
    eng = SpeculativeDecoder(embedded_target, drafter, eos_token_ids=[tok.eos_token_id],
                             config=EngineConfig(max_draft=3))
    assert eng.generate(prompt, 24).tokens == plain.generate(prompt, 24).tokens
    assert drafter.forwards > 0
