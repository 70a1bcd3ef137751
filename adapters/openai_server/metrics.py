"""Prometheus metrics of the server, in the text exposition format (written by hand).

Speculative-decoding counters follow vLLM's names with agentspec's prefix, so dashboards
built for vLLM's ``spec_decode`` metrics work after a prefix change:

* ``agentspec:spec_decode_num_drafts_total``: decode steps that verified a non-empty draft;
* ``agentspec:spec_decode_num_draft_tokens_total``: draft tokens proposed;
* ``agentspec:spec_decode_num_accepted_tokens_total``: draft tokens accepted;
* ``agentspec:spec_decode_num_accepted_tokens_per_pos_total{position="i"}``: drafts whose
  token at position i was accepted (acceptance rate at i = this / num_drafts).

Labels carry no tenant: ``/metrics`` is scraped without a key, and tenant names are the
operator's business, not every scraper's.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Iterable

from agentspec.types import RequestStats

PREFIX = "agentspec:"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


def escape_label(value: str) -> str:
    """Escape a label value for the exposition format (backslash, quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_labels(labels: dict[str, str]) -> str:
    """``{a="x",b="y"}`` (empty string for no labels)."""
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items()) + "}"


def _num(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class Histogram:
    """A cumulative-bucket histogram (observations in seconds)."""

    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS) -> None:
        self.bounds = sorted(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last slot is +Inf
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        """Add one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: dict[str, str]) -> list[str]:
        """The ``_bucket``/``_sum``/``_count`` sample lines."""
        out, running = [], 0
        for bound, count in zip([*self.bounds, float("inf")], self.counts, strict=True):
            running += count
            out.append(f"{name}_bucket{format_labels({**labels, 'le': _num(bound)})} {running}")
        out.append(f"{name}_sum{format_labels(labels)} {_num(self.total)}")
        out.append(f"{name}_count{format_labels(labels)} {self.n}")
        return out


class Metrics:
    """Thread-safe counters of a server; :meth:`render` writes the exposition text.

    Args:
        model_name: Value of the ``model_name`` label on every sample.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.requests: Counter[str] = Counter()  # finish reason -> finished requests
        self.errors: Counter[int] = Counter()  # HTTP status -> error responses
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.forwards = 0
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_pos: Counter[int] = Counter()
        self.e2e = Histogram()
        self.ttft = Histogram()

    def queued(self, delta: int) -> None:
        """A request entered (+1) or left (-1) the generation queue."""
        with self._lock:
            self.waiting += delta

    def started(self, delta: int) -> None:
        """A generation started (+1) or ended (-1)."""
        with self._lock:
            self.running += delta

    def first_token(self, seconds: float) -> None:
        """Record a streaming request's time to its first generated delta."""
        with self._lock:
            self.ttft.observe(seconds)

    def error(self, status: int) -> None:
        """Count an error response."""
        with self._lock:
            self.errors[status] += 1

    def aborted(self) -> None:
        """Count a streamed request whose client left before it finished."""
        with self._lock:
            self.requests["abort"] += 1

    def finished(self, stats: RequestStats, finish_reason: str, seconds: float) -> None:
        """Add a finished request's numbers.

        Args:
            stats: The request's speculative-decoding statistics.
            finish_reason: ``stop``, ``length``, ``tool_calls`` or ``abort``.
            seconds: End-to-end latency as the server saw it (queueing included).
        """
        with self._lock:
            self.requests[finish_reason] += 1
            self.prompt_tokens += stats.prompt_tokens
            self.generation_tokens += stats.generated_tokens
            self.forwards += stats.forwards
            for step in stats.steps:
                if step.draft_len <= 0:
                    continue
                self.drafts += 1
                self.draft_tokens += step.draft_len
                accepted = min(step.accepted, step.draft_len)
                self.accepted_tokens += accepted
                for pos in range(accepted):
                    self.accepted_per_pos[pos] += 1
            self.e2e.observe(seconds)

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        m = {"model_name": self.model_name}
        out: list[str] = []

        def family(name: str, kind: str, help_: str, samples: list[str]) -> None:
            out.append(f"# HELP {PREFIX}{name} {help_}")
            out.append(f"# TYPE {PREFIX}{name} {kind}")
            out.extend(samples)

        def sample(name: str, value: float, **labels: str) -> str:
            return f"{PREFIX}{name}{format_labels({**m, **labels})} {_num(value)}"

        with self._lock:
            family("num_requests_running", "gauge", "Requests generating now.",
                   [sample("num_requests_running", self.running)])
            family("num_requests_waiting", "gauge", "Requests queued for the model.",
                   [sample("num_requests_waiting", self.waiting)])
            family("request_success", "counter", "Finished requests by finish reason.",
                   [sample("request_success_total", n, finished_reason=reason)
                    for reason, n in sorted(self.requests.items())])
            family("http_errors", "counter", "Error responses by HTTP status.",
                   [sample("http_errors_total", n, status=str(code))
                    for code, n in sorted(self.errors.items())])
            family("prompt_tokens", "counter", "Prompt tokens processed.",
                   [sample("prompt_tokens_total", self.prompt_tokens)])
            family("generation_tokens", "counter", "Tokens generated.",
                   [sample("generation_tokens_total", self.generation_tokens)])
            family("target_forwards", "counter", "Target model forward passes in decoding.",
                   [sample("target_forwards_total", self.forwards)])
            family("spec_decode_num_drafts", "counter", "Decode steps that verified a draft.",
                   [sample("spec_decode_num_drafts_total", self.drafts)])
            family("spec_decode_num_draft_tokens", "counter", "Draft tokens proposed.",
                   [sample("spec_decode_num_draft_tokens_total", self.draft_tokens)])
            family("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.",
                   [sample("spec_decode_num_accepted_tokens_total", self.accepted_tokens)])
            top = max(self.accepted_per_pos, default=-1)
            family("spec_decode_num_accepted_tokens_per_pos", "counter",
                   "Drafts whose token at this position was accepted.",
                   [sample("spec_decode_num_accepted_tokens_per_pos_total",
                           self.accepted_per_pos[p], position=str(p)) for p in range(top + 1)])
            family("e2e_request_latency_seconds", "histogram",
                   "End-to-end request latency, queueing included.",
                   self.e2e.lines(f"{PREFIX}e2e_request_latency_seconds", m))
            family("time_to_first_token_seconds", "histogram",
                   "Time to the first streamed delta, queueing included.",
                   self.ttft.lines(f"{PREFIX}time_to_first_token_seconds", m))
        return "\n".join(out) + "\n"
