"""The oracle drafter, for benchmarks only: it drafts the known greedy reference.

Given the target's own greedy output for a request, it proposes the next reference tokens
while the generated prefix still matches the reference. Its speed is the ceiling any
drafter can reach with the same target, draft length and verification.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentspec.types import Draft, DraftContext, VerifyResult


class OracleDrafter:
    """Drafts the reference continuation of each prompt.

    Args:
        references: Map from a prompt (as a tuple of ids) to its greedy output ids.
    """

    name = "oracle"

    def __init__(self, references: dict[tuple[int, ...], Sequence[int]] | None = None) -> None:
        self.references: dict[tuple[int, ...], list[int]] = {
            k: list(v) for k, v in (references or {}).items()
        }

    def add(self, prompt: Sequence[int], reference: Sequence[int]) -> None:
        """Register the greedy output ``reference`` of ``prompt``."""
        self.references[tuple(prompt)] = list(reference)

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """The next ``max_tokens`` reference tokens, or nothing once output diverged."""
        ref = self.references.get(tuple(ctx.tokens[: ctx.prompt_len]))
        if ref is None:
            return Draft(source=self.name)
        gen = ctx.generated
        pos = len(gen)
        if list(gen) != ref[:pos]:
            return Draft(source=self.name)
        toks = ref[pos : pos + max_tokens]
        return Draft(tokens=toks, score=float(len(toks)), source=self.name)

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Stateless: the reference is fixed."""

    def finish(self, ctx: DraftContext) -> None:
        """Stateless: nothing to remember."""
