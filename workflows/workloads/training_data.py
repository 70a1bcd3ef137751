"""The workloads as training data: sessions to trace, documents to teacher-force, prompts to
leave out.

agentspec's training code (:mod:`agentspec.training.payoff_traces`,
:mod:`agentspec.cli.train_predictor`, :mod:`agentspec.training.corpus`,
:mod:`agentspec.cli.train_drafter`) never imports the benchmark harness: the dependency
points from ``workflows`` to ``agentspec``. The ``agentspec`` console script (its one
composition root, :mod:`agentspec.cli.console`) hands the objects below to the training
commands instead:

* :data:`WORKLOAD_SESSIONS` (a :class:`~agentspec.training.payoff_traces.SessionSource`): which
  sessions ``train-predictor`` traces, and which ones ``make bench`` measures;
* :data:`WORKLOAD_DOCUMENTS` (a :class:`~agentspec.cli.train_drafter.DrafterData`): the
  data folder, the documents ``train-drafter`` scores and the benchmark's chat prompts it
  must not train on.
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentspec.errors import TrainingDataError
from agentspec.training.payoff_traces import TraceSpec
from workflows.workloads.datasets import data_dir, load_delegate52, load_editeval
from workflows.workloads.open_chat import PROMPTS
from workflows.workloads.registry import load_workload

__all__ = [
    "WORKLOAD_DOCUMENTS",
    "WORKLOAD_SESSIONS",
    "WorkloadDocuments",
    "WorkloadSessions",
    "bench_session_ids",
    "document_pairs",
    "select_sessions",
]


def select_sessions(spec: TraceSpec) -> list[list[tuple[str, Any]]]:
    """Per workload, the first ``spec.limit`` sessions whose ids are not excluded."""
    excluded = set(spec.exclude)
    # num_sessions: the tool agent makes 6 sessions unless asked for more (at most 16).
    return [[(w, s) for s in itertools.islice(
        (s for s in load_workload(w, spec.data_dir, num_sessions=16).sessions(None, spec.turns)
         if s.session_id not in excluded), spec.limit)]
        for w in spec.workloads]


def bench_session_ids(workloads: Sequence[str], first: int = 5) -> tuple[str, ...]:
    """Ids of the first ``first`` sessions of each workload in the packaged fixture: the
    sessions ``make bench`` measures (it reads the fixture; 5 relays and EditEval tasks,
    3 tool-agent sessions and chats)."""
    return tuple(s.session_id for w in workloads
                 for s in load_workload(w, None, num_sessions=16).sessions(first, 1))


def document_pairs(folder: Any, seed: int = 0) -> list[tuple[str, str]]:
    """(user message, assistant text) pairs from the workload data in ``folder``.

    DELEGATE-52: an edit instruction plus the seed excerpt, answered by the excerpt itself
    (relays re-emit documents). EditEval: the instruction plus the code, answered by the
    reference solution.

    Raises:
        TrainingDataError: the folder yields no document.
    """
    pairs: list[tuple[str, str]] = []
    for dom in load_delegate52(folder):
        edit = dom.edits[0].backward if dom.edits else "Rewrite the document."
        pairs.append((f"{edit}\n\n{dom.seed_excerpt}", dom.seed_excerpt))
    for task in load_editeval(folder):
        pairs.append((f"{task.instruction}\n\n{task.input}", task.output))
    pairs = [(u, a) for u, a in pairs if a.strip()]
    if not pairs:
        raise TrainingDataError(f"the data folder {folder} holds no documents to train on")
    random.Random(seed).shuffle(pairs)
    return pairs


class WorkloadSessions:
    """The workloads' sessions as a :class:`~agentspec.training.payoff_traces.SessionSource`."""

    def select(self, spec: TraceSpec) -> list[list[tuple[str, Any]]]:
        """See :func:`select_sessions`."""
        return select_sessions(spec)

    def bench_ids(self, workloads: Sequence[str]) -> tuple[str, ...]:
        """See :func:`bench_session_ids`."""
        return bench_session_ids(workloads)


class WorkloadDocuments:
    """The workload data as a :class:`~agentspec.cli.train_drafter.DrafterData`."""

    def folder(self, explicit: str | os.PathLike[str] | None) -> Path:
        """The data folder (``--data``, ``$AGENTSPEC_DATA`` or the packaged fixture)."""
        return data_dir(explicit)

    def documents(self, folder: Path, seed: int) -> list[tuple[str, str]]:
        """See :func:`document_pairs`."""
        return document_pairs(folder, seed)

    def held_out_prompts(self) -> list[str]:
        """The open-chat benchmark's prompts: the drafter never trains on them."""
        return [q for session in PROMPTS for q in session]


WORKLOAD_SESSIONS = WorkloadSessions()
WORKLOAD_DOCUMENTS = WorkloadDocuments()
