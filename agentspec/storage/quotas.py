"""Quota enforcement of the session store: who is evicted when a limit is reached.

Fairness rule: a tenant over its own quota (``max_sessions_per_tenant``,
``max_tokens_per_tenant``) loses its own least recently used sessions; when the whole
store is over ``max_sessions``, the victims come from the tenant holding the most sessions,
least recently used first. One busy tenant therefore evicts its own history, not every other
tenant's. The same rule bounds the store's bytes: past ``max_total_tokens`` (4 bytes each in
the file) the tenant holding the most tokens loses its least recently used sessions. Runs
inside the append's transaction, so an append and its evictions commit together or not at
all.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Protocol

__all__ = ["Quotas", "evict"]


class Quotas(Protocol):
    """The limits :func:`evict` enforces (:class:`agentspec.storage.sessions.StoreConfig`
    holds them; typed here so the quota rule does not import the store that calls it)."""

    @property
    def max_sessions(self) -> int: ...

    @property
    def max_sessions_per_tenant(self) -> int | None: ...

    @property
    def max_tokens_per_tenant(self) -> int | None: ...

    @property
    def max_total_tokens(self) -> int: ...

_LRU = "SELECT id, tokens FROM sessions WHERE tenant=? AND id != ? ORDER BY last_used, id"


def evict(
    conn: sqlite3.Connection,
    cfg: Quotas,
    keep: int,
    tenant: str,
    drop: Callable[[sqlite3.Connection, list[int]], None],
) -> int:
    """Enforce the quotas after an append to session row ``keep`` of ``tenant``.

    First the tenant's own quotas, then the store-wide ``max_sessions``. ``keep`` is never
    evicted.

    Args:
        conn: The connection, inside the append's write transaction.
        cfg: The store's limits.
        keep: Row id of the session just appended to.
        tenant: Its tenant.
        drop: Deletes sessions (and their turns) by row id.

    Returns:
        How many sessions were evicted.
    """
    victims: list[int] = []
    if cfg.max_sessions_per_tenant is not None or cfg.max_tokens_per_tenant is not None:
        count, tokens = conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(tokens), 0) FROM sessions WHERE tenant=?",
            (tenant,),
        ).fetchone()
        max_count = cfg.max_sessions_per_tenant or count
        max_tokens = cfg.max_tokens_per_tenant or tokens
        for sid, n in conn.execute(_LRU, (tenant, keep)).fetchall():
            if count <= max_count and tokens <= max_tokens:
                break
            victims.append(sid)
            count, tokens = count - 1, tokens - n
        drop(conn, victims)
    extra = conn.execute("SELECT COUNT(*) FROM sessions").fetchone()[0] - cfg.max_sessions
    while extra > 0:
        # The heaviest tenant pays for a full store; ties go to the one appending now.
        heavy = conn.execute(
            "SELECT tenant, COUNT(*) AS n FROM sessions GROUP BY tenant "
            "ORDER BY n DESC, tenant = ? DESC, tenant LIMIT 1", (tenant,)
        ).fetchone()
        rows = conn.execute(_LRU + " LIMIT ?", (heavy[0], keep, extra)).fetchall()
        if not rows:  # only ``keep`` is left in that tenant: fall back to the global LRU
            rows = conn.execute(
                "SELECT id, tokens FROM sessions WHERE id != ? ORDER BY last_used, id "
                "LIMIT ?", (keep, extra)).fetchall()
        if not rows:
            break
        drop(conn, [r[0] for r in rows])
        victims += [r[0] for r in rows]
        extra -= len(rows)
    victims += _evict_tokens(conn, cfg.max_total_tokens, keep, tenant, drop)
    return len(victims)


def _evict_tokens(
    conn: sqlite3.Connection,
    limit: int,
    keep: int,
    tenant: str,
    drop: Callable[[sqlite3.Connection, list[int]], None],
) -> list[int]:
    """Bring the whole store within ``limit`` tokens: the victims are the least recently
    used sessions of the tenant holding the most tokens (``keep`` is never evicted)."""
    total = conn.execute("SELECT COALESCE(SUM(tokens), 0) FROM sessions").fetchone()[0]
    victims: list[int] = []
    while total > limit:
        heavy = conn.execute(
            "SELECT tenant FROM sessions WHERE id != ? GROUP BY tenant "
            "ORDER BY SUM(tokens) DESC, tenant = ? DESC, tenant LIMIT 1", (keep, tenant)
        ).fetchone()
        if heavy is None:  # only ``keep`` is left (it alone fits max_tokens_per_session)
            break
        row = conn.execute(_LRU + " LIMIT 1", (heavy[0], keep)).fetchone()
        drop(conn, [row[0]])
        victims.append(row[0])
        total -= row[1]
    return victims
