"""The decoding methods a benchmark compares, by name.

agentspec's own methods are built from an :class:`~agentspec.spec.AgentSpec` by the one
factory (:mod:`agentspec.factory`), the same code that builds the product's drafter,
verifier and engine, so the benchmark measures what ships (:func:`method_spec` gives each
method's spec). The peers are built here: ``greedy`` is transformers' own
``generate(do_sample=False)``, the plain decoding users run today and the reference every
other method's output is checked against (on a shape-stable target, bf16 or CUDA, the
engine without drafts: there plain decoding is defined by the engine's own shapes, see
:mod:`agentspec.targets.forward.shapes`); ``hf_prompt_lookup`` is transformers' prompt
lookup decoding; ``oracle`` drafts the known greedy output (the ceiling); ``distilled`` is
the model drafter before the EAGLE head. ``plain`` is agentspec's loop with no drafter
(one token per forward: the loop's own overhead).

Verification is lossless (strict greedy for these greedy requests) for every method but
``asd_*``: those run ASD's budgeted approximate greedy rule at regret budgets B = 1, 4, 16,
and their outputs may differ from greedy where an exception was taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from agentspec.chat.formats import format_for
from agentspec.chat.grammar import GrammarCompiler
from agentspec.chat.grammar_sources import tool_call_grammar
from agentspec.drafters import OracleDrafter
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import AgentSpecError, BenchmarkError
from agentspec.factory import build_drafter, build_engine
from agentspec.interfaces import Drafter
from agentspec.spec import AgentSpec, DraftingPolicy, VerifierPolicy
from agentspec.targets.hf import HFTarget
from agentspec.tokens import cut_at_stop, eos_ids
from agentspec.types import RequestStats, SessionRef, StepStats
from workflows.workloads.base import WorkloadRequest


@dataclass
class RunOutput:
    """One request's output and numbers."""

    tokens: list[int]
    text: str
    stats: RequestStats


class Method(Protocol):
    """A way of decoding a request."""

    name: str

    def run(self, prompt: list[int], request: WorkloadRequest, session: SessionRef) -> RunOutput:
        """Decode ``prompt`` (the rendered ``request``) within ``session``."""
        ...


@dataclass
class MethodContext:
    """Shared state the methods of one benchmark run are built from.

    Attributes:
        target: The loaded model.
        oracle: Greedy references registered by the ``greedy`` method, drafted by ``oracle``.
        engine: Engine settings for the engine methods (``max_draft`` goes into each
            method's :class:`~agentspec.spec.AgentSpec`).
        grammars: Set for constrained runs (``bench --constrained``): requests with tools
            decode under their tool-call grammar (``auto``: a call's body is constrained
            once the model opens it), and ``greedy`` is the engine without drafts, under
            the same grammar (transformers' generate cannot be constrained).
        draft_model: The draft model of ``model`` and ``hybrid`` (``bench --draft-model``).
    """

    target: HFTarget
    oracle: OracleDrafter = field(default_factory=OracleDrafter)
    engine: EngineConfig = field(default_factory=EngineConfig)
    grammars: GrammarCompiler | None = None
    draft_model: str | None = None

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids -> text without special tokens."""
        return str(self.target.tokenizer.decode(ids, skip_special_tokens=True))

    @property
    def eos_ids(self) -> list[int]:
        """Tokens that end a request."""
        return eos_ids(self.target.tokenizer)

    def spec(self, method: str) -> AgentSpec:
        """The AgentSpec of agentspec's ``method`` with this run's draft lengths."""
        return method_spec(method, self.engine.max_draft, self.engine.min_draft,
                           self.draft_model)


def method_spec(name: str, max_draft: int = 16, min_draft: int = 1,
                draft_model: str | None = None) -> AgentSpec:
    """The :class:`~agentspec.spec.AgentSpec` agentspec's method ``name`` runs;
    ``draft_model`` is the model drafter's model of ``model`` and ``hybrid`` (``None``: the
    one the target's shipped entry names, else its EAGLE head or distilled drafter).

    Raises:
        BenchmarkError: ``name`` is not one of agentspec's own methods, or the draft
            lengths are outside what an AgentSpec accepts.
    """
    drafting: dict[str, object] = {"max_draft": max_draft, "min_draft": min_draft}
    verifier: dict[str, object] = {}
    if name in _DRAFT_METHODS:
        drafting["method"] = _DRAFT_METHODS[name]
    elif name in ("suffix_tree", "suffix_chain"):
        # The session cache with tree drafts forced on (every index's tree merged, verified
        # with tree attention) or off (the best index's chain); plain `suffix` is the
        # product default, trees for greedy requests.
        drafting.update(method="suffix", tree=name == "suffix_tree")
    elif name == "suffix_ungated":
        # The session cache without its draft gate: every draft verified as drafted.
        drafting.update(method="suffix", draft_gate=False)
    elif name.startswith("asd_b") and name[5:].isdigit():
        # ASD: the session cache with budgeted approximate greedy verification (g = 0.5,
        # M = 1, B caps each request).
        drafting["method"] = "suffix"
        verifier = {"mode": "budgeted", "budget": float(name[5:])}
    elif name == "model":
        # The model drafter alone drafts 2 tokens: with ~1/3 first-token acceptance (EAGLE
        # head, open chat) c(3) is the best trade on this CPU (docs/hvd.md). Under HVD the
        # cost-aware policy picks the length itself.
        drafting.update(method="model", model_max=2)
    elif name in _HVD_POLICIES:
        drafting.update(method="hybrid", hvd_policy=_HVD_POLICIES[name])
    else:
        raise BenchmarkError(f"{name!r} is not one of agentspec's methods")
    if draft_model is not None and drafting.get("method") in ("model", "hybrid"):
        drafting["draft_model"] = draft_model
    try:
        return AgentSpec(drafting=DraftingPolicy(**drafting),  # type: ignore[arg-type]
                         verifier=VerifierPolicy(**verifier))  # type: ignore[arg-type]
    except ValueError as exc:
        raise BenchmarkError(f"method {name!r}: {exc}") from None


_DRAFT_METHODS = {"plain": "none", "prompt_lookup": "prompt_lookup", "suffix": "suffix",
                  "arctic_suffix": "arctic_suffix"}
_HVD_POLICIES = {"hybrid": "cost_aware", "arctic_rule": "arctic_rule",
                 "hybrid_threshold": "threshold"}  # the paper's ŷ >= τ rule


class EngineMethod:
    """agentspec's speculative loop, built by the one factory from an AgentSpec.

    Args:
        name: The method's name in reports.
        ctx: The run's shared state (target, engine settings).
        spec: The policy the product would run.
        drafter: Overrides the spec's drafter (the peers: ``oracle``, ``distilled``).
    """

    def __init__(
        self,
        name: str,
        ctx: MethodContext,
        spec: AgentSpec,
        drafter: Drafter | None = None,
        record: bool = False,
    ) -> None:
        self.name = name
        self.ctx, self.record = ctx, record
        self.spec = spec
        if drafter is None:
            try:
                drafter = build_drafter(spec, ctx.target)
            except AgentSpecError as exc:
                raise BenchmarkError(f"method {name!r} cannot be built: {exc}") from None
        self.drafter = drafter
        self.decoder: SpeculativeDecoder = build_engine(
            spec, ctx.target, drafter, decode=ctx.decode, eos_token_ids=ctx.eos_ids,
        )

    def run(self, prompt: list[int], request: WorkloadRequest, session: SessionRef) -> RunOutput:
        """Run the request through the engine (under its tool grammar in constrained runs)."""
        constraint = None
        fmt = format_for(self.ctx.target.tokenizer)  # the model's own tool syntax
        grammar = tool_call_grammar(request.tools, "auto", fmt) if self.ctx.grammars else None
        if self.ctx.grammars is not None and grammar is not None:
            constraint = self.ctx.grammars.constraint(grammar)
        g = self.decoder.generate(prompt, request.max_tokens, request.stop, session=session,
                                  constraint=constraint)
        if self.record:  # the constrained greedy reference feeds the oracle drafter
            self.ctx.oracle.add(prompt, g.tokens)
        return RunOutput(g.tokens, g.text, g.stats)


class GeneratedStop:
    """transformers stopping criterion: stop once the *generated* text (the prompt
    excluded) contains one of ``stops``.

    Args:
        prompt_len: Prompt tokens at the start of every row.
        stops: Stop strings.
        tokenizer: Decodes the generated ids.
    """

    def __init__(self, prompt_len: int, stops: Sequence[str], tokenizer: Any) -> None:
        self.prompt_len, self.stops, self.tokenizer = prompt_len, list(stops), tokenizer

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        """One flag per row (generate's StoppingCriteria contract)."""
        done = [
            any(s in self.tokenizer.decode(row[self.prompt_len :], skip_special_tokens=True)
                for s in self.stops)
            for row in input_ids.tolist()
        ]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


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

    def run(self, prompt: list[int], request: WorkloadRequest, session: SessionRef) -> RunOutput:
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
            # Not generate's stop_strings: those also match across the prompt's end (a
            # prompt ending in "\n" and a first token "```" match "\n```"), while a stop
            # string ends a completion only inside the generated text (OpenAI's semantics,
            # the engine's): the reference must stop where the engine does.
            kwargs["stopping_criteria"] = [GeneratedStop(
                len(prompt), request.stop, self.ctx.target.tokenizer)]
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
        return RunOutput(tokens, cut_at_stop(self.ctx.decode(tokens), request.stop), stats)


def _engine(name: str) -> Factory:
    """Factory of agentspec's method ``name``: its spec (:func:`method_spec`) through the
    one factory; a missing drafter artifact fails the run before any model time is spent,
    with a BenchmarkError naming the fix."""
    return lambda c: EngineMethod(name, c, c.spec(name))


Factory = Callable[[MethodContext], Method]

METHODS: dict[str, Factory] = {
    "greedy": lambda c: HFGenerateMethod("greedy", c, None, record=True),
    "hf_prompt_lookup": lambda c: HFGenerateMethod("hf_prompt_lookup", c, 10, record=False),
    "oracle": lambda c: EngineMethod("oracle", c, c.spec("plain"), drafter=c.oracle),
    **{name: _engine(name) for name in (*_DRAFT_METHODS, *_HVD_POLICIES, "model",
                                        "suffix_tree", "suffix_chain", "suffix_ungated")},
    # ASD at regret budgets B = 1, 4, 16 logits per request (approximate: identical_to_greedy
    # is expected to be false where exceptions were taken).
    **{f"asd_b{b}": _engine(f"asd_b{b}") for b in (1, 4, 16)},
}


def _distilled(c: MethodContext) -> Method:
    """The distilled drafter alone (the model drafter before the EAGLE head), for comparison."""
    from agentspec.drafters.model.causal import ModelDrafterConfig
    from agentspec.drafters.model.distilled import load_default_drafter

    try:
        drafter = load_default_drafter(c.target, ModelDrafterConfig(max_tokens=6))
    except AgentSpecError as exc:
        raise BenchmarkError(f"method 'distilled' cannot be built: {exc}") from None
    return EngineMethod("distilled", c, c.spec("plain"), drafter)


METHODS["distilled"] = _distilled


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
            return EngineMethod("greedy", ctx, ctx.spec("plain"), record=True)
        method = factory(ctx)
        if not isinstance(method, EngineMethod):
            raise BenchmarkError(f"method {name!r} cannot decode under a grammar "
                                 "(--constrained runs engine methods only)")
        return method
    if name == "greedy" and ctx.target.shape_stable:
        # Shape-stable forwards (bf16, CUDA) define plain decoding by the engine's own
        # shapes; transformers' generate runs other kernels (a bf16 argmax differs), so the
        # reference is the engine without drafts.
        return EngineMethod("greedy", ctx, ctx.spec("plain"), record=True)
    return factory(ctx)
