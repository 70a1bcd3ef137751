"""The native kernels give the same bits whichever vector path they are built for.

The library is compiled at install for the installing CPU (``-march=native``): AVX-512 on
one machine, AVX2 on the next, plain x86-64 where neither is there. Its floating-point
kernels (decode attention, the activation digits and their recombination, a whole int8
layer in one call) promise one
operation order on every CPU, so that a model's answers do not depend on which one ran
them; the int8 product promises exact integer sums. Here the same sources are built for
AVX2 (``-march=x86-64-v3``, where this CPU runs it) and for baseline x86-64 (SSE2), each
loaded in a child process through ``AGENTSPEC_NATIVE_LIBRARY``, and every output must be
the installed build's bits (GCC once lowered 16-lane vector code on AVX2 through memory;
the rewrite that made it 8x faster there is held to this)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
import torch

from agentspec.targets.base.cpu import cpuinfo
from agentspec.targets.kernels import native

#: Outputs of every kernel on fixed seeds, written by a child to ``argv[1]``.
PROBE = r"""
import sys
import agentspec
import torch
from agentspec.targets.kernels import attention_kernel, fused_digits, int8_mm, native
assert native.available(), "the library did not load"
torch.set_num_threads(2)
gen = torch.Generator().manual_seed(0)
out = {"path": int8_mm.path()}
for dt in (torch.float32, torch.bfloat16):
    for i, (h, kv, q, n, d) in enumerate(((14, 2, 1, 600, 64), (14, 2, 5, 1100, 64),
                                          (9, 3, 3, 77, 64), (4, 4, 2, 33, 72),
                                          (8, 2, 7, 300, 128), (2, 1, 1, 16, 16))):
        for mk in ("none", "bool", "add"):
            query = (torch.randn(1, h, q, d, generator=gen) * 3).to(dt)
            key = torch.randn(1, kv, n, d, generator=gen).to(dt)
            value = torch.randn(1, kv, n, d, generator=gen).to(dt)
            keep = torch.rand(1, 1, q, n, generator=gen) > 0.3
            mask = (None if mk == "none" else keep if mk == "bool"
                    else torch.where(keep, 0.0, float("-inf")).to(dt))
            got = attention_kernel.decode_attention(query, key, value, mask, d ** -0.5)
            out[f"attention/{dt}/{i}/{mk}"] = got
    for m, k in ((1, 896), (3, 100), (6, 4864)):
        rows = (torch.randn(m, k, generator=gen) * 5).to(dt)
        for digits in (1, 2):
            qd, u = fused_digits.quantize(rows, digits)
            out[f"digits/{dt}/{m}/{digits}"] = (qd, u)
            acc = torch.randint(-2**20, 2**20, (digits * m, 37), generator=gen,
                                dtype=torch.int32)
            scales, bias = torch.rand(37, generator=gen), torch.randn(37, generator=gen)
            out[f"combine/{dt}/{m}/{digits}"] = fused_digits.combine(acc, scales, u, bias, dt)
    for m, k, n in ((1, 896, 67), (3, 100, 9), (5, 577, 33)):
        x = (torch.randn(m, k, generator=gen) * 4).to(dt)
        qw = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        scales, bias = torch.rand(n, generator=gen), torch.randn(n, generator=gen)
        for digits in (1, 2):
            out[f"linear/{dt}/{m}/{digits}"] = fused_digits.linear(x, qw, scales, bias, digits)
for m in (1, 2, 3, 4, 5, 8, 9, 17):
    for k in (64, 100, 896):
        a = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
        w = torch.randint(-127, 128, (41, k), generator=gen, dtype=torch.int8)
        a[0], w[0] = 127, -127
        out[f"int8_mm/{m}/{k}"] = (int8_mm.native_mm(a, w), a.int() @ w.int().t())
torch.save(out, sys.argv[1])
"""

#: Builds tried besides the installed one: (name, -march, CPU flags it needs).
BUILDS = (("avx2", "x86-64-v3", ("avx2", "fma", "bmi2", "f16c")), ("x86-64", "x86-64", ()))


def _install_build() -> tuple[list[str], list[str]]:
    """The native extension's sources and compile flags as ``pyproject.toml`` gives them to
    the install (the builds here differ from it only in ``-march``)."""
    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    ext = next(e for e in config["tool"]["setuptools"]["ext-modules"]
               if e["name"] == native.EXTENSION)
    flags = [f for f in ext["extra-compile-args"] if not f.startswith("-march=")]
    return [str(root / src) for src in ext["sources"]], flags


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _probe(tmp_path: Path, name: str, library: Path | None) -> dict[str, object]:
    env = dict(os.environ)
    env.pop("AGENTSPEC_NATIVE", None)
    if library is not None:
        env["AGENTSPEC_NATIVE_LIBRARY"] = str(library)
    else:
        env.pop("AGENTSPEC_NATIVE_LIBRARY", None)
    dest = tmp_path / f"{name}.pt"
    subprocess.run([sys.executable, "-c", PROBE, str(dest)], env=env, check=True,
                   cwd=Path(__file__).resolve().parents[2], timeout=600)
    result: dict[str, object] = torch.load(dest)
    return result


def _same(a: object, b: object) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="the builds compared are x86-64 ones")
@pytest.mark.skipif(not native.available(), reason="the native library is not installed")
def test_every_vector_path_gives_the_installed_builds_bits(tmp_path: Path) -> None:
    cc = _compiler()
    assert cc is not None, "no C compiler: the install itself needs one"
    sources, build_flags = _install_build()
    include = sysconfig.get_paths()["include"]
    flags = set(cpuinfo("flags").split())
    reference = _probe(tmp_path, "installed", None)
    tried = []
    for name, march, needs in BUILDS:
        if not set(needs) <= flags:
            continue  # this CPU cannot run that build
        lib = tmp_path / f"native_{name}.so"
        subprocess.run([cc, "-shared", "-fPIC", f"-march={march}", *build_flags,
                        f"-I{include}", *sources, "-o", str(lib)],
                       check=True, capture_output=True, timeout=600)
        got = _probe(tmp_path, name, lib)
        assert got["path"] == ("avx2" if name == "avx2" else "c")
        differ = [key for key in reference if key != "path"
                  and not _same(got[key], reference[key])]
        assert not differ, f"the {name} build differs from the installed one at {differ[:5]}"
        tried.append(name)
    assert "x86-64" in tried  # every x86-64 CPU runs the baseline build
    for key, value in reference.items():  # the products are exact sums, on every build
        if key.startswith("int8_mm/"):
            assert isinstance(value, tuple) and torch.equal(value[0], value[1]), key
