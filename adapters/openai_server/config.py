"""Settings of the OpenAI-compatible server, and the loopback rule of local-only mode."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from adapters.openai_server.auth import KeyRing
from agentspec.errors import ConfigError

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # tool schemas + a few documents fit easily


def is_loopback(host: str | None) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1).

    Starlette's test client reports ``testclient`` as its host; that is not loopback.
    """
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerConfig:
    """How the server answers.

    Attributes:
        keys: API keys -> tenants. Empty: local-only mode (loopback clients only).
        model_name: The id served in ``/v1/models`` (default: the runtime's model name).
        aliases: Other ids accepted in the ``model`` field.
        max_request_bytes: Larger request bodies get a 413.
        default_max_tokens: Completion tokens when a request names no limit.
        max_tokens_limit: Largest ``max_tokens`` a request may ask for.
        max_waiting: Requests that may wait for the model at once; more get a 503.
        max_waiting_per_tenant: Of those, how many one tenant may hold; more get a 429, so
            one tenant's flood leaves room for the others (default ``None``: a quarter of
            ``max_waiting``, at least 1; in local-only mode, with its one tenant, all of it).
            See :attr:`tenant_share`.
        max_queue_wait_s: A request that waited longer than this for the model when its
            turn comes gets a 503 without running (its client has likely given up).
        max_generation_s: A generation running longer than this stops at its next delta
            and is answered with what it has, ``finish_reason="length"``; 0: no deadline.
        body_timeout_s: A request body not fully received in this time gets a 408 (a
            declared ``Content-Length`` that never arrives must not hold a connection).
        owns_runtime: The app closes the runtime's session store on shutdown (WAL
            checkpointed into the main file). The CLI sets it; tests that share one runtime
            between several apps leave it off.
    """

    keys: KeyRing = field(default_factory=KeyRing)
    model_name: str | None = None
    aliases: tuple[str, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    default_max_tokens: int = 256
    max_tokens_limit: int = 4096
    max_waiting: int = 256
    max_waiting_per_tenant: int | None = None
    max_queue_wait_s: float = 300.0
    max_generation_s: float = 600.0
    body_timeout_s: float = 30.0
    owns_runtime: bool = False

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "default_max_tokens", "max_tokens_limit",
                     "max_waiting"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"ServerConfig.{name} must be an int >= 1, got {value!r}")
        share = self.max_waiting_per_tenant
        if share is not None and (not isinstance(share, int) or share < 1):
            raise ConfigError(
                f"ServerConfig.max_waiting_per_tenant must be an int >= 1 or None, got {share!r}")
        if share is not None and share > self.max_waiting:
            raise ConfigError(
                f"ServerConfig.max_waiting_per_tenant ({share}) exceeds max_waiting "
                f"({self.max_waiting})")
        # `not x > 0` also refuses NaN, which compares false with everything.
        for name in ("body_timeout_s", "max_queue_wait_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ServerConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not self.max_generation_s >= 0:
            raise ConfigError(f"ServerConfig.max_generation_s must be >= 0 (0: no deadline), "
                              f"got {self.max_generation_s!r}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ConfigError(
                f"ServerConfig.default_max_tokens ({self.default_max_tokens}) exceeds "
                f"max_tokens_limit ({self.max_tokens_limit})"
            )

    @property
    def local_only(self) -> bool:
        """True when no API key is configured."""
        return self.keys.local_only

    @property
    def tenant_share(self) -> int:
        """Queued requests one tenant may hold: ``max_waiting_per_tenant`` if set, else a
        quarter of ``max_waiting`` (at least 1), or all of it in local-only mode, where
        every request is the one ``local`` tenant's and a share would only shrink the queue.
        """
        if self.max_waiting_per_tenant is not None:
            return self.max_waiting_per_tenant
        if self.local_only:
            return self.max_waiting
        return max(1, self.max_waiting // 4)


def check_bind(host: str, keys: KeyRing) -> None:
    """Refuse to listen beyond loopback without API keys.

    Raises:
        ConfigError: ``host`` is not loopback and no key is configured.
    """
    if keys.local_only and not is_loopback(host):
        raise ConfigError(
            f"refusing to listen on {host!r} without API keys: anyone who can reach it would "
            "use the model and read session caches. Configure keys with --api-keys FILE or "
            "AGENTSPEC_API_KEYS='key=tenant,...', or bind 127.0.0.1 (local-only mode)."
        )
