"""``agentspec sessions``: the operators' view of the persistent session store.

Sub-commands: ``list``, ``show``, ``delete``, ``export``, ``stats`` and ``backup`` (a
consistent copy of the live store through SQLite's online backup API, safe while a server
writes to it). A session is named
by one argument, ``TENANT/AGENT/SESSION`` (ids never contain ``/``), or just ``SESSION``
for the ``default`` tenant and agent. Every failure prints one line to stderr and exits
with status 2. Wire it into a top-level parser with :func:`add_sessions_parser`, or run it
standalone: ``python -m agentspec.cli.sessions list --json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path

from agentspec.errors import AgentSpecError, ConfigError, StoreError
from agentspec.storage.sessions import STORE_FILE, SessionStore, StoreConfig
from agentspec.types import SessionRef

REF_HELP = (
    "the session: TENANT/AGENT/SESSION, or just SESSION for tenant and agent 'default'"
)
_EPILOG = (
    "Sessions are named TENANT/AGENT/SESSION (or SESSION alone for the default tenant and "
    f"agent). The store is $AGENTSPEC_HOME/{STORE_FILE} (~/.cache/agentspec by default) "
    "unless --store is given. Errors print one line to stderr and exit with status 2."
)


def parse_ref(text: str) -> SessionRef:
    """Parse ``TENANT/AGENT/SESSION`` or ``SESSION`` into a :class:`SessionRef`.

    Raises:
        ConfigError: Two parts, more than three, or an invalid id.
    """
    parts = text.split("/")
    if len(parts) == 1:
        return SessionRef(parts[0])
    if len(parts) == 3:
        return SessionRef(parts[2], tenant=parts[0], agent=parts[1])
    raise ConfigError(f"session {text!r}: write TENANT/AGENT/SESSION, or SESSION alone")


def add_sessions_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``sessions`` and its sub-commands on a top-level parser's sub-parsers.

    The parser's default ``func`` is :func:`run_sessions`.

    Args:
        subparsers: What ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        The ``sessions`` parser.
    """
    # --store/--recover work before or after the sub-command; SUPPRESS keeps a sub-command's
    # missing option from overwriting the value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", metavar="PATH", default=argparse.SUPPRESS,
                        help=f"session store file (default: $AGENTSPEC_HOME/{STORE_FILE})")
    common.add_argument("--recover", action="store_true", default=argparse.SUPPRESS,
                        help="if the store file is corrupt, move it to PATH.corrupt-<timestamp> "
                        "and start an empty store instead of failing")
    parser = subparsers.add_parser(
        "sessions", parents=[common], help="inspect and manage the persistent session store",
        description="Inspect and manage the persistent session store.", epilog=_EPILOG,
    )
    # No set_defaults(store=...): the parent's actions are shared with every sub-parser.
    parser.set_defaults(func=run_sessions)
    sub = parser.add_subparsers(dest="sessions_command", metavar="COMMAND")

    ls = sub.add_parser("list", parents=[common], help="list sessions", epilog=_EPILOG)
    ls.add_argument("--tenant", help="only this tenant's sessions")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    show = sub.add_parser("show", parents=[common], help="one session's summary", epilog=_EPILOG)
    show.add_argument("ref", metavar="REF", help=REF_HELP)
    show.add_argument("--json", action="store_true", help="print JSON")
    delete = sub.add_parser("delete", parents=[common], help="delete a session", epilog=_EPILOG)
    delete.add_argument("ref", metavar="REF", help=REF_HELP)
    export = sub.add_parser(
        "export", parents=[common], help="a session's turns as JSON", epilog=_EPILOG
    )
    export.add_argument("ref", metavar="REF", help=REF_HELP)
    export.add_argument("--out", metavar="FILE", help="write to FILE instead of stdout")
    stats = sub.add_parser("stats", parents=[common], help="store totals", epilog=_EPILOG)
    stats.add_argument("--json", action="store_true", help="print JSON")
    backup = sub.add_parser(
        "backup", parents=[common], epilog=_EPILOG,
        help="copy the live store to a new file (SQLite online backup; safe while serving)",
    )
    backup.add_argument("dest", metavar="FILE", help="the new file (must not exist)")
    return parser


def _time(ts: float) -> str:
    return datetime.fromtimestamp(ts).isoformat(sep=" ", timespec="seconds")


def _open(args: argparse.Namespace) -> SessionStore:
    store_arg = getattr(args, "store", None)
    path = Path(store_arg).expanduser() if store_arg else None
    # An explicit path that does not exist is most likely a typo: say so instead of
    # silently creating an empty store there. The default store is created on first use.
    if path is not None and not path.exists():
        raise StoreError(f"no session store at {path}")
    store = SessionStore(path, StoreConfig(recover=getattr(args, "recover", False)))
    if store.recovered:
        print(f"agentspec sessions: warning: {store.path} was corrupt; moved it to "
              f"{store.recovered_to} and started an empty store", file=sys.stderr)
    return store


def _list(store: SessionStore, args: argparse.Namespace) -> int:
    sessions = store.list_sessions(args.tenant)
    if args.json:
        print(json.dumps([s.to_dict() for s in sessions], indent=2))
        return 0
    if not sessions:
        print(f"no sessions in {store.path}")
        return 0
    rows = [("SESSION", "TURNS", "TOKENS", "LAST USED")]
    rows += [(f"{s.tenant}/{s.agent}/{s.session_id}", str(s.turns), str(s.tokens),
              _time(s.last_used)) for s in sessions]
    width = max(len(r[0]) for r in rows)
    for name, turns, tokens, used in rows:
        print(f"{name:<{width}}  {turns:>7}  {tokens:>10}  {used}")
    return 0


def _show(store: SessionStore, args: argparse.Namespace) -> int:
    info = store.info(parse_ref(args.ref))
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return 0
    print(f"session    {info.tenant}/{info.agent}/{info.session_id}")
    print(f"turns      {info.turns}")
    print(f"tokens     {info.tokens}")
    print(f"created    {_time(info.created)}")
    print(f"last used  {_time(info.last_used)}")
    return 0


def _delete(store: SessionStore, args: argparse.Namespace) -> int:
    ref = parse_ref(args.ref)
    store.delete(ref)
    print(f"deleted {ref.tenant}/{ref.agent}/{ref.session_id}")
    return 0


def _export(store: SessionStore, args: argparse.Namespace) -> int:
    data = store.export(parse_ref(args.ref))
    text = json.dumps(data)
    if not args.out:
        print(text)
        return 0
    out = Path(args.out).expanduser()
    # Write beside the target and rename, so a failed export never leaves half a file.
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    print(f"wrote {len(data['turns'])} turns ({data['tokens']} tokens) to {out}", file=sys.stderr)
    return 0


def _stats(store: SessionStore, args: argparse.Namespace) -> int:
    stats = store.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        for name, value in stats.items():
            print(f"{name:<24}{value}")
    return 0


def _backup(store: SessionStore, args: argparse.Namespace) -> int:
    out = store.backup(args.dest)
    with SessionStore(out, StoreConfig(verify_on_open=True)) as copy:  # it opens on its own
        stats = copy.stats()
    print(f"backed up {stats['sessions']} sessions ({stats['turns']} turns, "
          f"{stats['tokens']} tokens) to {out}", file=sys.stderr)
    return 0


_COMMANDS: dict[str, Callable[[SessionStore, argparse.Namespace], int]] = {
    "list": _list, "show": _show, "delete": _delete, "export": _export, "stats": _stats,
    "backup": _backup,
}


def run_sessions(args: argparse.Namespace) -> int:
    """Run the ``sessions`` sub-command parsed into ``args``.

    Returns:
        0 on success, 2 on any error (one line on stderr, no traceback).
    """
    command = getattr(args, "sessions_command", None)
    if command not in _COMMANDS:
        print(f"agentspec sessions: choose a command: {', '.join(_COMMANDS)}", file=sys.stderr)
        return 2
    try:
        with _open(args) as store:
            return _COMMANDS[command](store, args)
    except (AgentSpecError, OSError) as exc:
        # One line, even when SQLite's integrity report spans several.
        print(f"agentspec sessions {command}: error: {' '.join(str(exc).split())}",
              file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m agentspec.cli.sessions COMMAND ...``."""
    parser = argparse.ArgumentParser(prog="agentspec")
    add_sessions_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sessions", *(sys.argv[1:] if argv is None else argv)])
    return run_sessions(args)


if __name__ == "__main__":
    sys.exit(main())
