"""The session cache on the embedded model: lossless, persistent across a SIGKILL, isolated,
and robust to a corrupt store file."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentspec.drafters import ArcticSuffixDrafter, SuffixConfig, SuffixDrafter
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.runtime import Runtime
from agentspec.storage.sessions import SessionStore
from agentspec.targets.hf import HFTarget
from agentspec.types import DraftContext, SessionRef
from workflows.workloads.smoke import SmokeSession

pytestmark = pytest.mark.integration


def _smoke_prompts(target: HFTarget, turns: int) -> list[tuple[list[int], int]]:
    from agentspec.chat.templates import render_prompt

    sess = SmokeSession("x", turns)
    out = []
    last = None
    while (req := sess.next_request(last)) is not None:
        out.append((render_prompt(target.tokenizer, req.messages, req.tools), req.max_tokens))
        last = f'```json\n{{"turn": {len(out)}}}\n```'  # fixed "outputs": prompts independent
    return out


def test_suffix_and_arctic_are_lossless_over_a_session(embedded_target: HFTarget) -> None:
    tok = embedded_target.tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    ref = SessionRef("lossless")
    plain = SpeculativeDecoder(embedded_target, None, eos_token_ids=[tok.eos_token_id])
    engines = {
        name: SpeculativeDecoder(embedded_target, d, decode=decode,
                                 eos_token_ids=[tok.eos_token_id],
                                 config=EngineConfig(max_draft=32))
        for name, d in [("suffix", SuffixDrafter()), ("arctic", ArcticSuffixDrafter())]
    }
    forwards = dict.fromkeys(engines, 0)
    total = 0
    for prompt, max_tokens in _smoke_prompts(embedded_target, 3):
        want = plain.generate(prompt, max_tokens).tokens
        total += len(want)
        for name, eng in engines.items():
            got = eng.generate(prompt, max_tokens, session=ref)
            assert got.tokens == want, name
            forwards[name] += got.stats.forwards
    for name, f in forwards.items():
        assert f < 0.6 * total, (name, f, total)  # the documents are re-emitted: drafts hit


CHILD = textwrap.dedent("""
    import json, sys, time
    from agentspec.runtime import Runtime
    from agentspec.spec import AgentSpec
    from agentspec.types import DraftContext, SessionRef
    from workflows.workloads.smoke import SmokeSession
    rt = Runtime.load(store=sys.argv[1])
    ref = SessionRef("killed", tenant="t1")
    probe = rt.tokenizer.encode('  "replicas": 3,\\n  "region": "eu-west-1",')
    sess = SmokeSession("killed", 50)
    last = None
    turn = 0
    while (req := sess.next_request(last)) is not None:
        if turn == 3:  # the fourth turn stops after its first delta, where the parent kills
            stream = rt.stream_chat(req.messages, req.tools, session=ref,
                                    max_tokens=req.max_tokens)
            next(stream)
            print(json.dumps({"mid_turn": turn}), flush=True)
            time.sleep(600)
        r = rt.chat(req.messages, req.tools, session=ref, max_tokens=req.max_tokens)
        last = r.text
        d = rt.drafter_for(AgentSpec()).propose(DraftContext(probe, len(probe), ref), 16)
        print(json.dumps({"turn": turn, "tokens": r.prompt_tokens + r.completion_tokens,
                          "probe": d.tokens}), flush=True)
        turn += 1
""")


def test_sigkill_mid_turn_keeps_committed_turns_and_drafts(tmp_path: Path) -> None:
    store_path = tmp_path / "sessions.sqlite3"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(store_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    lines = []
    for _ in range(3):
        line = proc.stdout.readline()
        assert line, "child died before committing three turns"
        lines.append(json.loads(line))
    # Killed inside the fourth turn: after its first delta, before it can be stored (the
    # child waits there; a kill after a timed sleep let a fast step finish the turn).
    assert json.loads(proc.stdout.readline()) == {"mid_turn": 3}
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)

    store = SessionStore(store_path)
    ref = SessionRef("killed", tenant="t1")
    turns = store.load(ref)
    assert len(turns) == len(lines)  # every committed turn, and no half turn
    assert [len(t) for t in turns] == [rec["tokens"] for rec in lines]
    # A new process rebuilds the same history: the same draft as just before the kill.
    drafter = SuffixDrafter(SuffixConfig(), store=store)
    probe = _tokenizer().encode('  "replicas": 3,\n  "region": "eu-west-1",')
    again = drafter.propose(DraftContext(probe, len(probe), ref), 16)
    assert again.tokens == lines[-1]["probe"]
    assert again.tokens  # the history does draft something here
    # Another tenant gets nothing from that history; another session of the same tenant
    # shares it under the default (tenant) scope, and not under scope="session".
    d = drafter.propose(DraftContext(probe, len(probe), SessionRef("killed", tenant="t2")), 16)
    assert d.tokens != again.tokens or not d.tokens
    other = SessionRef("other", tenant="t1")
    assert drafter.propose(DraftContext(probe, len(probe), other), 16).tokens == again.tokens
    alone = SuffixDrafter(SuffixConfig(scope="session"), store=store)
    assert alone.propose(DraftContext(probe, len(probe), ref), 16).tokens == again.tokens
    d = alone.propose(DraftContext(probe, len(probe), other), 16)
    assert d.tokens != again.tokens or not d.tokens


def _tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from agentspec.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model().path)


def test_corrupt_store_never_crashes_the_runtime(
    embedded_target: HFTarget, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "sessions.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    store = SessionStore.open_or_recover(path)
    assert store.recovered and store.recovered_to is not None and store.recovered_to.exists()
    rt = Runtime(embedded_target, store)
    ref = SessionRef("after-corruption")
    r = rt.chat([{"role": "user", "content": "Say hello."}], session=ref, max_tokens=8)
    assert r.completion_tokens > 0
    assert len(store.load(ref)) == 1
