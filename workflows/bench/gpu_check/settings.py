"""The GPU check's knobs: environment variables, read once into :class:`Settings`.

Every knob keeps the meaning and default it had as a shell variable: an unset or empty
variable takes the default (``${X:-default}``), except ``BF16_ARGS``, which only an unset
variable defaults (``${BF16_ARGS-"--limit 1"}``: set it empty for the full ``--quick``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: The model whose EAGLE head ``HEAD`` replaces when ``MODEL`` is not set.
DEFAULT_MODEL = "smollm2-135m-instruct"


class SettingError(ValueError):
    """A knob's value does not parse (a number that is not one)."""


def _text(env: Mapping[str, str], name: str, default: str) -> str:
    return env.get(name) or default


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name) or str(default)
    try:
        return int(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not a whole number") from None


@dataclass(frozen=True)
class Shares:
    """Per cent of the deadline each step may count on (before the slack of earlier steps).

    Attributes:
        fp32: ``bench-fp32``'s share (``PCT_FP32``).
        bf16: each of ``bench-bf16-a`` and ``bench-bf16-b``'s share (``PCT_BF16``).
        drive: ``drive``'s share (``PCT_DRIVE``).
        profile: ``profile``'s share (``PCT_PROFILE``).
    """

    fp32: int = 30
    bf16: int = 20
    drive: int = 20
    profile: int = 10


@dataclass(frozen=True)
class Settings:
    """What the check runs, where it writes, and how long it may take.

    Attributes:
        out_dir: The results folder (``OUT_DIR``).
        steps: Step names or groups to run, blank-separated (``STEPS``).
        dtypes: The bench's precisions, blank-separated (``DTYPES``).
        deadline_s: Seconds for everything, summary included (``DEADLINE_S``).
        device: ``cuda``, or ``cpu`` to run the flow without a GPU (``DEVICE``).
        py: The Python for the steps; empty: found (``PY``).
        model: A shipped model name; empty: the embedded one (``MODEL``).
        workloads: The bench's workloads (``WORKLOADS``).
        methods: The fp32 bench's methods (``METHODS``).
        bf16_methods: The bf16 benches' methods (``BF16_METHODS``).
        drive_methods: The drive's variants (``DRIVE_METHODS``).
        fallback_methods: A failed bench's retry methods (``FALLBACK_METHODS``).
        fallback_drive_methods: A failed drive's retry variants (``FALLBACK_DRIVE_METHODS``).
        extra_bench_args: Arguments added to every bench (``EXTRA_BENCH_ARGS``).
        bf16_args: Arguments added to the bf16 benches (``BF16_ARGS``).
        extra_drive_args: Arguments added to the drive (``EXTRA_DRIVE_ARGS``).
        head: An EAGLE head file served for the run; empty: none (``HEAD``).
        retry: Retry a failed bench or drive with the fallback methods (``RETRY`` = 1).
        min_step_s: A step with less time than this is skipped (``MIN_STEP_S``).
        reserve_s: Seconds kept for the summary (``RESERVE_S``).
        shares: The steps' per-cent shares of the deadline (``PCT_*``).
        keep: Keep the results of steps this run does not repeat (``KEEP`` = 1).
        venv: The venv used or built for a GPU torch (``GPU_VENV``).
        python: The interpreter that builds ``venv`` (``PYTHON``).
        torch_index_url: Where the venv's torch comes from (``TORCH_INDEX_URL``).
    """

    out_dir: Path = Path("results/gpu_check")
    steps: str = "bench drive profile"
    dtypes: str = "float32 bfloat16"
    deadline_s: int = 480
    device: str = "cuda"
    py: str = ""
    model: str = ""
    workloads: str = "delegate52,tool_agent,chat"
    methods: str = "greedy,prompt_lookup,suffix,hybrid,asd_b1"
    bf16_methods: str = "greedy,prompt_lookup,suffix,hybrid,asd_b1"
    drive_methods: str = "plain,suffix,hybrid,ceiling"
    fallback_methods: str = "greedy,prompt_lookup,suffix"
    fallback_drive_methods: str = "plain,suffix,ceiling"
    extra_bench_args: tuple[str, ...] = ()
    bf16_args: tuple[str, ...] = ("--limit", "1")
    extra_drive_args: tuple[str, ...] = ()
    head: str = ""
    retry: bool = True
    min_step_s: int = 20
    reserve_s: int = 15
    shares: Shares = Shares()
    keep: bool = False
    venv: str = ".venv-gpu"
    python: str = ""
    torch_index_url: str = ""

    @property
    def head_model(self) -> str:
        """The model whose drafter file ``HEAD`` stands in for."""
        return self.model or DEFAULT_MODEL

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """Read the knobs from ``env`` (``os.environ`` in the check).

        Args:
            env: Environment variables.

        Returns:
            The settings, defaults where a variable is unset or empty.

        Raises:
            SettingError: A numeric knob is not a whole number.
        """
        d = cls()
        methods = _text(env, "METHODS", d.methods)
        return cls(
            out_dir=Path(_text(env, "OUT_DIR", str(d.out_dir))),
            steps=_text(env, "STEPS", d.steps),
            dtypes=_text(env, "DTYPES", d.dtypes),
            deadline_s=_int(env, "DEADLINE_S", d.deadline_s),
            device=_text(env, "DEVICE", d.device),
            py=env.get("PY", ""),
            model=env.get("MODEL", ""),
            workloads=_text(env, "WORKLOADS", d.workloads),
            methods=methods,
            bf16_methods=_text(env, "BF16_METHODS", methods),
            drive_methods=_text(env, "DRIVE_METHODS", d.drive_methods),
            fallback_methods=_text(env, "FALLBACK_METHODS", d.fallback_methods),
            fallback_drive_methods=_text(env, "FALLBACK_DRIVE_METHODS",
                                         d.fallback_drive_methods),
            extra_bench_args=tuple(env.get("EXTRA_BENCH_ARGS", "").split()),
            bf16_args=tuple(env.get("BF16_ARGS", " ".join(d.bf16_args)).split()),
            extra_drive_args=tuple(env.get("EXTRA_DRIVE_ARGS", "").split()),
            head=env.get("HEAD", ""),
            retry=_text(env, "RETRY", "1") == "1",
            min_step_s=_int(env, "MIN_STEP_S", d.min_step_s),
            reserve_s=_int(env, "RESERVE_S", d.reserve_s),
            shares=Shares(fp32=_int(env, "PCT_FP32", d.shares.fp32),
                          bf16=_int(env, "PCT_BF16", d.shares.bf16),
                          drive=_int(env, "PCT_DRIVE", d.shares.drive),
                          profile=_int(env, "PCT_PROFILE", d.shares.profile)),
            keep=env.get("KEEP", "0") == "1",
            venv=_text(env, "GPU_VENV", d.venv),
            python=env.get("PYTHON", ""),
            torch_index_url=env.get("TORCH_INDEX_URL", ""),
        )
