"""The step plan and its deadline arithmetic.

Each planned step has a cap: its per-cent share of the deadline. When it starts, a step may
run for whatever is left before the deadline, less the summary's reserve and the caps of the
steps after it; never less than its own cap while that much is left. So a step inherits
the time the earlier steps did not use, and a step that overran its cap (a slow machine)
eats its own successors' slack before their caps. All times are whole seconds, counted
from the check's start.
"""

from __future__ import annotations

from dataclasses import dataclass

from workflows.bench.gpu_check.settings import Shares

#: ``DTYPES`` spellings and the steps each plans.
DTYPE_STEPS: dict[str, tuple[str, ...]] = {
    "float32": ("bench-fp32",), "fp32": ("bench-fp32",),
    "bfloat16": ("bench-bf16-a", "bench-bf16-b"), "bf16": ("bench-bf16-a", "bench-bf16-b"),
}


def wanted(step: str, selection: str) -> bool:
    """Whether ``STEPS`` selects ``step``: by its name or its group (``bench``, ``drive``).

    Args:
        step: A step name such as ``bench-bf16-a``.
        selection: ``STEPS``: names or groups, blank-separated.

    Returns:
        True when a token is the step's name or the part before its first ``-``.
    """
    group = step.split("-", 1)[0]
    return any(tok in (step, group) for tok in selection.split())


@dataclass(frozen=True)
class PlannedStep:
    """One step of the plan.

    Attributes:
        name: The step (``bench-fp32``, ``bench-bf16-a``, ``bench-bf16-b``, ``drive``,
            ``profile``).
        cap_s: Its share of the deadline in seconds.
    """

    name: str
    cap_s: int


@dataclass(frozen=True)
class Plan:
    """The steps in order, and the time they share.

    Attributes:
        steps: The planned steps.
        deadline_s: Seconds from the check's start for everything.
        reserve_s: Seconds kept after the last step for the summary.
    """

    steps: tuple[PlannedStep, ...]
    deadline_s: int
    reserve_s: int

    @property
    def names(self) -> list[str]:
        """The steps' names in order."""
        return [s.name for s in self.steps]

    def _later_s(self, index: int) -> int:
        return sum(s.cap_s for s in self.steps[index + 1:])

    def limit_for(self, index: int, elapsed_s: int) -> int:
        """Seconds step ``index`` may run: its cap plus the slack left by earlier steps.

        Args:
            index: The step's position in :attr:`steps`.
            elapsed_s: Seconds since the check started.

        Returns:
            What is left before the deadline, less the reserve and the later steps' caps;
            but at least the step's cap while that much is left (then at most what is left).
            Zero or less when the deadline has passed.
        """
        left = self.deadline_s - elapsed_s - self.reserve_s
        limit = left - self._later_s(index)
        if limit < self.steps[index].cap_s:
            limit = min(self.steps[index].cap_s, left)
        return limit

    def slack_for(self, index: int, elapsed_s: int) -> int:
        """Seconds a retry after step ``index`` may run without eating a later step's cap.

        Args:
            index: The failed step's position in :attr:`steps`.
            elapsed_s: Seconds since the check started.

        Returns:
            What is left before the deadline, less the reserve and the later steps' caps.
        """
        return self.deadline_s - elapsed_s - self.reserve_s - self._later_s(index)


def make_plan(selection: str, dtypes: str, deadline_s: int, reserve_s: int,
              shares: Shares) -> Plan:
    """The steps ``STEPS`` and ``DTYPES`` select, in the order they run.

    Benches come in ``DTYPES``'s order, then ``drive``, then ``profile``.

    Args:
        selection: ``STEPS``: step names or groups, blank-separated.
        dtypes: ``DTYPES``: ``float32`` / ``fp32`` and ``bfloat16`` / ``bf16``.
        deadline_s: The deadline in seconds (the venv build's time included).
        reserve_s: Seconds kept for the summary.
        shares: Each step's per-cent share of the deadline.

    Returns:
        The plan; it may hold no step.

    Raises:
        ValueError: ``dtypes`` names an unknown precision.
    """
    pct = {"bench-fp32": shares.fp32, "bench-bf16-a": shares.bf16,
           "bench-bf16-b": shares.bf16, "drive": shares.drive, "profile": shares.profile}
    names: list[str] = []
    for dtype in dtypes.split():
        if dtype not in DTYPE_STEPS:
            raise ValueError(f"unknown dtype in DTYPES: {dtype} (float32, bfloat16)")
        names += DTYPE_STEPS[dtype]
    names += ["drive", "profile"]
    steps = tuple(PlannedStep(n, deadline_s * pct[n] // 100)
                  for n in names if wanted(n, selection))
    return Plan(steps=steps, deadline_s=deadline_s, reserve_s=reserve_s)
