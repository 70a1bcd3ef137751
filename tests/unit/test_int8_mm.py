"""The native int8 products of few rows: the same int32 sums as ``torch._int_mm`` for every
shape, row count and thread count (odd widths, the tails past the vector loop, extreme
values), the choice between the two kernels measured per forward, and a whole w8a16 model's
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


class _Counted:
    """Which kernel each product took, and a fake clock each kernel's products advance."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, native_s: float, int_mm_s: float) -> None:
        self.calls: list[str] = []
        self.now = 0.0
        ours, theirs = int8_mm.native_mm, torch._int_mm

        def native_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
            self.calls.append("native")
            self.now += native_s
            return ours(a, w)

        def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            self.calls.append("_int_mm")
            self.now += int_mm_s
            return theirs(a, b)

        monkeypatch.setattr(int8_mm, "native_mm", native_mm)
        monkeypatch.setattr(torch, "_int_mm", int_mm)
        monkeypatch.setattr(int8_mm, "_clock", lambda: self.now)
        monkeypatch.setattr(int8_mm, "_trials", {})

    def forward(self, a: torch.Tensor, ws: list[torch.Tensor]) -> str:
        """A timed forward of one product per weight: the one kernel it took."""
        self.calls.clear()
        with int8_mm.timed_forward():
            for w in ws:
                assert torch.equal(int8_mm.int8_mm(a, w), a.int() @ w.int().t())
        (kernel,) = set(self.calls)  # every product of a forward on one kernel
        return kernel


@pytest.mark.parametrize("native_faster", [True, False])
def test_the_kernel_is_chosen_by_timing_whole_forwards(
        monkeypatch: pytest.MonkeyPatch, native_faster: bool) -> None:
    """Per model (first weight's shape), row bucket and thread count, the first forwards
    alternate kernels (TRIALS each, native first), then every forward takes the one whose
    forwards were faster; a product outside a timed forward takes the native kernel."""
    if not int8_mm.int_mm_exact():
        pytest.skip("torch._int_mm is not exact here: every product is native (tested below)")
    clock = _Counted(monkeypatch, *((1.0, 2.0) if native_faster else (2.0, 1.0)))
    gen = torch.Generator().manual_seed(1)
    ws = [torch.randint(-127, 128, (48 + i, 64), generator=gen, dtype=torch.int8)
          for i in range(3)]
    a = torch.randint(-127, 128, (2, 64), generator=gen, dtype=torch.int8)
    free = torch.randint(-127, 128, (2, 64), generator=gen, dtype=torch.int8)
    int8_mm.int8_mm(free, ws[0])
    assert clock.calls == ["native"]  # outside a timed forward: native
    trials = [clock.forward(a, ws) for _ in range(2 * int8_mm.TRIALS)]
    assert trials == ["native", "_int_mm"] * int8_mm.TRIALS
    kept = "native" if native_faster else "_int_mm"
    assert [clock.forward(a, ws) for _ in range(3)] == [kept] * 3
    clock.calls.clear()
    int8_mm.int8_mm(free, ws[1])
    assert clock.calls == ["native"]
    threads = torch.get_num_threads()
    assert int8_mm.choices() == {f"48x64,rows<=2,threads={threads}": kept}
    # Another bucket (5 rows: bucket 8) and another model (first weight 49 x 64) have
    # their own trials.
    assert clock.forward(torch.ones(5, 64, dtype=torch.int8), ws) == "native"
    assert clock.forward(a, ws[1:]) == "native"
    assert int8_mm.choices()[f"48x64,rows<=8,threads={threads}"] == "timing"
    assert int8_mm.choices()[f"49x64,rows<=2,threads={threads}"] == "timing"


def test_a_forward_that_raises_is_not_a_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    if not int8_mm.int_mm_exact():
        pytest.skip("torch._int_mm is not exact here: no trials")
    clock = _Counted(monkeypatch, 1.0, 2.0)
    w = torch.ones(8, 32, dtype=torch.int8)
    with pytest.raises(RuntimeError), int8_mm.timed_forward():
        int8_mm.int8_mm(torch.ones(1, 32, dtype=torch.int8), w)
        raise RuntimeError("cancelled")
    assert clock.forward(torch.ones(1, 32, dtype=torch.int8), [w]) == "native"  # still first
    assert int8_mm.path() in ("avx512vnni", "avx512vnni-256", "avxvnni", "avx2", "c")


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
        monkeypatch.setattr(int8_mm, "_trials", {})  # nothing kept: native first
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


class _TimedTarget:
    """A target whose forwards are one timed forward of int8 products: 2 activation rows
    per token (w8a16's digits) against ``ws``."""

    def __init__(self, clock: _Counted, ws: list[torch.Tensor]) -> None:
        self.clock, self.ws = clock, ws

    def prefill(self, tokens: list[int]) -> None:
        pass

    def score(self, tokens: list[int]) -> None:
        self.clock.forward(torch.ones(2 * len(tokens), 64, dtype=torch.int8), self.ws)

    def rollback(self, n: int) -> None:
        pass


def test_settle_runs_each_row_count_until_its_trials_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`int8_mm.settle` runs each row count's forwards until no trial is pending
    (2 · TRIALS for a new bucket, one for a settled one), so a warm-up leaves only the
    kept kernel's costs; every bucket it ran is then decided."""
    if not int8_mm.int_mm_exact():
        pytest.skip("torch._int_mm is not exact here: no trials, settle runs nothing")
    clock = _Counted(monkeypatch, 1.0, 2.0)
    ws = [torch.ones(48, 64, dtype=torch.int8)]
    target = _TimedTarget(clock, ws)
    assert int8_mm.settle(target, (1, 2)) == 2 * (2 * int8_mm.TRIALS)  # type: ignore[arg-type]
    assert set(int8_mm.choices().values()) == {"native"}
    assert len(int8_mm.choices()) == 2  # rows <= 2 and rows <= 4
    assert int8_mm.settle(target, (1, 2)) == 2  # type: ignore[arg-type]  # already kept
    assert clock.forward(torch.ones(2, 64, dtype=torch.int8), ws) == "native"
