"""The native int8 products of few rows: the same int32 sums as ``torch._int_mm`` for every
shape, row count and thread count (odd widths, the tails past the vector loop, extreme
values), the choice between the two kernels measured per shape, and a whole w8a16 model's
logits the same on either kernel."""

from __future__ import annotations

import pytest
import torch

from agentspec.targets.kernels import int8_mm, native, w8a8
from agentspec.targets.kernels.int8 import quantize_linears
from tests.conftest import tiny_llama

pytestmark = pytest.mark.skipif(not (w8a8.supported() and native.available()),
                                reason="torch lacks torch._int_mm or the native library")


@pytest.mark.parametrize(("n", "k"), [(1, 1), (3, 31), (5, 32), (7, 33), (13, 100),
                                      (64, 896), (130, 4864), (9, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 17])
def test_sums_equal_int_mm_for_any_rows_and_threads(n: int, k: int, m: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k * 10 + m)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    a = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
    a[0, : min(k, 8)] = -127  # the extremes: the largest products and pair sums
    w[0, : min(k, 8)] = 127
    want = a.int() @ w.int().t()  # [m, n]: exact (torch._int_mm is not on every CPU)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            got = int8_mm.native_mm(a, w)
            assert got is not None and torch.equal(got, want), t
    finally:
        torch.set_num_threads(threads)


def test_the_kernel_choice_is_measured_per_shape_and_bucket() -> None:
    """Per weight shape and row bucket both kernels are timed once (where ``_int_mm`` is
    exact here; where it is not, no choice is made: every product is native)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randint(-127, 128, (48, 64), generator=gen, dtype=torch.int8)
    for m in (1, 2, 3, 5):
        a = torch.randint(-127, 128, (m, 64), generator=gen, dtype=torch.int8)
        assert torch.equal(int8_mm.int8_mm(a, w), a.int() @ w.int().t())
    seen = int8_mm.choices()
    buckets = {"48x64,rows<=1", "48x64,rows<=2", "48x64,rows<=4", "48x64,rows<=8"}
    if int8_mm.int_mm_exact():
        assert buckets <= set(seen)
    else:
        assert not buckets & set(seen)
    assert set(seen.values()) <= {"native", "_int_mm"}
    assert int8_mm.path() in ("avx512vnni", "avxvnni", "avx2", "c")


def test_a_w8a16_models_logits_are_the_same_on_either_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A w8a16 model's logits with every product on the native kernel and with none on it
    (``torch._int_mm`` where it is exact, else an int32 matmul) are the same bits."""
    model = tiny_llama(layers=2, max_positions=256)
    quantize_linears(model, activations=2)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    outs = []
    for use_native in (True, False):
        if not use_native:
            monkeypatch.setattr(int8_mm, "native_mm", lambda a, w: None)
        monkeypatch.setattr(int8_mm, "_choice", {})
        monkeypatch.setattr(int8_mm, "_median_s", lambda fn: 0.0)  # ties go native
        with torch.no_grad():
            outs.append(torch.cat([model(ids[:, : i + 1]).logits[0, -1:] for i in range(9)]))
    assert torch.equal(outs[0], outs[1])


def test_an_inexact_int_mm_is_never_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``torch._int_mm`` saturates (oneDNN's AVX2 path), every product takes the
    native kernel, whatever the row count, and the sums stay exact."""
    monkeypatch.setattr(int8_mm, "int_mm_exact", lambda: False)
    monkeypatch.setattr(torch, "_int_mm", lambda *args: pytest.fail("_int_mm was used"))
    gen = torch.Generator().manual_seed(5)
    w = torch.randint(-127, 128, (40, 96), generator=gen, dtype=torch.int8)
    for m in (1, 17, 100):
        a = torch.randint(-127, 128, (m, 96), generator=gen, dtype=torch.int8)
        assert torch.equal(int8_mm.int8_mm(a, w), a.int() @ w.int().t())


def test_the_int_mm_probe_answers() -> None:
    assert isinstance(int8_mm.int_mm_exact(), bool)


def _product_in_child(queue: object) -> None:
    gen = torch.Generator().manual_seed(9)
    w = torch.randint(-127, 128, (64, 96), generator=gen, dtype=torch.int8)
    a = torch.randint(-127, 128, (2, 96), generator=gen, dtype=torch.int8)
    torch.set_num_threads(2)
    out = int8_mm.native_mm(a, w)
    queue.put(out is not None and torch.equal(out, a.int() @ w.int().t()))  # type: ignore[attr-defined]


def test_a_forked_child_runs_the_pool() -> None:
    """A child forked after the pool's workers started has none of them: it must start its
    own rather than wait for the parent's (a server forking workers, multiprocessing)."""
    import multiprocessing

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _product_in_child(_Local())  # the parent's pool is up
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_product_in_child, args=(queue,))
        child.start()
        child.join(timeout=60)
        alive = child.is_alive()
        if alive:
            child.kill()
        assert not alive and queue.get(timeout=5)
    finally:
        torch.set_num_threads(threads)


class _Local:
    """A queue stand-in for the parent's own call."""

    def put(self, ok: bool) -> None:
        assert ok
