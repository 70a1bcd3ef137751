"""The report and the log of one self-distillation run (:func:`~.recipe.run_recipe`).

A GPU run is one shot, so its report must survive whatever happens: :class:`RecipeReport`
writes it (atomically) after every phase, records a phase that raises under ``errors``
(with its traceback) instead of ending the run, times the phases under ``phases_s`` and
decides the final ``status``. Its log lines carry the seconds since the run began.
"""

from __future__ import annotations

import contextlib
import json
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["RecipeReport"]


class RecipeReport:
    """The run's report (a JSON-ready dict) with its file, clock and log.

    Args:
        report: The dict to fill in (``phases_s`` and ``errors`` are added if missing).
        path: Where the report is written after every phase, if anywhere.
        start: ``time.monotonic()`` when the run began (loading included).
        log: Progress lines.
    """

    def __init__(self, report: dict[str, Any], path: Path | None, start: float,
                 log: Callable[[str], None]) -> None:
        self.report = report
        self.path = path
        self.start = start
        self.log = log
        self.phases: dict[str, float] = report.setdefault("phases_s", {})
        self.errors: list[dict[str, str]] = report.setdefault("errors", [])

    def say(self, line: str) -> None:
        """Log ``line`` after the seconds since the start."""
        self.log(f"[{time.monotonic() - self.start:6.1f}s] {line}")

    def save(self) -> None:
        """Write the report (with the elapsed time); a failure to write is only logged."""
        self.report["elapsed_s"] = round(time.monotonic() - self.start, 1)
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.report, indent=2, default=str))
            tmp.replace(self.path)
        except OSError as exc:  # the report must never end the run
            self.say(f"report: cannot write {self.path}: {exc}")

    def failed(self, phase: str, exc: BaseException) -> None:
        """Record that ``phase`` raised ``exc`` (call inside ``except``) and save."""
        tb = traceback.format_exc(limit=6)
        self.errors.append({"phase": phase, "error": f"{type(exc).__name__}: {exc}",
                            "traceback": tb[-3000:]})
        self.say(f"{phase}: FAILED: {type(exc).__name__}: {exc}")
        self.save()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as ``phases_s[name + "_s"]``; an error is recorded
        (:meth:`failed`) and the run goes on with what exists."""
        t0 = time.monotonic()
        try:
            yield
        except Exception as exc:
            self.failed(name, exc)
        finally:
            self.phases[f"{name}_s"] = round(time.monotonic() - t0, 1)

    def finish(self) -> dict[str, Any]:
        """Set ``status`` (``ok``, ``partial`` or ``failed``) and the total time, save.

        Returns:
            The report.
        """
        written = self.report["head"]["written"]
        self.report["status"] = ("ok" if not self.errors and written
                                 else "partial" if written else "failed")
        self.phases["total_s"] = round(time.monotonic() - self.start, 1)
        self.save()
        return self.report
