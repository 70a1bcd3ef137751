"""Compare xgrammar and llguidance on the embedded model's tokenizer: grammar compile time
and the per-token cost of filling the allowed-token mask while walking a JSON document.

Run: AGENTSPEC_HOME=... python scripts/measure_grammar_engines.py
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


def main() -> None:
    files = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(files.path)
    vocab = json.loads((files.path / "config.json").read_text())["vocab_size"]
    ids = tok.encode(DOC, add_special_tokens=False)
    torch.set_num_threads(1)
    out = {"tokens": len(ids), "vocab": vocab,
           "xgrammar": _xgrammar(tok, vocab, ids), "llguidance": _llguidance(tok, vocab, ids)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
