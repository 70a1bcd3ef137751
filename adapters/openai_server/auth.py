"""API keys -> tenants.

Each bearer key belongs to one tenant; a tenant's sessions and caches are never visible to
another tenant's keys (the tenant is part of every cache and store key). Keys come from a
JSON or TOML file and/or the ``AGENTSPEC_API_KEYS`` environment variable
(``key1=tenantA,key2=tenantB``). With no key configured the server runs in local-only mode:
every request is the ``local`` tenant and the server only binds (and only answers) loopback.

Only SHA-256 digests of the keys are kept in memory, so a heap dump or a log of this object
does not reveal them, and lookups do not compare secrets byte by byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapters.openai_server.errors import unauthorized
from agentspec.errors import ConfigError
from agentspec.types import check_id

ENV_VAR = "AGENTSPEC_API_KEYS"
LOCAL_TENANT = "local"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _check_key(key: Any) -> str:
    if not isinstance(key, str) or not key or key != key.strip() or any(c.isspace() for c in key):
        raise ConfigError("API keys must be non-empty strings without whitespace")
    return key


@dataclass(frozen=True)
class KeyRing:
    """The configured API keys (as digests) and their tenants.

    Attributes:
        tenants_by_digest: SHA-256 hex digest of a key -> tenant id.
    """

    tenants_by_digest: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, keys: Mapping[str, str]) -> KeyRing:
        """Build from ``{key: tenant}``.

        Raises:
            ConfigError: an empty key, a key with whitespace, or an invalid tenant id.
        """
        return cls({_digest(_check_key(k)): check_id("tenant", t) for k, t in keys.items()})

    @property
    def local_only(self) -> bool:
        """True when no key is configured: loopback clients only, one ``local`` tenant."""
        return not self.tenants_by_digest

    @property
    def tenants(self) -> list[str]:
        """The distinct tenants, sorted."""
        return sorted(set(self.tenants_by_digest.values()))

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant of an ``Authorization`` header value.

        Raises:
            APIError: 401 when keys are configured and the header is missing, is not a
                bearer token, or names an unknown key.
        """
        if self.local_only:
            return LOCAL_TENANT
        if not authorization:
            raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
        # Exactly "Bearer <key>": the spelling every OpenAI client sends. A lower-case
        # scheme or a key padded with blanks is a hand-built header with a bug in it; a
        # lenient match would hide that the key is not the configured one byte for byte.
        scheme, _, token = authorization.partition(" ")
        if scheme != "Bearer" or not token or token != token.strip() or " " in token:
            raise unauthorized("Malformed Authorization header: expected 'Bearer <key>' "
                               "(capital B, one space, no blanks around the key).")
        tenant = self.tenants_by_digest.get(_digest(token))
        if tenant is None:
            # Never echo the key back: error bodies end up in client logs.
            raise unauthorized("Incorrect API key provided.")
        return tenant

    def merged(self, other: KeyRing) -> KeyRing:
        """Both key sets; a key given twice must name the same tenant.

        Raises:
            ConfigError: one key mapped to two different tenants.
        """
        out = dict(self.tenants_by_digest)
        for digest, tenant in other.tenants_by_digest.items():
            if out.setdefault(digest, tenant) != tenant:
                raise ConfigError(
                    f"one API key is configured for two tenants ({out[digest]!r} and {tenant!r})"
                )
        return KeyRing(out)


def parse_env(value: str) -> KeyRing:
    """Parse ``key1=tenantA,key2=tenantB`` (whitespace around items is ignored).

    Raises:
        ConfigError: an item without ``=``, an empty key or an invalid tenant.
    """
    keys: dict[str, str] = {}
    for n, item in enumerate(part.strip() for part in value.split(",")):
        if not item:
            continue
        key, sep, tenant = item.partition("=")
        if not sep:
            raise ConfigError(f"{ENV_VAR} items must look like key=tenant; one has no '='")
        key = key.strip()
        if key in keys:
            # A silent last-wins rebinding would hand one tenant's key to another tenant.
            raise ConfigError(
                f"{ENV_VAR} names one key twice (item {n + 1}, for tenants "
                f"{keys[key]!r} and {tenant.strip()!r}); each key belongs to one tenant"
            )
        keys[key] = tenant.strip()
    return KeyRing.from_mapping(keys)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:  # json.loads would keep the last silently: a key bound to 2 tenants
            raise ValueError("a key appears twice in one object")
        out[key] = value
    return out


def load_file(path: str | Path) -> KeyRing:
    """Read keys from a JSON or TOML file.

    Accepted shapes: ``{"keys": {"<key>": "<tenant>"}}`` or a flat ``{"<key>": "<tenant>"}``
    (JSON), and ``[keys]`` with ``"<key>" = "<tenant>"`` lines (TOML, chosen by a ``.toml``
    suffix).

    Raises:
        ConfigError: the file is missing, unreadable, malformed, or has a bad entry.
    """
    path = Path(path).expanduser()
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read API key file {path}: {exc.strerror}") from None
    try:
        data: Any = (
            tomllib.loads(raw.decode("utf-8")) if path.suffix.lower() == ".toml"
            else json.loads(raw, object_pairs_hook=_no_duplicates)
        )
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"API key file {path} is not valid JSON/TOML: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("keys"), dict):
        data = data["keys"]
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ConfigError(
            f'API key file {path} must map keys to tenant ids: {{"keys": {{"<key>": "<tenant>"}}}}'
        )
    return KeyRing.from_mapping(data)


def load_keys(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> KeyRing:
    """The keys of a file (if given) plus those of ``AGENTSPEC_API_KEYS`` (if set).

    Args:
        path: A JSON/TOML key file, or ``None``.
        env: Environment to read ``AGENTSPEC_API_KEYS`` from (default ``os.environ``).
    """
    env = os.environ if env is None else env
    ring = load_file(path) if path is not None else KeyRing()
    if env.get(ENV_VAR, "").strip():
        ring = ring.merged(parse_env(env[ENV_VAR]))
    return ring
