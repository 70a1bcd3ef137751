"""Where workload data lives and how it is read.

The data folder is chosen as: an explicit ``--data DIR`` > the ``AGENTSPEC_DATA``
environment variable > the small fixture packaged in ``workflows/data``. Every folder has
the same three files (``delegate52_domains.jsonl``, ``delegate52_prompt_template.txt``,
``editeval.jsonl``), so the full public data in ``../shared/data`` and the fixture are
interchangeable.

Loaders fail with a :class:`~agentspec.errors.BenchmarkError` that names the file and the
line, because a benchmark that silently skips a malformed row reports numbers for a
different workload than the one asked for.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentspec.errors import BenchmarkError

DATA_ENV = "AGENTSPEC_DATA"
FIXTURE_DIR = Path(__file__).resolve().parents[1] / "data"

DELEGATE52_FILE = "delegate52_domains.jsonl"
TEMPLATE_FILE = "delegate52_prompt_template.txt"
EDITEVAL_FILE = "editeval.jsonl"
TEMPLATE_PLACEHOLDERS = ("[[INPUT_CONTEXT]]", "[[FILE_NAMES]]", "[[EDITING_OPERATION]]")

_DOMAIN_FIELDS = ("domain", "seed_file", "seed_excerpt", "edits")
_EDIT_FIELDS = ("name", "forward", "backward")
_EDITEVAL_FIELDS = ("task_id", "instruction", "input", "output", "test")


@dataclass(frozen=True)
class EditPair:
    """One reversible DELEGATE-52 edit: ``forward`` transforms, ``backward`` restores.

    Attributes:
        name: Short name of the edit (e.g. ``"CSV Conversion"``).
        forward: Instruction that transforms the document.
        backward: Instruction that restores the original document.
        operations: The benchmark's tags for the skills involved.
    """

    name: str
    forward: str
    backward: str
    operations: str = ""


@dataclass(frozen=True)
class Domain:
    """One DELEGATE-52 domain: a seed document plus its reversible edits.

    Attributes:
        domain: Short id (e.g. ``"accounting"``).
        title: Human-readable name.
        file_format: The benchmark's description of the format (e.g. ``"`.ledger`"``).
        seed_file: File name of the seed document.
        seed_excerpt: Text of the seed document (an excerpt).
        seed_source: Where the seed comes from, with its license.
        edits: The reversible edit pairs, in relay order.
    """

    domain: str
    title: str
    file_format: str
    seed_file: str
    seed_excerpt: str
    seed_source: str
    edits: tuple[EditPair, ...]


@dataclass(frozen=True)
class EditTask:
    """One EditEval instruction-driven code edit.

    Attributes:
        task_id: Id in the source data (e.g. ``"EditEval/0"``).
        instruction: What to change.
        input: The code to edit.
        output: A reference solution.
        test: Source of a ``check()`` function that asserts on the edited code.
        context: Program template with ``{{Code}}`` placeholders (may be empty).
    """

    task_id: str
    instruction: str
    input: str
    output: str
    test: str
    context: str = ""


def data_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Resolve the workload data folder.

    Args:
        explicit: A folder given on the command line (``--data DIR``); wins when set.

    Returns:
        ``explicit`` if given, else ``$AGENTSPEC_DATA`` if set, else the packaged fixture.

    Raises:
        BenchmarkError: The chosen folder does not exist.
    """
    if explicit:
        path, origin = Path(explicit), "--data"
    elif os.environ.get(DATA_ENV):
        path, origin = Path(os.environ[DATA_ENV]), f"${DATA_ENV}"
    else:
        path, origin = FIXTURE_DIR, "the packaged fixture"
    if not path.is_dir():
        raise BenchmarkError(f"data folder {path} (from {origin}) does not exist")
    return path


def read_jsonl(path: Path, required: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Read a JSON-lines file whose rows are objects with the ``required`` keys.

    Args:
        path: The file.
        required: Keys every row must have.

    Returns:
        The rows in file order (blank lines skipped).

    Raises:
        BenchmarkError: The file is missing, a line is not a JSON object, or a key is absent.
    """
    text = _read_text(path)
    rows: list[dict[str, Any]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchmarkError(f"{path}:{lineno}: malformed JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise BenchmarkError(f"{path}:{lineno}: expected a JSON object per line")
        missing = [key for key in required if key not in row]
        if missing:
            raise BenchmarkError(f"{path}:{lineno}: missing field(s) {', '.join(missing)}")
        row["_line"] = lineno  # kept so later checks can still point at the line
        rows.append(row)
    if not rows:
        raise BenchmarkError(f"{path}: no rows")
    return rows


def load_delegate52(folder: Path) -> list[Domain]:
    """Load the DELEGATE-52 domains of a data folder.

    Args:
        folder: A data folder (see :func:`data_dir`).

    Returns:
        The domains in file order.

    Raises:
        BenchmarkError: The file is missing or a row / edit is malformed.
    """
    path = folder / DELEGATE52_FILE
    domains = []
    for row in read_jsonl(path, _DOMAIN_FIELDS):
        where = f"{path}:{row['_line']}"
        if not isinstance(row["edits"], list) or not row["edits"]:
            raise BenchmarkError(f"{where}: 'edits' must be a non-empty list")
        if not isinstance(row["seed_excerpt"], str) or not row["seed_excerpt"].strip():
            raise BenchmarkError(f"{where}: 'seed_excerpt' must be non-empty text")
        edits = []
        for i, edit in enumerate(row["edits"]):
            if not isinstance(edit, dict) or any(k not in edit for k in _EDIT_FIELDS):
                raise BenchmarkError(f"{where}: edit {i} needs fields {', '.join(_EDIT_FIELDS)}")
            ops = edit.get("operations", "")
            edits.append(EditPair(edit["name"], edit["forward"], edit["backward"], ops))
        domains.append(
            Domain(
                domain=str(row["domain"]),
                title=str(row.get("title", row["domain"])),
                file_format=str(row.get("file_format", "")),
                seed_file=str(row["seed_file"]),
                seed_excerpt=row["seed_excerpt"],
                seed_source=str(row.get("seed_source", "")),
                edits=tuple(edits),
            )
        )
    return domains


def load_prompt_template(folder: Path) -> str:
    """Load the DELEGATE-52 document-editing prompt template.

    Args:
        folder: A data folder (see :func:`data_dir`).

    Returns:
        The template text with its ``[[...]]`` placeholders.

    Raises:
        BenchmarkError: The file is missing or lacks a placeholder.
    """
    path = folder / TEMPLATE_FILE
    template = _read_text(path)
    missing = [p for p in TEMPLATE_PLACEHOLDERS if p not in template]
    if missing:
        raise BenchmarkError(f"{path}: template lacks placeholder(s) {', '.join(missing)}")
    return template


def load_editeval(folder: Path) -> list[EditTask]:
    """Load the EditEval rows of a data folder.

    Args:
        folder: A data folder (see :func:`data_dir`).

    Returns:
        The tasks in file order.

    Raises:
        BenchmarkError: The file is missing or a row is malformed.
    """
    path = folder / EDITEVAL_FILE
    tasks = []
    for row in read_jsonl(path, _EDITEVAL_FIELDS):
        if "def check(" not in str(row["test"]):
            raise BenchmarkError(f"{path}:{row['_line']}: 'test' must define check()")
        tasks.append(
            EditTask(
                task_id=str(row["task_id"]),
                instruction=str(row["instruction"]),
                input=str(row["input"]),
                output=str(row["output"]),
                test=str(row["test"]),
                context=str(row.get("context") or ""),
            )
        )
    return tasks


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise BenchmarkError(
            f"{path} not found: pass --data DIR or set ${DATA_ENV} to a folder holding "
            f"{DELEGATE52_FILE}, {TEMPLATE_FILE} and {EDITEVAL_FILE}"
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchmarkError(f"{path}: cannot read ({exc})") from exc
