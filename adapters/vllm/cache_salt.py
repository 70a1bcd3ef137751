"""Keep tenants out of each other's KV in vLLM's automatic prefix cache (``cache_salt``).

vLLM hashes prompt KV blocks by their tokens and reuses a block for any later request whose
prompt starts with the same tokens. Across tenants that is a side channel: a faster first
token tells tenant B that tenant A sent the same prefix (``docs/prefix-cache.md`` says why
agentspec's own prefix reuse never crosses tenants). vLLM mixes a request's ``cache_salt``
into the hash of its first block (``vllm/v1/core/kv_cache_utils.py``,
``_gen_extra_hash_keys``), so every later block's hash (chained from the first) differs
between salts: requests with the same salt share prefix KV, requests with different salts
never do. The offline engine takes the salt on the prompt
(``{"prompt_token_ids": [...], "cache_salt": ...}``, ``vllm/inputs/llm.py`` ``TokensPrompt``).

The salt of a request with a session is a keyed hash of its tenant
(HMAC-SHA256 under a random per-process key, hex): the same tenant gets the same salt, so
its sessions, agents and repeated system prompts keep vLLM's prefix reuse; the tenant id
itself never reaches vLLM (its logs, KV events or a KV connector's store), and a tenant
cannot compute another tenant's salt. The key lives only in this process, which also owns
the engine (:class:`~adapters.vllm.backend.VLLMRuntime` runs ``vllm.LLM`` in-process), so
a salt never outlives the prefix cache it scopes.

A request without a session (``session=None``; the server's anonymous requests under
``session`` scope) cannot be attributed to a tenant, so it gets a fresh random salt: it
reuses nothing and nothing reuses it, as agentspec's own runtime never reuses the prefix
of a session-less request. Salting it by a shared "default" tenant instead would let two
tenants' anonymous requests share KV.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from typing import Any

from agentspec.types import SessionRef

__all__ = ["SALT_HEX_CHARS", "cache_salt", "engine_prompt"]

#: Hex characters of a salt: 128 bits of the HMAC, well under vLLM's 128-character limit
#: (``validate_cache_salt``) and free of the characters it forbids (``@ / \\`` and NUL).
SALT_HEX_CHARS = 32

# Random per process: salts cannot be precomputed from outside, and the engine they scope
# lives in this process (its prefix cache is gone when the process is).
_KEY = secrets.token_bytes(32)


def cache_salt(session: SessionRef | None, key: bytes | None = None) -> str:
    """The ``cache_salt`` of a request of ``session``.

    Args:
        session: The request's session; only its tenant matters (every session and agent
            of a tenant shares one salt, so they share prefix KV). ``None``: a fresh random
            salt (the request shares prefix KV with no other request).
        key: HMAC key (default: this process's random key); for tests.

    Returns:
        :data:`SALT_HEX_CHARS` lowercase hex characters.
    """
    if session is None:
        return secrets.token_hex(SALT_HEX_CHARS // 2)
    # The prefix separates this use of the key from any other; the tenant is validated
    # (check_id), so its UTF-8 bytes are unambiguous.
    digest = hmac.new(key or _KEY, b"agentspec-vllm-cache-salt\x00" + session.tenant.encode(),
                      hashlib.sha256)
    return digest.hexdigest()[:SALT_HEX_CHARS]


def engine_prompt(prompt_ids: Sequence[int], session: SessionRef | None) -> dict[str, Any]:
    """The prompt to hand ``LLMEngine.add_request``: token ids salted by the tenant.

    Args:
        prompt_ids: Rendered prompt token ids.
        session: The request's session (``None``: an unattributed one-off request).

    Returns:
        A vLLM ``TokensPrompt`` dict (``prompt_token_ids`` and ``cache_salt``).
    """
    return {"prompt_token_ids": list(prompt_ids), "cache_salt": cache_salt(session)}
