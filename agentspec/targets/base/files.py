"""Small JSON files written atomically: the measured cost curves and the probe results.

A reader never sees half a file (a temporary file renamed over the old one), and a missing
or corrupt file reads as empty, so what it held is measured again rather than raising.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["read_json", "write_json"]


def read_json(path: Path) -> dict[str, Any]:
    """The file's JSON object (empty when absent, unreadable or not an object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON atomically; two writers write two temporary files and the
    last rename wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{id(data)}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
