"""The transformers target: a causal LM with a KV cache that can score many tokens in one
forward and roll rejected positions back exactly (each precision's speculation is
token-identical to its own plain greedy decoding: ``docs/cpu_step.md``).

:class:`HFTarget` owns one request's state and composes the parts that act on it:
:class:`~agentspec.targets.forward.kv.ModelKV` (the model, its KV cache and every forward),
:class:`~agentspec.targets.request.reuse.PrefixReuse` (the token ids the cache holds and their reuse
through the prefix store), :class:`~agentspec.targets.request.scoring.Scorer` (chain, tree and batch
scoring, with the cache's state explicit) and :class:`~agentspec.targets.cost.cost_meter.CostMeter`
(the measured cost curves, their file and the live correction).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from agentspec.models import load_model_and_tokenizer
from agentspec.stopping import check_cancel
from agentspec.targets.base.cpu import release_freed_memory, warn_spinning_openmp
from agentspec.targets.cache.prefix_cache import PrefixCache
from agentspec.targets.cost import costs
from agentspec.targets.cost.cost_curves import CostCurves, FormsProbe
from agentspec.targets.cost.cost_meter import CostMeter, cost_key
from agentspec.targets.cost.live_cost import LiveCost
from agentspec.targets.forward import attention
from agentspec.targets.forward.kv import ModelKV
from agentspec.targets.forward.shapes import StablePolicy
from agentspec.targets.kernels import int8, linear, w8a8
from agentspec.targets.kernels.precision import QUANTIZED, rest_dtype
from agentspec.targets.probes.policy import stable_policy
from agentspec.targets.probes.probe_cache import ProbeCache, is_row_limit, probe_key
from agentspec.targets.probes.prompt import prompt_thread_rows
from agentspec.targets.request.lock import TargetLock
from agentspec.targets.request.reuse import PrefixReuse, prefix_store
from agentspec.targets.request.scoring import Batch, Scorer
from agentspec.targets.target_config import TargetConfig as TargetConfig  # re-exported

#: Tokens per forward when a prompt's tail is fed after reused KV. One forward over the
#: whole tail attends every new token to every new token (a full [tail, cached + tail]
#: mask: the causal kernel's skipping needs a cache-free prefill); in chunks each chunk
#: attends only to what precedes it plus itself, which on long tails roughly halves the
#: tail's attention; 512 beat both one forward and smaller chunks on long agent tails
#: (``docs/prefix-cache.md``).
PREFILL_CHUNK = 512
_CANCELLED = "the request was cancelled during its prefill"


class HFTarget:
    """A transformers causal LM behind the :class:`~agentspec.interfaces.Target` protocol.

    The KV cache holds every token fed since the last :meth:`prefill`; :meth:`score`
    appends, :meth:`rollback` drops positions from the end.

    Prefix reuse (``prefix_cache`` with a budget, and ``prefill(..., scope=tenant)``): the
    target knows which token ids its KV holds (:attr:`reuse`: every feeding method keeps
    them in step, and anything it cannot follow, such as a tree never resolved, forgets
    them). When the next request comes, the finished request's KV is stored in the scope's
    blocks, and the new prompt is fed from the end of its longest prefix shared with the
    live KV (same scope) or the stored blocks. Keys and values at a position depend only on
    the tokens up to it, so the output is the same as without reuse (in fp32 up to
    rounding, as for any draft length: token-identical in the tests).

    Attributes:
        kv: The model, its KV cache and every forward (:mod:`.kv`).
        reuse: The token ids the cache holds and their reuse (:mod:`.reuse`).
        scoring: Chain, tree and batch scoring and the cache's state (:mod:`.scoring`).
        meter: The cost curves, their file and the live cost (:mod:`.cost_meter`).
        lock: Held by every caller for the whole of a request (one KV cache: one request
            at a time, whichever runtime or policy runs it).

    ``prefill_rows`` lets a prompt's forwards of fewer rows (``None``: any) run with one
    thread on a busy machine; set it only where their bits do not depend on the count
    (:meth:`load` probes it: :func:`~agentspec.targets.probes.prompt.prompt_thread_rows`).
    """

    def __init__(self, model: Any, tokenizer: Any, name: str, dtype: str, device: str,
                 prefix_cache: PrefixCache | None = None,
                 stable_policy: StablePolicy | None = None,
                 prefill_rows: int | None = 0) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.dtype = dtype
        self.device = device
        self.lock = TargetLock()
        self.kv = ModelKV(model, device)
        forms = None
        if device == "cpu":  # bit-identical, no KV copy per query head (see attention.py)
            attention.install_gqa_attention(model, always=True)
            if stable_policy is None:
                # A short draft's few rows in the product form measured fastest on this
                # machine (not under a shape-stable policy: the form changes with the row
                # count).
                forms = FormsProbe(linear.install_product_forms(model),
                                   lambda bar: linear.measure(model, bar=bar),
                                   linear.shapes(model))
        if stable_policy is not None:
            self.kv.make_stable(stable_policy)
        # Shape-stable forwards cost differently (padded rows, a fixed key length): their
        # curves are kept apart.
        self.meter = CostMeter(self.kv, name, dtype if stable_policy is None else f"{dtype}-stable",
                               lambda ctx, repeats, bar: self.measure_costs(ctx, repeats, bar),
                               forms)
        self.meter.prefill_rows = prefill_rows
        self.reuse = PrefixReuse(self.kv, prefix_cache)
        self.scoring = Scorer(self.kv, self.reuse, self.meter)

    @classmethod
    def load(cls, config: TargetConfig | None = None) -> HFTarget:
        """Load the model named by ``config`` (the embedded model by default)."""
        from agentspec.targets import snapshot

        config = config or TargetConfig()
        device = config.resolved_device()
        digits = QUANTIZED.get(config.dtype)
        # A shipped model (the 1.5B's weights dequantised from its GGUF, the others' read in
        # fp32 and mostly kept resident by the allocator after quantizing) loads
        # its int8 precisions from a snapshot: the tensors quantizing at load gives.
        loaded = None if digits is None else snapshot.load_quantized(config.model, digits)
        if loaded is not None:
            model, tok, files = loaded
        else:
            model, tok, files = load_model_and_tokenizer(config.model, config.load_dtype,
                                                         device)
            if digits is not None:  # from the fp32 weights; raises off the CPU
                int8.quantize_linears(model, activations=digits)
        if digits is not None:
            # The rest (embedding, norms, attention, KV) in bf16 where it is native, else
            # fp32 (w8a8/w8a16; int8's kernel takes bf16 rows); int8 weights stay int8.
            model.to(rest_dtype(digits))
            if loaded is None:  # the fp32 weights just freed: gigabytes the allocator keeps
                release_freed_memory()
        store = prefix_store(files, config.dtype, config.prefix_cache_bytes,
                             config.prefix_spill_bytes)
        # The load-time probes' answers, kept per model, precision, forward shapes (the
        # shape-stable setting asked for) and machine.
        probes = ProbeCache(probe_key(cost_key(
            files.name, model, f"{config.dtype}-stable{config.shape_stable}", device), model))
        target = cls(model, tok, files.name, config.dtype, device, store,
                     stable_policy(config, device, model, probes))
        if device == "cpu":  # a busy machine's prefill may then take one thread
            warn_spinning_openmp()
            switch = w8a8.prefill_switch(model)
            target.meter.prefill_rows = probes.value(
                "prompt_thread_rows", lambda: prompt_thread_rows(target.kv, switch),
                is_row_limit)
        if config.measure_costs:  # here, not inside the first request
            target.measure_cost_curves(progress=True)
        return target

    # -- the Target protocol -------------------------------------------------------------

    @property
    def shape_stable(self) -> bool:
        """Whether decode forwards are shape-stable (:mod:`.stable`): a tree draft is then
        verified as its first branch (siblings at other cache slots than their chain's
        would not give a chain's bits)."""
        return self.kv.stable is not None

    @property
    def vocab_size(self) -> int:
        """Number of logits per position."""
        return self.kv.vocab

    @property
    def max_positions(self) -> int:
        """The model's context window."""
        return self.kv.max_positions

    @property
    def num_cached(self) -> int:
        """Positions currently in the KV cache."""
        return self.kv.num_cached

    def check_fits(self, n_tokens: int) -> None:
        """Raise :class:`PromptTooLongError` if ``n_tokens`` positions exceed the model."""
        self.kv.check_fits(n_tokens)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix KV store (``None`` or a zero budget: no reuse)."""
        return self.reuse.store

    @prefix_cache.setter
    def prefix_cache(self, store: PrefixCache | None) -> None:
        self.reuse.store = store

    @property
    def reuse_enabled(self) -> bool:
        """Whether :meth:`prefill` reuses KV (a prefix store with a non-zero budget)."""
        return self.reuse.enabled

    @property
    def reuse_keeps_features(self) -> bool:
        """Whether a reused prefix comes with its feature rows (``prefill(features=True)``):
        reuse on and a final norm to read them from."""
        return self.reuse.keeps_features

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens the latest :meth:`prefill` did not feed."""
        return self.reuse.reused_tokens

    def prefill(self, tokens: Sequence[int], *, scope: str | None = None,
                cancel: threading.Event | None = None, features: bool = False) -> torch.Tensor:
        """Start a request: the cache ends up holding ``tokens``; return the last position's
        logits ``[V]``.

        Without ``scope`` (or with reuse disabled) the cache is reset and every token fed.
        With ``scope`` (the tenant), the previous request's KV is first stored under its
        own scope, then the longest prefix of ``tokens`` that the live KV (same scope) or
        the scope's stored blocks hold is reused and only the rest is fed: at least one
        token, so the logits are this request's. :attr:`reused_tokens` says how many
        were reused. With ``features`` (the request's drafter reads :meth:`last_features`)
        only a prefix whose feature rows are kept is reused (a block stored without rows
        ends it), and :meth:`last_features` then covers every position, as after a
        prefill without reuse.

        ``cancel`` is checked before every forward of the prompt: a tail fed in chunks
        after reused KV stops within one chunk (:data:`PREFILL_CHUNK` tokens) of the event
        being set. A cold prefill is one forward and cannot be interrupted; the engine
        checks again right after it. What was fed stays cached (and reusable).

        Raises:
            Cancelled: ``cancel`` was set before the prompt was fed.
        """
        kv, reuse = self.kv, self.reuse
        kv.check_fits(len(tokens))
        tokens = list(tokens)
        reuse.retire(pending=self.scoring.pending)  # (a request nobody retired)
        kv.cache = reuse.start(tokens, scope, features, chunk=PREFILL_CHUNK,
                               live_ok=not isinstance(self.scoring.mode, Batch))
        self.scoring.reset()
        if not tokens:
            kv.features = torch.zeros(1, 0, int(self.model.config.hidden_size))
            return torch.zeros(kv.vocab)
        reused = reuse.reused_tokens
        logits = self._feed_prompt(tokens[reused:], chunked=reused > 0, cancel=cancel)
        reuse.ids = tokens
        log = reuse.log
        if reused and log is not None and log.covers(len(tokens)):
            # Every position's rows, the reused ones from where their KV came from (a copy:
            # the log's buffer is written over after a rollback).
            kv.features = log.view(len(tokens)).clone()[None]  # [1, n, H]
        return logits

    def _feed_prompt(self, tokens: list[int], chunked: bool,
                     cancel: threading.Event | None = None) -> torch.Tensor:
        """Feed prompt ``tokens`` (after the cached ones); the last position's logits
        ``[V]``. A tail after reused KV goes in :data:`PREFILL_CHUNK`-token forwards (a
        cache-free prefill keeps one forward: it runs the causal kernel); ``cancel`` is
        checked before each."""
        step = PREFILL_CHUNK if chunked else len(tokens)  # tokens per forward
        # one thread beside a busy process, where forwards this long are exact
        with self.meter.prefill(min(len(tokens), step)):
            return self._feed_chunks(tokens, step, cancel)

    def _feed_chunks(self, tokens: list[int], step: int,
                     cancel: threading.Event | None) -> torch.Tensor:
        if len(tokens) <= step:
            check_cancel(cancel, _CANCELLED)
            return self.scoring.feed(tokens, last_only=True)[-1]
        feats = []
        for start in range(0, len(tokens), step):
            check_cancel(cancel, _CANCELLED)
            chunk = tokens[start : start + step]
            logits = self.scoring.feed(chunk, last_only=True)[-1]
            self.reuse.fed(chunk)  # in step with the cache: a cancelled prefill's fed
            if self.kv.features is not None:  # chunks stay reusable by a retry
                feats.append(self.kv.features)
        # last_features() covers every position this prefill fed, as after one forward.
        self.kv.features = torch.cat(feats, dim=1) if len(feats) > 1 else self.kv.features
        return logits

    def retire(self) -> None:
        """Store the live KV of the request that just ended in the prefix store, now.

        The runtime calls it when a request ends (under the model lock, after the request's
        numbers are taken), so the copy is never part of the next request's timed prefill:
        that request may be another tenant's, and its reported ``prefill_s`` would otherwise
        tell it how much the previous tenant sent. :meth:`prefill` still retires a request
        nobody retired (direct engine use); a second call stores nothing, and neither does
        a call while a tree or batch is unresolved.
        """
        self.reuse.retire(pending=self.scoring.pending)

    def score(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` in one forward; return their logits ``[len(tokens), V]``."""
        return self.scoring.score(tokens)

    def score_batch(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Score K equal-length continuations of the cached prefix in one batched forward.

        For multi-draft verification (``MultiDraftDecoder``): the cache is expanded to K
        rows, row j appends ``rows[j]``. Call :meth:`select_row` before the next
        :meth:`score` to keep one row; :meth:`rollback` works on all rows meanwhile.

        Returns:
            Logits ``[K, n, V]``.
        """
        return self.scoring.score_batch(rows)

    def score_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Append a token tree to the cached prefix in one forward (tree attention).

        ``tokens[0]`` is the pending token (the root); node ``i > 0`` follows
        ``tokens[parents[i]]``. Each position attends to the cached prefix and to its own
        ancestors only, at position ``cached + depth``, so its logits equal those of the
        chain root -> ... -> node. Call :meth:`keep_tree_path` before the next forward.

        Returns:
            Logits ``[len(tokens), V]``.
        """
        return self.scoring.score_tree(tokens, parents)

    def keep_tree_path(self, path: Sequence[int]) -> None:
        """After :meth:`score_tree` of ``n`` tokens: keep the root and the nodes ``path``
        (indices into that call's tokens, root to leaf, without the root) in the cache.

        Raises:
            ConfigError: the last scoring was not a :meth:`score_tree` (or its tree was
                already resolved).
        """
        self.scoring.keep_tree_path(path)

    def select_row(self, row: int) -> None:
        """Keep only cache row ``row`` of the last :meth:`score_batch`.

        Raises:
            ConfigError: no :meth:`score_batch` is unresolved.
        """
        self.scoring.select_row(row)

    def last_features(self) -> torch.Tensor:
        """Final-norm hidden states ``[n, H]`` (fp32, CPU) of the positions fed by the
        latest prefill/score (the kept row after :meth:`select_row`); after a prefill that
        reused KV, of every prompt position when their rows are kept (always with
        ``prefill(features=True)``).

        Raises:
            ConfigError: no forward has run, or the model has no final norm to hook.
        """
        return self.kv.last_features()

    def rollback(self, n: int) -> None:
        """Drop the last ``n`` cached positions (exact: later logits equal a fresh run's)."""
        self.scoring.rollback(n)

    # -- what a forward costs (agentspec.targets.cost.cost_meter) -------------------------------

    @property
    def curves(self) -> CostCurves:
        """The measured c(k, L) curves and their file (measured at load, never in a request)."""
        return self.meter.curves

    @curves.setter
    def curves(self, curves: CostCurves) -> None:
        self.meter.curves = curves

    def verify_cost(self, k: int) -> float:
        """Measured seconds of one forward over ``k`` new tokens with a ~500-token cache
        (once per model, dtype, device and machine; cached under ``$AGENTSPEC_HOME/costs``)."""
        return self.meter.verify_cost(k)

    @property
    def live_cost(self) -> LiveCost:
        """The cost of a forward on the machine as loaded now (:mod:`.live_cost`): its prior
        is the measured curves when the cost file has them (never measured here: a request
        must not wait for a measurement), else the safe prior until
        :meth:`measure_cost_curves` runs."""
        return self.meter.live_cost

    def context_cost(self, k: int, context: int) -> float:
        """c(k, L) now: seconds of one forward over ``k`` new tokens on a cache of
        ``context`` positions, the measured curves (:mod:`agentspec.targets.cost.costs`)
        corrected by the forwards timed since (:attr:`live_cost`). Never measures."""
        return self.meter.context_cost(k, context)

    def cost_curve(self) -> dict[int, float]:
        """The measured c(k) points (seconds), measuring them if needed."""
        return self.meter.cost_curve()

    def measure_cost_curves(self, progress: bool = False) -> dict[int, dict[int, float]]:
        """Measure the cost curves the cost file lacks (once per machine: seconds, with a
        progress line when ``progress``) and make them :attr:`live_cost`'s prior.
        :meth:`load` calls it (so does every runtime and server, which load through it),
        never a request."""
        return self.meter.ensure(progress)

    def measure_costs(self, context: int = costs.SHORT_CONTEXT,
                      repeats: int = 5, bar: Any = None) -> dict[int, float]:
        """Time one forward over k tokens on a ``context``-position cache (median of
        repeats). The cache holds random keys and values (attention costs the same
        whatever they are), so no prompt of ``context`` tokens is prefilled first; the
        request's cache is put back afterwards."""
        return self.meter.measure(self.scoring, context, repeats, bar)
