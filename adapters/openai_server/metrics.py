"""Prometheus metrics of the server, exposed with ``prometheus_client``.

Speculative-decoding counters follow vLLM's names with agentspec's prefix, so dashboards
built for vLLM's ``spec_decode`` metrics work after a prefix change:

* ``agentspec:spec_decode_num_drafts_total``: decode steps that verified a non-empty draft;
* ``agentspec:spec_decode_num_draft_tokens_total``: draft tokens proposed;
* ``agentspec:spec_decode_num_accepted_tokens_total``: draft tokens accepted;
* ``agentspec:spec_decode_num_accepted_tokens_per_pos_total{position="i"}``: drafts whose
  token at position i was accepted (acceptance rate at i = this / num_drafts);
* ``agentspec:prompt_tokens_cached_total``: prompt tokens whose KV was reused from earlier
  requests of the tenant (prefix reuse; hit rate = this / ``prompt_tokens_total``), and
  ``agentspec:prefill_seconds_total``: seconds spent reading prompts;
* ``agentspec:prefix_cache_bytes`` / ``agentspec:prefix_cache_budget_bytes``: the prefix
  store's use and budget (gauges, when the runtime's target has a store);
* ``agentspec:prefix_cache_disk_faults_total{kind="rejected|write_error"}``: KV blocks on
  disk refused on reading (signature, tokens, layout) and block writes that failed;
* ``agentspec:store_failures_total{op="append|load",reason=...}``: session store failures
  (a turn answered but not stored; a session's history not read);
* ``agentspec:queue_rejections_total{reason=...}``: requests refused or dropped by the
  generation queue: ``global_full`` (503), ``tenant_share`` (429), ``queue_timeout`` (503,
  waited past ``max_queue_wait_s``), ``shutdown`` (503);
* ``agentspec:generation_deadline_stops_total``: generations cut at ``max_generation_s``;
* ``agentspec:request_cancellations_total{stage="queued|running"}``: requests whose client
  left while they waited, or while they were prefilled or decoded.

Labels carry no tenant: ``/metrics`` is scraped without a key, and tenant names are the
operator's business, not every scraper's.

Every :class:`Metrics` has its own :class:`~prometheus_client.CollectorRegistry` (several
apps may live in one process, each with its own numbers), and its exposition has no
``_created`` samples: they are dropped by this module's collector rather than with
``prometheus_client.disable_created_metrics()``, which would change every other registry
in the process too (vLLM's, for one).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from agentspec.requests import RequestStates
from agentspec.storage.health import STORE_FAILURE_REASONS, CountingStore
from agentspec.targets.cache.prefix_cache import PrefixCache
from agentspec.types import RequestStats

PREFIX = "agentspec:"
REJECTION_REASONS = ("global_full", "tenant_share", "queue_timeout", "shutdown")
CANCEL_STAGES = ("queued", "running")
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class _WithoutCreated(Collector):
    """Collects the given metrics, leaving out their ``_created`` samples."""

    def __init__(self, metrics: Iterable[MetricWrapperBase]) -> None:
        self._metrics = list(metrics)

    def collect(self) -> Iterable[Metric]:
        """Each metric's family, ``_created`` samples removed."""
        for metric in self._metrics:
            for family in metric.collect():
                created = family.name + "_created"
                family.samples = [s for s in family.samples if s.name != created]
                yield family


class _ReadCounter(Collector):
    """A counter family whose values are read from their owner at scrape time (the store
    and the prefix cache count for themselves; the server only exposes their counts)."""

    def __init__(self, name: str, doc: str, model_name: str, labels: tuple[str, ...],
                 read: Callable[[], dict[tuple[str, ...], float]]) -> None:
        self._name, self._doc, self._model = name, doc, model_name
        self._labels, self._read = labels, read

    def collect(self) -> Iterable[Metric]:
        """One sample per label tuple ``read()`` returns."""
        family = CounterMetricFamily(self._name, self._doc, labels=("model_name", *self._labels))
        for values, n in sorted(self._read().items()):
            family.add_metric([self._model, *values], n)
        yield family


class Metrics:
    """Thread-safe metrics of a server; :meth:`render` writes the exposition text.

    Args:
        model_name: Value of the ``model_name`` label on every sample.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()  # a scrape sees whole requests, never half of one
        self.running = 0
        self.waiting = 0
        m = ("model_name",)

        def counter(name: str, help_: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, help_, (*m, *labels), registry=None)

        def histogram(name: str, help_: str) -> Histogram:
            return Histogram(PREFIX + name, help_, m, buckets=LATENCY_BUCKETS, registry=None)

        running = Gauge(PREFIX + "num_requests_running", "Requests generating now.", m,
                        registry=None)
        waiting = Gauge(PREFIX + "num_requests_waiting", "Requests queued for the model.", m,
                        registry=None)
        running.labels(model_name).set_function(lambda: self.running)
        waiting.labels(model_name).set_function(lambda: self.waiting)
        # Labelled by a value only known later: a sample appears once its value first occurs.
        self._requests = counter("request_success", "Finished requests by finish reason.",
                                 "finished_reason")
        self._errors = counter("http_errors", "Error responses by HTTP status.", "status")
        self._accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                         "Drafts whose token at this position was accepted.",
                                         "position")
        prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        cached_tokens = counter("prompt_tokens_cached",
                                "Prompt tokens whose KV was reused (prefix reuse), not fed.")
        prefill_s = counter("prefill_seconds", "Seconds spent reading prompts (prefill).")
        generation_tokens = counter("generation_tokens", "Tokens generated.")
        forwards = counter("target_forwards", "Target model forward passes in decoding.")
        drafts = counter("spec_decode_num_drafts", "Decode steps that verified a draft.")
        draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._rejections = counter("queue_rejections",
                                   "Requests refused or dropped by the queue, by reason.",
                                   "reason")
        self._cancellations = counter("request_cancellations",
                                      "Requests whose client left, by stage.", "stage")
        deadline_stops = counter("generation_deadline_stops",
                                 "Generations cut short at the generation deadline.")
        # Known label values start at 0, so a dashboard's rate() has a series from the start.
        for reason in REJECTION_REASONS:
            self._rejections.labels(model_name, reason)
        for stage in CANCEL_STAGES:
            self._cancellations.labels(model_name, stage)
        self._deadline_stops = deadline_stops.labels(model_name)
        e2e = histogram("e2e_request_latency_seconds",
                        "End-to-end request latency, queueing included.")
        ttft = histogram("time_to_first_token_seconds",
                         "Time to the first streamed delta, queueing included.")
        # Unlabelled but for the model: present (at 0) from the start.
        self._prompt_tokens = prompt_tokens.labels(model_name)
        self._cached_tokens = cached_tokens.labels(model_name)
        self._prefill_s = prefill_s.labels(model_name)
        self._generation_tokens = generation_tokens.labels(model_name)
        self._forwards = forwards.labels(model_name)
        self._drafts = drafts.labels(model_name)
        self._draft_tokens = draft_tokens.labels(model_name)
        self._accepted_tokens = accepted.labels(model_name)
        self._e2e = e2e.labels(model_name)
        self._ttft = ttft.labels(model_name)
        self.registry = CollectorRegistry()
        self.registry.register(_WithoutCreated([
            running, waiting, self._requests, self._errors, prompt_tokens, cached_tokens,
            prefill_s, generation_tokens,
            forwards, drafts, draft_tokens, accepted, self._accepted_per_pos, e2e, ttft,
            self._rejections, self._cancellations, deadline_stops,
        ]))

    def watch_prefix_cache(self, cache: PrefixCache) -> None:
        """Expose the prefix store's bytes in use and budget as gauges, and the disk copy's
        rejected blocks and failed writes as counters (all read at scrape)."""
        m = ("model_name",)
        used = Gauge(PREFIX + "prefix_cache_bytes", "Bytes of prompt-prefix KV held.", m,
                     registry=None)
        budget = Gauge(PREFIX + "prefix_cache_budget_bytes",
                       "Budget of the prompt-prefix KV store.", m, registry=None)
        used.labels(self.model_name).set_function(lambda: cache.bytes_used)
        budget.labels(self.model_name).set_function(lambda: cache.budget_bytes)
        self.registry.register(_WithoutCreated([used, budget]))

        def disk() -> dict[tuple[str, ...], float]:
            d = cache.to_dict()
            return {("rejected",): d["rejected_blocks"],
                    ("write_error",): d["spill_write_errors"]}

        self.registry.register(_ReadCounter(
            PREFIX + "prefix_cache_disk_faults", "Prefix KV blocks on disk rejected on reading "
            "(signature, tokens or layout) and block writes that failed; each costs a "
            "recomputation, never an error.", self.model_name, ("kind",), disk))

    def watch_requests(self, home: RequestStates) -> None:
        """Expose the home of per-request state: requests holding state now, and those it
        forgot because too many were live (requests that never ended: a leak shows here)."""
        live = Gauge(PREFIX + "request_states", "Requests whose drafter, gate or verifier "
                     "state is held now.", ("model_name",), registry=None)
        live.labels(self.model_name).set_function(lambda: home.live)
        self.registry.register(_WithoutCreated([live]))
        self.registry.register(_ReadCounter(
            PREFIX + "request_states_evicted", "Requests whose state was forgotten because "
            "more were live than the home keeps (they never ended).", self.model_name, (),
            lambda: {(): float(home.evicted)}))

    def watch_store(self, turns: CountingStore) -> None:
        """Expose the session store's failures (turns answered but not stored, stored
        history not read) by operation and reason, read at scrape."""

        def failures() -> dict[tuple[str, ...], float]:
            out: dict[tuple[str, ...], float] = {
                (op, reason): 0.0 for op in ("append", "load")
                for reason in STORE_FAILURE_REASONS}
            for key, n in list(turns.failures.items()):
                out[key] = float(n)
            return out

        self.registry.register(_ReadCounter(
            PREFIX + "store_failures", "Session store operations that failed: a turn answered "
            "but not stored (append), a session's history not read (load).", self.model_name,
            ("op", "reason"), failures))

    def queued(self, delta: int) -> None:
        """A request entered (+1) or left (-1) the generation queue."""
        with self._lock:
            self.waiting += delta

    def started(self, delta: int) -> None:
        """A generation started (+1) or ended (-1)."""
        with self._lock:
            self.running += delta

    def rejected(self, reason: str) -> None:
        """Count a request the queue refused or dropped (one of :data:`REJECTION_REASONS`)."""
        with self._lock:
            self._rejections.labels(self.model_name, reason).inc()

    def cancelled(self, stage: str) -> None:
        """Count a request whose client left while ``queued`` or ``running``."""
        with self._lock:
            self._cancellations.labels(self.model_name, stage).inc()

    def deadline_stop(self) -> None:
        """Count a generation cut short at the generation deadline."""
        with self._lock:
            self._deadline_stops.inc()

    def first_token(self, seconds: float) -> None:
        """Record a streaming request's time to its first generated delta."""
        with self._lock:
            self._ttft.observe(seconds)

    def error(self, status: int) -> None:
        """Count an error response."""
        with self._lock:
            self._errors.labels(self.model_name, str(status)).inc()

    def aborted(self) -> None:
        """Count a streamed request whose client left before it finished."""
        with self._lock:
            self._requests.labels(self.model_name, "abort").inc()

    def finished(self, stats: RequestStats, finish_reason: str, seconds: float) -> None:
        """Add a finished request's numbers.

        Args:
            stats: The request's speculative-decoding statistics.
            finish_reason: ``stop``, ``length``, ``tool_calls`` or ``abort``.
            seconds: End-to-end latency as the server saw it (queueing included).
        """
        drafts = draft_tokens = accepted_tokens = 0
        per_pos: dict[int, int] = {}
        for step in stats.steps:
            if step.draft_len <= 0:
                continue
            drafts += 1
            draft_tokens += step.draft_len
            accepted = min(step.accepted, step.draft_len)
            accepted_tokens += accepted
            for pos in range(accepted):
                per_pos[pos] = per_pos.get(pos, 0) + 1
        with self._lock:
            self._requests.labels(self.model_name, finish_reason).inc()
            self._prompt_tokens.inc(stats.prompt_tokens)
            self._cached_tokens.inc(stats.cached_prompt_tokens)
            self._prefill_s.inc(stats.prefill_s)
            self._generation_tokens.inc(stats.generated_tokens)
            self._forwards.inc(stats.forwards)
            self._drafts.inc(drafts)
            self._draft_tokens.inc(draft_tokens)
            self._accepted_tokens.inc(accepted_tokens)
            for pos, n in sorted(per_pos.items()):
                self._accepted_per_pos.labels(self.model_name, str(pos)).inc(n)
            self._e2e.observe(seconds)

    def render(self) -> str:
        """The Prometheus text exposition of every metric (``CONTENT_TYPE_LATEST``)."""
        with self._lock:
            return generate_latest(self.registry).decode("utf-8")
