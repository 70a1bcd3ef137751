"""The decoding methods a benchmark compares, by name.

``greedy`` is transformers' own ``generate(do_sample=False)``: the plain decoding users run
today and the reference every other method's output is checked against. ``plain`` is
agentspec's loop with no drafter (one token per forward: the loop's own overhead).
``hf_prompt_lookup`` is transformers' prompt lookup decoding, a peer. Engine methods differ
only in the drafter; verification is the same strict greedy rule for all of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from agentspec.drafters import (
    ArcticSuffixDrafter,
    OracleDrafter,
    PromptLookupDrafter,
    SuffixDrafter,
)
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import AgentSpecError, BenchmarkError
from agentspec.grammar import GrammarCompiler
from agentspec.grammar_sources import tool_call_grammar
from agentspec.interfaces import Drafter, Verifier
from agentspec.targets.hf import HFTarget
from agentspec.types import RequestStats, SessionRef, StepStats
from agentspec.verifiers import BudgetConfig, BudgetedVerifier
from workflows.base import Request


@dataclass
class RunOutput:
    """One request's output and numbers."""

    tokens: list[int]
    text: str
    stats: RequestStats


class Method(Protocol):
    """A way of decoding a request."""

    name: str

    def run(self, prompt: list[int], request: Request, session: SessionRef) -> RunOutput:
        """Decode ``prompt`` (the rendered ``request``) within ``session``."""
        ...


@dataclass
class MethodContext:
    """Shared state the methods of one benchmark run are built from.

    Attributes:
        target: The loaded model.
        oracle: Greedy references registered by the ``greedy`` method, drafted by ``oracle``.
        engine: Engine settings for the engine methods.
        grammars: Set for constrained runs (``bench --constrained``): requests with tools
            decode under their tool-call grammar (``auto``: a call's body is constrained
            once the model opens it), and ``greedy`` is the engine without drafts, under
            the same grammar (transformers' generate cannot be constrained).
    """

    target: HFTarget
    oracle: OracleDrafter = field(default_factory=OracleDrafter)
    engine: EngineConfig = field(default_factory=EngineConfig)
    grammars: GrammarCompiler | None = None

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids -> text without special tokens."""
        return str(self.target.tokenizer.decode(ids, skip_special_tokens=True))

    @property
    def eos_ids(self) -> list[int]:
        """Tokens that end a request."""
        eos = self.target.tokenizer.eos_token_id
        return [eos] if isinstance(eos, int) else list(eos or [])


class EngineMethod:
    """agentspec's speculative loop with one drafter (or none)."""

    def __init__(
        self,
        name: str,
        ctx: MethodContext,
        drafter: Drafter | None,
        verifier: Verifier | None = None,
        record: bool = False,
    ) -> None:
        self.name = name
        self.ctx, self.record = ctx, record
        self.decoder = SpeculativeDecoder(
            ctx.target, drafter, verifier, decode=ctx.decode, eos_token_ids=ctx.eos_ids,
            config=ctx.engine,
        )

    def run(self, prompt: list[int], request: Request, session: SessionRef) -> RunOutput:
        """Run the request through the engine (under its tool grammar in constrained runs)."""
        constraint = None
        grammar = tool_call_grammar(request.tools, "auto") if self.ctx.grammars else None
        if self.ctx.grammars is not None and grammar is not None:
            constraint = self.ctx.grammars.constraint(grammar)
        g = self.decoder.generate(prompt, request.max_tokens, request.stop, session=session,
                                  constraint=constraint)
        if self.record:  # the constrained greedy reference feeds the oracle drafter
            self.ctx.oracle.add(prompt, g.tokens)
        return RunOutput(g.tokens, g.text, g.stats)


class HFGenerateMethod:
    """transformers ``generate`` (greedy, or with its prompt lookup decoding).

    Forward passes are counted with a forward hook so ``forwards_per_1k`` is measured the
    same way as for the engine (the prefill forward excluded).
    """

    def __init__(
        self, name: str, ctx: MethodContext, prompt_lookup: int | None, record: bool
    ) -> None:
        self.name = name
        self.ctx = ctx
        self.prompt_lookup = prompt_lookup
        self.record = record  # the greedy reference feeds the oracle

    def run(self, prompt: list[int], request: Request, session: SessionRef) -> RunOutput:
        """Run ``model.generate`` on the prompt."""
        model = self.ctx.target.model
        calls = [0]
        hook = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        kwargs: dict[str, Any] = {
            "max_new_tokens": request.max_tokens,
            "do_sample": False,
            "eos_token_id": self.ctx.eos_ids,
            "pad_token_id": self.ctx.eos_ids[0],
        }
        if request.stop:
            kwargs["stop_strings"] = list(request.stop)
            kwargs["tokenizer"] = self.ctx.target.tokenizer
        if self.prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup
        ids = torch.tensor([prompt], device=self.ctx.target.device)
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        finally:
            hook.remove()
        seconds = time.perf_counter() - t0
        tokens = out[0, len(prompt) :].tolist()
        # generate pads finished rows with pad == eos; a single row never pads.
        if self.record:
            self.ctx.oracle.add(prompt, tokens)
        forwards = max(calls[0] - 1, 0)
        stats = RequestStats(
            prompt_tokens=len(prompt), generated_tokens=len(tokens), forwards=forwards,
            verify_s=seconds, total_s=seconds,
        )
        # One pseudo-step per forward so histograms stay meaningful (unknown split: no steps).
        stats.steps = [] if self.prompt_lookup else [
            StepStats("none", 0, 0, 1, 0.0, 0.0) for _ in range(forwards)
        ]
        return RunOutput(tokens, _cut_stop(self.ctx.decode(tokens), request.stop), stats)


def _cut_stop(text: str, stop: list[str]) -> str:
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


Factory = Callable[[MethodContext], Method]

METHODS: dict[str, Factory] = {
    "greedy": lambda c: HFGenerateMethod("greedy", c, None, record=True),
    "hf_prompt_lookup": lambda c: HFGenerateMethod("hf_prompt_lookup", c, 10, record=False),
    "plain": lambda c: EngineMethod("plain", c, None),
    "prompt_lookup": lambda c: EngineMethod("prompt_lookup", c, PromptLookupDrafter()),
    "oracle": lambda c: EngineMethod("oracle", c, c.oracle),
    "suffix": lambda c: EngineMethod("suffix", c, SuffixDrafter()),
    "arctic_suffix": lambda c: EngineMethod("arctic_suffix", c, ArcticSuffixDrafter()),
    # ASD: the suffix drafter with budgeted approximate greedy verification at regret
    # budgets B = 1, 4, 16 logits per request (g = 0.5, M = 1; not persisted). Approximate:
    # identical_to_greedy is expected to be false where exceptions were taken.
    **{
        f"asd_b{b}": lambda c, b=b: EngineMethod(  # type: ignore[misc]
            f"asd_b{b}", c, SuffixDrafter(), BudgetedVerifier(BudgetConfig(float(b)))
        )
        for b in (1, 4, 16)
    },
}


def _hvd(name: str, policy: str | None) -> Factory:
    """Factory of an HVD method (issue 6): ``policy=None`` is the model drafter alone.

    The trained model drafter is loaded when the method is built, so a missing artifact
    fails the run before any model time is spent, with a BenchmarkError naming the fix.
    """

    def build(c: MethodContext) -> Method:
        from agentspec.payoff.defaults import build_hybrid, load_model_drafter

        try:
            # The model drafter alone drafts 2 tokens: with ~1/3 first-token acceptance
            # (EAGLE head, open chat) c(3) is the best trade on this CPU (docs/hvd.md).
            # Under HVD the cost-aware policy picks the length itself.
            drafter: Drafter = (load_model_drafter(c.target, max_tokens=2) if policy is None
                                else build_hybrid(c.target, policy))
        except AgentSpecError as exc:
            raise BenchmarkError(f"method {name!r} cannot be built: {exc}") from None
        return EngineMethod(name, c, drafter)

    return build


def _distilled(c: MethodContext) -> Method:
    """The distilled drafter alone (the model drafter before the EAGLE head), for comparison."""
    from agentspec.drafters.distilled import load_default_drafter
    from agentspec.drafters.model import ModelDrafterConfig

    try:
        drafter = load_default_drafter(c.target, ModelDrafterConfig(max_tokens=6))
    except AgentSpecError as exc:
        raise BenchmarkError(f"method 'distilled' cannot be built: {exc}") from None
    return EngineMethod("distilled", c, drafter)


METHODS.update({
    "distilled": _distilled,
    "model": _hvd("model", None),  # the EAGLE head when trained, else the distilled drafter
    "arctic_rule": _hvd("arctic_rule", "arctic_rule"),
    "hybrid": _hvd("hybrid", "cost_aware"),
    "hybrid_threshold": _hvd("hybrid_threshold", "threshold"),  # the paper's ŷ >= τ rule
})


def register_method(name: str, factory: Factory) -> None:
    """Add a method to the registry (drafters from later modules register themselves)."""
    METHODS[name] = factory


def build_method(name: str, ctx: MethodContext) -> Method:
    """Build the method called ``name``.

    Raises:
        BenchmarkError: unknown name (the message lists the known ones), or a method that
            cannot run under a grammar in a constrained run.
    """
    try:
        factory = METHODS[name]
    except KeyError:
        raise BenchmarkError(
            f"unknown method {name!r}; choose from {', '.join(sorted(METHODS))}"
        ) from None
    if ctx.grammars is not None:
        if name == "greedy":  # the constrained reference: the engine without drafts
            return EngineMethod("greedy", ctx, None, record=True)
        method = factory(ctx)
        if not isinstance(method, EngineMethod):
            raise BenchmarkError(f"method {name!r} cannot decode under a grammar "
                                 "(--constrained runs engine methods only)")
        return method
    return factory(ctx)
