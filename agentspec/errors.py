"""The exception hierarchy: every misuse of agentspec raises an ``AgentSpecError``.

Subclasses that describe bad arguments also derive from ``ValueError`` so callers that
already catch ``ValueError`` keep working.
"""

from __future__ import annotations


class AgentSpecError(Exception):
    """Base class of every error agentspec raises on purpose."""


class ConfigError(AgentSpecError, ValueError):
    """A configuration value is invalid; the message names the field and the value."""


class ModelLoadError(AgentSpecError):
    """A model could not be found, converted or loaded; the message says how to fix it."""


class PromptTooLongError(AgentSpecError, ValueError):
    """A prompt (plus the requested new tokens) does not fit the model's context window."""


class DraftError(AgentSpecError, ValueError):
    """A drafter produced a malformed draft (bad parents, out-of-vocabulary token, ...)."""


class BenchmarkError(AgentSpecError, ValueError):
    """A benchmark was asked for an unknown workload or method, or bad limits."""


class StoreError(AgentSpecError):
    """The session store failed (base of the store's own errors)."""


class StoreCorruptError(StoreError):
    """The session store file, or one stored turn, is damaged; the message says what to do."""


class StoreBusyError(StoreError):
    """The session store stayed locked by other writers for longer than the busy timeout."""


class UnknownSessionError(AgentSpecError, KeyError):
    """A session that is not in the store was asked for (show, delete, export)."""

    def __str__(self) -> str:
        # KeyError's str() wraps the message in quotes; operators should read it plainly.
        return str(self.args[0]) if self.args else ""


class SessionTooLargeError(AgentSpecError, ValueError):
    """Appending a turn would take a session past a configured token limit."""


class TrainingDataError(AgentSpecError, ValueError):
    """Training data (traces, documents, prompts) is empty, malformed or made for another
    model's tokenizer; the message names the file or value."""


class RequestStateError(AgentSpecError):
    """A request's state was used outside its lifecycle: a step, features or a finish for
    a request that was never begun (or has already finished), or a request id begun twice
    while live. The message names the part and the request."""


class Cancelled(AgentSpecError):
    """A request was cancelled by its caller (a ``cancel`` event was set) before it
    finished: raised between prefill chunks and decode steps, so a client that left stops
    costing forwards. Nothing of the request is stored."""


class GrammarError(ConfigError):
    """A grammar (JSON schema, response_format, tool schema) that cannot constrain
    decoding, or a constrained decode that left the grammar."""


class DeviceUnavailableError(ConfigError):
    """A device was asked for (``--device cuda``, ``TargetConfig(device="cuda")``) that this
    machine does not have; the message names the value and what is available."""
