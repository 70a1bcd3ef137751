"""vLLM's prefix cache is salted per tenant (issue 35 item 7), without vLLM: the salt's
properties, and that :class:`VLLMRuntime` puts it on every prompt it hands the engine. The
real engine's prefix-cache hits are tested in ``tests/vllm_backend/test_vllm_runtime.py``."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from test_tool_formats import FAMILIES, TEMPLATES, byte_tokenizer

from adapters.vllm import VLLMRuntime
from adapters.vllm.cache_salt import SALT_HEX_CHARS, cache_salt, engine_prompt
from agentspec.types import SessionRef


def test_salt_is_per_tenant_keyed_and_valid_for_vllm() -> None:
    rng = random.Random(7)
    tenants = [f"tenant-{rng.randrange(10**9)}" for _ in range(50)]
    salts = {t: cache_salt(SessionRef("s", tenant=t)) for t in tenants}
    assert len(set(salts.values())) == len(tenants)  # different tenants never share
    for tenant, salt in salts.items():
        # Every session and agent of a tenant shares its salt (and so its prefix KV).
        assert cache_salt(SessionRef("other", tenant=tenant, agent="coder")) == salt
        assert tenant not in salt and len(salt) == SALT_HEX_CHARS
        # vLLM's validate_cache_salt: <= 128 characters, none of '@', '/', '\\', NUL.
        assert set(salt) <= set("0123456789abcdef")
    # Keyed: another key gives other salts, so a salt cannot be computed from outside.
    ref = SessionRef("s", tenant=tenants[0])
    assert cache_salt(ref, key=b"k" * 32) != salts[tenants[0]]
    assert cache_salt(ref, key=b"k" * 32) == cache_salt(ref, key=b"k" * 32)


def test_session_less_requests_get_a_fresh_salt() -> None:
    salts = {cache_salt(None) for _ in range(20)}
    assert len(salts) == 20 and all(len(s) == SALT_HEX_CHARS for s in salts)
    assert engine_prompt([1, 2, 3], None)["prompt_token_ids"] == [1, 2, 3]


class _Engine:
    """Records what ``add_request`` receives; finishes each request in one step."""

    def __init__(self) -> None:
        self.prompts: list[dict[str, Any]] = []
        self._live: list[str] = []

    def add_request(self, rid: str, prompt: dict[str, Any], params: Any) -> None:
        self.prompts.append(prompt)
        self._live.append(rid)

    def step(self) -> list[Any]:
        rid = self._live.pop()
        out = SimpleNamespace(text="ok", token_ids=[111, 107], finish_reason="stop")
        return [SimpleNamespace(request_id=rid, outputs=[out], finished=True)]

    def abort_request(self, ids: list[str]) -> None:
        pass


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> VLLMRuntime:
    vllm = ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    template, eos, special, added = FAMILIES["hermes"]
    tok = byte_tokenizer((TEMPLATES / template).read_text(), eos, special, added)
    engine = _Engine()
    llm = SimpleNamespace(llm_engine=engine, get_tokenizer=lambda: tok, get_metrics=lambda: [])
    return VLLMRuntime(llm, "m", str(Path("m")))


def test_runtime_salts_every_prompt_by_its_tenant(runtime: VLLMRuntime) -> None:
    msgs = [{"role": "user", "content": "the same long prompt " * 8}]
    refs = [SessionRef("a1", tenant="acme"), SessionRef("a2", tenant="acme", agent="x"),
            SessionRef("b1", tenant="globex")]
    for ref in [*refs, None, None]:
        runtime.chat(msgs, session=ref, max_tokens=2)
    prompts = runtime.engine.prompts
    assert len({tuple(p["prompt_token_ids"]) for p in prompts}) == 1  # the same tokens
    salts = [p.get("cache_salt") for p in prompts]
    assert all(salts), salts
    assert salts[0] == salts[1] == cache_salt(refs[0])  # one tenant, one salt
    assert salts[2] != salts[0]  # another tenant never matches its KV blocks
    assert len({salts[0], salts[2], salts[3], salts[4]}) == 4  # session-less: fresh each
