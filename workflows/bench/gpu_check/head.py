"""Serving an EAGLE head file for the run, and putting back what it replaced.

``agentspec`` has no command-line flag for a head file; it looks first in
``$AGENTSPEC_HOME/drafters/<model>-eagle.safetensors``. :func:`swap_head` puts ``HEAD``
there for the length of a ``with`` block and restores the folder on the way out, whatever
ends the block: a return, a failed step, an exception, Ctrl-C or (with the check's SIGTERM
handler) a kill. A file that was there is kept beside it as ``<name>.gpu_check-backup`` and
moved back; a file that was not there is removed again; an identical file is left alone.
"""

from __future__ import annotations

import filecmp
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: Suffix of the replaced head file while the run uses another.
BACKUP_SUFFIX = ".gpu_check-backup"


def head_path(agentspec_home: Path, model: str) -> Path:
    """Where ``agentspec`` looks first for ``model``'s EAGLE head.

    Args:
        agentspec_home: ``$AGENTSPEC_HOME``.
        model: A shipped model name.

    Returns:
        ``<home>/drafters/<model>-eagle.safetensors``.
    """
    return agentspec_home / "drafters" / f"{model}-eagle.safetensors"


@contextmanager
def swap_head(head: Path, dest: Path) -> Iterator[Path]:
    """Serve ``head`` as ``dest`` inside the block; restore ``dest`` after it.

    Args:
        head: The head file to serve.
        dest: Where agentspec reads it (:func:`head_path`).

    Yields:
        ``dest``.

    Raises:
        FileNotFoundError: ``head`` is not a file (nothing is changed then).
    """
    if not head.is_file():
        raise FileNotFoundError(f"HEAD={head} is not a file")
    dest.parent.mkdir(parents=True, exist_ok=True)
    backup: Path | None = None
    created = False
    try:
        if not dest.is_file():
            created = True  # set first: a copy cut half-way is removed too
            shutil.copyfile(head, dest)
        elif not filecmp.cmp(head, dest, shallow=False):
            backup = dest.with_name(dest.name + BACKUP_SUFFIX)
            shutil.copy2(dest, backup)
            shutil.copyfile(head, dest)
        yield dest
    finally:
        if backup is not None and backup.is_file():
            backup.replace(dest)
        elif created:
            dest.unlink(missing_ok=True)
