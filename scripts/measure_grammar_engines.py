"""Compare xgrammar and llguidance on the embedded model's tokenizer (grammar compile time,
per-token cost of filling the allowed-token mask while walking a JSON document), then
measure the mask cost inside the speculative loop: one constrained request on the embedded
model, twice in one session (the second drafts from the first), masks per step and
milliseconds per step against the step's forward.

xgrammar is optional here (it is not a dependency: its wheel pulls in triton); install it
into a scratch environment to reproduce that column.

Run: python scripts/measure_grammar_engines.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from transformers import AutoTokenizer

from agentspec.models import resolve_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "units": {"type": "string", "enum": ["metric", "imperial"]},
            },
            "required": ["city", "days", "units"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
DOC = json.dumps({"name": "get_weather",
                  "arguments": {"city": "San Francisco", "days": 3, "units": "metric"}})


def _xgrammar(tok, vocab: int, ids: list[int]) -> dict[str, float]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    t2 = time.perf_counter()
    m = xgr.GrammarMatcher(compiled, max_rollback_tokens=64)
    mask = xgr.allocate_token_bitmask(1, vocab)
    per = []
    for t in ids:
        a = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        per.append(time.perf_counter() - a)
        assert m.accept_token(t), t
    m.rollback(len(ids) // 2)
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1,
            "mask_ms_mean": 1e3 * statistics.mean(per), "mask_ms_max": 1e3 * max(per)}


def _llguidance(tok, vocab: int, ids: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, overrides={"whitespace_flexible": False, "item_separator": ", ",
                           "key_separator": ": "})
    m = llguidance.LLMatcher(lltok, grammar)
    assert not m.is_error(), m.get_error()
    t2 = time.perf_counter()
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    per = []
    for t in ids:
        a = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(m, mask, 0)
        per.append(time.perf_counter() - a)
        assert m.consume_token(t), (t, m.get_error())
    m.rollback(len(ids) // 2)
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1,
            "mask_ms_mean": 1e3 * statistics.mean(per), "mask_ms_max": 1e3 * max(per)}


def _in_loop() -> dict[str, object]:
    from agentspec.runtime import Runtime
    from agentspec.types import SessionRef

    rt = Runtime.load(store=False)
    msgs = [{"role": "user", "content": "Weather for San Francisco for 3 days, metric?"}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters":
            SCHEMA["properties"]["arguments"]}}
    out = {}
    for run in ("first", "repeat"):
        constraint = rt.constraint_for([tool], "required", None, rt.default_spec)
        assert constraint is not None
        prompt, _ = rt.prompt_ids(msgs, [tool], "auto")
        gen = rt.engine_for(rt.default_spec).generate(
            prompt, 64, ["</tool_call>"], session=SessionRef("measure"), constraint=constraint)
        rt.drafter_for(rt.default_spec)  # same drafter: the repeat drafts from the first
        out[run] = {"text": rt.decode(gen.tokens), "forwards": gen.stats.forwards,
                    "verify_ms_per_step": round(1e3 * gen.stats.verify_s
                                                / max(gen.stats.forwards, 1), 2),
                    **constraint.stats.to_dict()}
    return out


def main() -> None:
    files = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(files.path)
    vocab = json.loads((files.path / "config.json").read_text())["vocab_size"]
    ids = tok.encode(DOC, add_special_tokens=False)
    torch.set_num_threads(1)
    out: dict[str, object] = {"tokens": len(ids), "vocab": vocab}
    try:
        out["xgrammar"] = _xgrammar(tok, vocab, ids)
    except ImportError:
        out["xgrammar"] = "not installed"
    out["llguidance"] = _llguidance(tok, vocab, ids)
    torch.set_num_threads(2)
    out["engine"] = _in_loop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
