"""The one Markdown table writer of every report (the bench report, replay, the interleaved
run, the vLLM bench): cells padded to their column, so the table reads in a terminal too."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["markdown_table"]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``headers`` and ``rows`` (cells already formatted) as a Markdown table."""
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(row) for row in rows)])
