"""Tensors follow the target's device: mixed devices are caught on a CPU, before a GPU does.

The tiny model's weights are moved to the ``meta`` device, which stands for "not the CPU"
(CUDA on a real machine): a head, drafter or helper that builds a tensor on the CPU and
combines it with the model's fails here as it would on CUDA. Meta tensors have no data, so
the first step that reads values back (``int(t)``, ``.tolist()``, ``.cpu()``) ends a run with
a "no data" error; everything before it, the forwards included, has been checked by then.

Meta kernels check devices less strictly than CUDA ones (indexing and matmul accept a CPU
operand), so the runs are also watched by :class:`MixGuard`, which refuses any torch call
combining a CPU tensor of one element or more with a meta tensor (copies between devices,
``.to`` / ``copy_`` / ``.cpu()``, are what moving data looks like and are allowed).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from agentspec.drafters.model.distilled import (
    DistilledDrafter,
    DraftSpec,
    build_draft_model,
    embedding_checksum,
)
from agentspec.drafters.model.eagle import EagleConfig, EagleDrafter, build_head
from agentspec.drafters.model.eagle_head import HeadCache, HeadSpec
from agentspec.errors import ConfigError, DeviceUnavailableError
from agentspec.targets.cache.prefix_cache import (
    DEFAULT_PREFIX_CACHE_BYTES,
    MAX_AUTO_PREFIX_CACHE_BYTES,
    PrefixCache,
    auto_budget_bytes,
    available_bytes,
    default_prefix_cache_bytes,
)
from agentspec.types import DraftContext, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

META = torch.device("meta")
GIB = 1 << 30

# Errors that say two devices met (CUDA's, the meta kernels', MixGuard's).
_MIXED = re.compile(r"same device|expected device|different devices|mixes devices|"
                    r"expected to be in the same device", re.IGNORECASE)
# Errors that only say a meta tensor has no values to read back.
_NO_DATA = re.compile(r"meta tensor|no data|on meta", re.IGNORECASE)

# Calls that move data between devices (allowed to see two devices).
_MOVES = {"to", "cpu", "cuda", "copy_", "__get__", "__set__", "new_empty", "empty_like"}


class MixGuard(TorchFunctionMode):
    """Refuse torch calls combining a CPU tensor (one element or more) with a meta one."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in _MOVES:
            leaves = tree_flatten((args, kwargs))[0]
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            on_meta = any(t.device.type == "meta" for t in tensors)
            host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
            if on_meta and host:
                raise RuntimeError(
                    f"{getattr(func, '__qualname__', func)} mixes devices: meta and cpu "
                    f"{[tuple(t.shape) for t in host]}")
        return func(*args, **kwargs)


def run_on_meta(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` under :class:`MixGuard`; a device mix fails the test, a read-back of meta
    values ends the run quietly (returns ``None``)."""
    try:
        with MixGuard():
            return fn()
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        msg = str(exc)
        if _MIXED.search(msg) or not _NO_DATA.search(msg):
            raise AssertionError(f"tensors on two devices: {type(exc).__name__}: {msg}") from exc
        return None


@pytest.fixture(scope="module")
def meta_model(tiny_model: torch.nn.Module) -> torch.nn.Module:
    """The tiny target's model with every weight on the meta device."""
    return copy.deepcopy(tiny_model).to(META)


@pytest.fixture(scope="module")
def spec(tiny_model: torch.nn.Module) -> HeadSpec:
    vocab = tuple(range(tiny_model.config.vocab_size))
    return HeadSpec.for_target(tiny_model, vocab, "tiny-llama", embedding_checksum(tiny_model))


def _features(n: int, hidden: int, device: torch.device) -> torch.Tensor:
    return torch.randn(n, hidden, device=device)


def _devices(module: torch.nn.Module) -> Iterator[torch.device]:
    yield from (p.device for p in module.parameters())
    yield from (b.device for b in module.buffers())


# -- the guard itself ----------------------------------------------------------------------


def test_the_guard_catches_a_cpu_tensor_meeting_a_meta_one() -> None:
    embed = torch.randn(8, 4, device=META)
    with pytest.raises(AssertionError, match="two devices"):
        run_on_meta(lambda: embed[torch.tensor([[1, 2]])])  # meta indexing alone allows it
    assert run_on_meta(lambda: embed[torch.tensor([[1, 2]], device=META)]) is not None
    assert run_on_meta(lambda: int(embed[0, 0])) is None  # a read-back: not a mix


# -- the EAGLE head ------------------------------------------------------------------------


def test_eagle_head_and_its_cache_live_on_the_target_device(
    meta_model: Any, spec: HeadSpec
) -> None:
    head = build_head(meta_model, spec)
    assert head.device == META
    assert {d.type for d in _devices(head)} == {"meta"}
    cache = head.new_cache()
    assert cache.k.device == META and cache.v.device == META
    # A cache made elsewhere follows the head's keys on the first append.
    other = HeadCache(spec.kv_heads, spec.head_dim)
    other.append(torch.empty(1, spec.kv_heads, 2, spec.head_dim, device=META),
                 torch.empty(1, spec.kv_heads, 2, spec.head_dim, device=META))
    assert other.k.device == META and other.n == 2


@pytest.mark.parametrize("feature_device", ["meta", "cpu"])
def test_eagle_head_forward_takes_inputs_from_anywhere(
    meta_model: Any, spec: HeadSpec, feature_device: str
) -> None:
    """Training-style and cached forwards: tokens and positions built on the CPU, feature
    rows on the target's device (the contract) or still on the CPU (today's target)."""
    head = build_head(meta_model, spec)
    h = spec.hidden
    feats = _features(5, h, torch.device(feature_device))[None]  # [1, 5, H]
    tokens, positions = torch.tensor([[3, 4, 5, 6, 7]]), torch.arange(5)

    def forwards() -> torch.Tensor:
        with torch.inference_mode():
            out = head(feats, tokens, positions)  # causal, no cache
            cache = head.new_cache(capacity=2)  # grows in place on the way
            head(feats, tokens, positions, cache)
            out = head(out[:, -1:], torch.tensor([[8]]), torch.tensor([5]), cache)
            return head.logits(out[0, -1])

    logits = run_on_meta(forwards)
    assert logits is not None and logits.device == META
    assert tuple(logits.shape) == (len(spec.draft_vocab),)


@pytest.mark.parametrize("feature_device", ["meta", "cpu"])
def test_eagle_drafter_catch_up_and_propose_stay_on_the_device(
    meta_model: Any, spec: HeadSpec, feature_device: str
) -> None:
    """observe_features -> propose: the catch-up over the prompt's pairs and every drafted
    token's forward run on the head's device (the ids come back once, at the end)."""
    drafter = EagleDrafter(build_head(meta_model, spec), EagleConfig(max_tokens=4))
    prompt = [5, 17, 33, 2, 8, 40, 12]
    ctx = DraftContext(prompt, len(prompt), request_id="r1")
    drafter.begin_request(None, None, request_id="r1")
    feats = _features(len(prompt) - 1, spec.hidden, torch.device(feature_device))
    run_on_meta(lambda: drafter.observe_features(ctx, 0, feats))
    (stream,) = drafter._streams.values()
    assert all(row.device == META for row in stream.feats)
    run_on_meta(lambda: drafter.propose(ctx, 4))
    assert drafter.forwards == 4  # the catch-up, then 3 drafted tokens: all ran
    assert stream.cache.k.device == META


def test_keyed_eagle_drafts_cross_to_the_cpu_once(meta_model: Any, spec: HeadSpec) -> None:
    """A seeded sampled request: the keyed draw reads the head's distribution on the CPU."""
    drafter = EagleDrafter(build_head(meta_model, spec), EagleConfig(max_tokens=3))
    prompt = [5, 17, 33, 2]
    ctx = DraftContext(prompt, len(prompt), request_id="k",
                       sampling=SamplingParams(temperature=0.8, seed=7))
    drafter.begin_request(None, None, request_id="k")
    drafter.observe_features(ctx, 0, _features(3, spec.hidden, META))
    run_on_meta(lambda: drafter.propose(ctx, 3))
    assert drafter.forwards == 1  # the catch-up ran on the device; the draw needs values


def test_hybrid_with_an_eagle_drafter_on_the_device(meta_model: Any, spec: HeadSpec) -> None:
    """HVD (cache + EAGLE head): features forwarded, the model drafter's forwards on the
    device. This is the path that failed on CUDA (``self.embed[tokens]``)."""
    from agentspec.drafters import SuffixDrafter
    from agentspec.drafters.hybrid import HybridDrafter
    from agentspec.payoff.policy import ArcticRule

    eagle = EagleDrafter(build_head(meta_model, spec), EagleConfig(max_tokens=3))
    hybrid = HybridDrafter(SuffixDrafter(), eagle, ArcticRule(), model_max=3)
    prompt = [9, 21, 3, 44, 5, 60]  # nothing repeats: the cache has no draft, the model wins
    ctx = DraftContext(prompt, len(prompt), request_id="h")
    hybrid.begin_request(None, None, request_id="h")
    hybrid.observe_features(ctx, 0, _features(len(prompt) - 1, spec.hidden, META))
    run_on_meta(lambda: hybrid.propose(ctx, 3))
    assert hybrid.last_choice.source == "model"
    assert eagle.forwards == 3  # the catch-up and 2 drafted tokens ran on the device


# -- the distilled and causal drafters -------------------------------------------------------


def test_distilled_drafter_is_built_on_the_target_device(meta_model: Any) -> None:
    ids = tuple(range(0, meta_model.config.vocab_size, 2))
    dspec = DraftSpec(num_layers=1, draft_vocab=ids, rank=4, target_name="tiny-llama",
                      target_vocab=meta_model.config.vocab_size, checksum=0.0)
    draft = build_draft_model(meta_model, dspec)
    assert {d.type for d in _devices(draft)} == {"meta"}
    drafter = DistilledDrafter(draft, torch.tensor(ids), meta_model.config.vocab_size)
    assert drafter.device == META
    assert drafter.draft_vocab.device.type == "cpu"  # scatters the CPU logits
    run_on_meta(lambda: drafter.propose(DraftContext([4, 5, 6], 3), 3))
    assert drafter.forwards == 1  # the prefill forward ran on the device


def test_model_drafter_logits_come_back_to_the_cpu(tiny_model: Any) -> None:
    """Drafts are sampled with CPU generators and compared with the target's CPU logits."""
    from agentspec.drafters.model.causal import ModelDrafter, ModelDrafterConfig

    drafter = ModelDrafter(tiny_model, ModelDrafterConfig(max_tokens=3, temperature=0.7))
    drafter.begin_request(None, torch.Generator().manual_seed(1))
    draft = drafter.propose(DraftContext([4, 5, 6], 3), 3)
    assert draft.probs is not None and draft.probs.device.type == "cpu"
    assert drafter._feed([[1]]).device.type == "cpu"


# -- helpers that meet the target's logits ---------------------------------------------------


def test_penalties_follow_the_logits_device() -> None:
    from agentspec.penalties import PenaltyState

    state = PenaltyState(SamplingParams(temperature=0.7, repetition_penalty=1.3,
                                        frequency_penalty=0.5), 96, [3, 4, 5])
    state.commit([7, 7])
    logits = torch.randn(2, 96, device=META)
    run_on_meta(lambda: state.apply(logits, [[], [9]]))


def test_sampling_draws_where_the_generator_is() -> None:
    from agentspec.sampling import draft_probs, sample

    probs = torch.softmax(torch.randn(2, 10), -1)
    assert sample(probs, torch.Generator().manual_seed(0)).device.type == "cpu"
    q = draft_probs(torch.tensor([1, 2]), probs, 10)
    assert q.device.type == "cpu"


# -- the prefix store's default budget -------------------------------------------------------


def test_auto_budget_rule() -> None:
    assert auto_budget_bytes(None) == DEFAULT_PREFIX_CACHE_BYTES  # unknown: 1 GiB
    assert auto_budget_bytes(16 * GIB) == 4 * GIB  # a quarter
    assert auto_budget_bytes(2 * GIB) == 1 * GIB  # the floor
    assert auto_budget_bytes(1000 * GIB) == MAX_AUTO_PREFIX_CACHE_BYTES  # the ceiling
    assert auto_budget_bytes(GIB) == GIB // 2  # never more than half of what is there
    assert auto_budget_bytes(0) == 0
    assert MAX_AUTO_PREFIX_CACHE_BYTES == 8 * GIB


def test_auto_budget_reads_this_machine_and_follows_the_device(monkeypatch: Any) -> None:
    avail = available_bytes("cpu")
    assert avail is None or avail > 0
    assert DEFAULT_PREFIX_CACHE_BYTES // 2 <= default_prefix_cache_bytes("cpu") \
        <= MAX_AUTO_PREFIX_CACHE_BYTES
    import agentspec.targets.cache.prefix_cache as pc

    seen: list[str] = []

    def fake(device: Any = "cpu") -> int:
        seen.append(str(device))
        return 40 * GIB if str(device) == "cuda" else 8 * GIB

    monkeypatch.setattr(pc, "available_bytes", fake)
    store = PrefixCache(None)
    assert store.auto_budget and store.budget_bytes == 2 * GIB
    store.device = "cuda"  # the target takes the store: sized where the blocks live
    assert store.budget_bytes == 8 * GIB and seen[-1] == "cuda"
    fixed = PrefixCache(3 * GIB)  # an explicit budget is used as given
    fixed.device = "cuda"
    assert not fixed.auto_budget and fixed.budget_bytes == 3 * GIB
    assert PrefixCache(0).budget_bytes == 0 and not PrefixCache(0).enabled


# -- --device ---------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_clear_error(capsys: Any) -> None:
    from agentspec.cli.console import main
    from agentspec.targets.hf import TargetConfig

    with pytest.raises(DeviceUnavailableError, match="device='cuda'"):
        TargetConfig(device="cuda").resolved_device()
    assert issubclass(DeviceUnavailableError, ConfigError)
    assert main(["generate", "hi", "--device", "cuda"]) == 2
    assert "device='cuda'" in capsys.readouterr().err
    assert TargetConfig(device="auto").resolved_device() == "cpu"


def test_every_model_command_takes_device() -> None:
    from agentspec.cli.console import build_parser

    parser = build_parser()
    for argv in (["demo"], ["bench"], ["generate", "x"], ["serve"], ["drive"],
                 ["train-predictor"]):
        args = parser.parse_args([*argv, "--device", "cpu"])
        assert args.device == "cpu", argv
        assert parser.parse_args(argv).device == "auto", argv
