"""Argument types shared by every command line (``agentspec`` and its sub-commands, the
server's ``serve``, the workflows' scripts): argparse reports their errors as usage errors."""

from __future__ import annotations

import argparse

__all__ = ["DEVICES", "DTYPES", "add_device_arg", "add_dtype_arg", "csv_list",
           "non_negative_int", "positive_int"]

#: What ``--device`` takes (``TargetConfig.device``).
DEVICES = ("auto", "cpu", "cuda")
#: What ``--dtype`` takes (``TargetConfig.dtype``; not imported from it: ``--help`` should
#: not load torch).
DTYPES = ("float32", "bfloat16", "int8", "w8a8", "w8a16", "auto")


def add_device_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--device auto|cpu|cuda`` (default ``auto``) to a command that loads a model;
    ``cuda`` on a machine without CUDA fails with
    :class:`~agentspec.errors.DeviceUnavailableError` when the model loads."""
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="where the model runs: auto (CUDA when available, else the "
                             "CPU; default), cpu or cuda (an error without CUDA)")


def add_dtype_arg(parser: argparse.ArgumentParser, default: str = "auto") -> None:
    """Add ``--dtype auto|float32|bfloat16|int8|w8a8|w8a16`` to a command that loads a model
    (default ``auto``; see :attr:`~agentspec.targets.target_config.TargetConfig.dtype`)."""
    parser.add_argument("--dtype", choices=DTYPES, default=default,
                        help="the model's precision: auto (w8a16 on a CPU whose torch has "
                             "the int8 product, AVX-512 or AVX2 alike, else float32, as on a "
                             "GPU), float32 (the reference), bfloat16, "
                             "int8 (int8 weight-only layers over bf16 activations, CPU only, "
                             "fewest bytes per step), w8a8 (int8 weights and int8 "
                             "activations summed in int32, CPU only: multi-row verifies cost "
                             "little more than one row; answers drift further from float32's) "
                             "or w8a16 (int8 weights, activations as two int8 digits, CPU "
                             "only: w8a8's cheap verifies at int8's closeness to float32); "
                             "each exact against plain decoding in the same "
                             f"precision (docs/cpu_step.md; default {default})")


def csv_list(value: str) -> list[str]:
    """A non-empty comma-separated list (blank items dropped)."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def positive_int(value: str) -> int:
    """An integer >= 1."""
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def non_negative_int(value: str) -> int:
    """An integer >= 0 (0 usually switches something off)."""
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n
