"""Interleaved A/B timing of lossless drafters on the DELEGATE-52 relay alone.

``python -m workflows.bench.ab_relay --methods suffix,arctic_suffix --limit 5 --turns 4``

A shorthand for :mod:`workflows.bench.interleaved` with a relay-only mix: every turn is decoded
by each method back to back (rotating order), outputs are checked identical, and the ratio
of summed engine times is the drift-free speed ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workflows.bench.interleaved import Part, emit, run


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(prog="python -m workflows.bench.ab_relay",
                                description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="suffix,arctic_suffix",
                   help="comma-separated lossless methods (default suffix,arctic_suffix)")
    p.add_argument("--limit", type=int, default=5, help="relay domains (default 5)")
    p.add_argument("--turns", type=int, default=4, help="turns per relay (default 4)")
    p.add_argument("--max-draft", type=int, default=32, help="longest draft (default 32)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = p.parse_args(argv)
    emit(run(args.methods.split(","), [Part("delegate52", args.limit, args.turns)],
             args.max_draft), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
