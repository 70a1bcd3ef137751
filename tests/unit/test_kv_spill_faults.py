"""The disk copies of prefix KV under faults: failed writes, crashed writers' leftovers,
forged and foreign files, wrong layouts, file modes, several processes on one folder.
Every fault costs a recomputation, never an exception or a wrong KV."""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch

from agentspec.targets.cache.kv_spill import KVSpill
from agentspec.targets.cache.prefix_cache import PrefixCache
from agentspec.targets.hf import HFTarget, TargetConfig

LOGGER = "agentspec.targets.cache.kv_spill"


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh AGENTSPEC_HOME (its key file) per test."""
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _kv(n: int, seed: int = 0, heads: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, heads, n, 4, generator=gen), torch.randn(1, heads, n, 4, generator=gen))
            for _ in range(2)]


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def _ok_lookup(cache: PrefixCache, tokens: list[int], kv: list) -> int:  # type: ignore[type-arg]
    n, got = cache.lookup("t", [*tokens, 1], limit=10**6)
    for (k, v), (gk, gv) in zip(kv, got, strict=False):
        assert torch.equal(gk, k[..., :n, :]) and torch.equal(gv, v[..., :n, :])
    return n


# -- failed writes -----------------------------------------------------------------------


def _fail_replace(monkeypatch: pytest.MonkeyPatch) -> None:
    def replace(*_args: object, **_kw: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", replace)


def _fail_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills up half-way through a block file (both write paths)."""
    real_write, real_write_bytes = os.write, Path.write_bytes

    def write(fd: int, data: bytes) -> int:
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    def write_bytes(self: Path, data: bytes) -> int:
        real_write_bytes(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(Path, "write_bytes", write_bytes)


@pytest.mark.parametrize("fault", ["disk full", "replace fails", "folder is a file",
                                   "parent is a file"])
def test_a_failed_write_keeps_the_block_in_memory_and_nothing_partial_on_disk(
        fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "spill"
    if fault == "folder is a file":
        folder.write_bytes(b"x")
    elif fault == "parent is a file":
        (tmp_path / "blocker").write_bytes(b"x")
        folder = tmp_path / "blocker" / "spill"
    spill = KVSpill(folder, 10**7)
    cache = PrefixCache(10**7, block_size=4, spill=spill)
    tokens, kv = list(range(10, 22)), _kv(12)
    with monkeypatch.context() as patch:
        if fault == "disk full":
            _fail_write(patch)
        elif fault == "replace fails":
            _fail_replace(patch)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert cache.insert("t", tokens, kv) == 3  # stored in memory all the same
            assert cache.insert("t", list(range(40, 52)), _kv(12, seed=1)) == 3
    assert spill.write_errors == 6 and cache.to_dict()["spill_write_errors"] == 6
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per kind of failure, not once per block
    if folder.is_dir():
        assert _leftovers(folder) == []  # no partial block, no temporary file
    assert _ok_lookup(cache, tokens, kv) == 12
    # The disk works again: the next block is written.
    if fault in ("disk full", "replace fails"):
        cache.insert("t", list(range(60, 64)), _kv(4))
        assert spill.writes == 1 and len(list(folder.glob("*.kv"))) == 1


def test_temporary_files_of_crashed_writers_are_deleted_and_not_counted(
        tmp_path: Path) -> None:
    folder = tmp_path / "spill"
    folder.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (folder / f"aa.tmp{dead.pid}").write_bytes(b"x" * 1000)  # its writer is gone
    old = folder / f"bb.tmp{os.getpid()}-0001"  # a live pid, but long ago (a reused pid)
    old.write_bytes(b"x" * 1000)
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    (folder / f"cc.tmp{os.getpid()}-0002").write_bytes(b"x" * 1000)  # being written now
    (folder / "dd.kv").write_bytes(b"y" * 10)
    spill = KVSpill(folder, 10**7)
    assert _leftovers(folder) == [f"cc.tmp{os.getpid()}-0002", "dd.kv"]
    assert spill.bytes_used == 10


# -- forged, foreign and misshapen files --------------------------------------------------


def _payload(tokens: list[int], kv: list) -> bytes:  # type: ignore[type-arg]
    buf = io.BytesIO()
    torch.save({"tokens": tokens, "kv": kv}, buf)
    return buf.getvalue()


def test_a_block_forged_under_a_plain_checksum_or_another_key_is_a_miss(
        tmp_path: Path) -> None:
    tokens, kv = list(range(10, 22)), _kv(12)
    PrefixCache(10**7, block_size=4, spill=KVSpill(tmp_path, 10**7)).insert("t", tokens, kv)
    zeros = [(torch.zeros_like(k[..., :4, :]), torch.zeros_like(v[..., :4, :])) for k, v in kv]
    second = tmp_path / f"{PrefixCache(1, block_size=4)._keys('t', tokens)[1].hex()}.kv"
    assert second.is_file()
    payload = _payload(tokens[4:8], zeros)
    second.write_bytes(hashlib.sha256(payload).digest() + payload)  # the old format
    cache = PrefixCache(10**7, block_size=4, spill=KVSpill(tmp_path, 10**7))
    assert _ok_lookup(cache, tokens, kv) == 4  # the first block only, the rest recomputed
    assert cache.to_dict()["rejected_blocks"] == 1 and not second.exists()
    # Signed with another key: the same.
    KVSpill(tmp_path, 10**7, key=b"k" * 32).save(bytes.fromhex(second.stem), tokens[4:8], zeros)
    cache = PrefixCache(10**7, block_size=4, spill=KVSpill(tmp_path, 10**7))
    assert _ok_lookup(cache, tokens, kv) == 4
    assert cache.to_dict()["rejected_blocks"] == 1 and not second.exists()


def test_a_block_of_another_layout_is_rejected(tmp_path: Path) -> None:
    spill = KVSpill(tmp_path, 10**7)
    spill.save(b"\1" * 16, [1, 2, 3, 4], _kv(4))  # this model's blocks: 2 heads
    other = KVSpill(tmp_path, 10**7)  # the same key: only the layout is wrong
    other.save(b"\2" * 16, [5, 6, 7, 8], _kv(4, heads=3))
    other.save(b"\3" * 16, [5, 6, 7, 8], _kv(5))  # 5 positions for a 4-token block
    other.save(b"\4" * 16, [5, 6, 7, 8], [(k.double(), v.double()) for k, v in _kv(4)])
    for key in (b"\2", b"\3", b"\4"):
        assert spill.load(key * 16, [5, 6, 7, 8], "cpu") is None
    assert spill.rejected == 3 and len(list(tmp_path.glob("*.kv"))) == 1
    assert spill.load(b"\1" * 16, [1, 2, 3, 4], "cpu") is not None
    # Without a block seen yet, the positions are still checked.
    other.save(b"\5" * 16, [5, 6, 7, 8], _kv(5))
    assert KVSpill(tmp_path, 10**7).load(b"\5" * 16, [5, 6, 7, 8], "cpu") is None


# -- only the owner reads them ------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_folders_key_and_block_files_are_owner_only_whatever_the_umask(home: Path) -> None:
    before = os.umask(0o022)
    try:
        folder = home / "prefix-kv" / "model"
        PrefixCache(10**7, block_size=4, spill=KVSpill(folder, 10**7)).insert(
            "t", list(range(8)), _kv(8))
    finally:
        os.umask(before)
    for path in (home, home / "prefix-kv", folder, home / "keys"):
        assert _mode(path) == 0o700, path
    files = list(folder.iterdir())
    assert len(files) == 2 and all(_mode(f) == 0o600 for f in files)
    key = home / "keys" / "kv-hmac.key"
    assert _mode(key) == 0o600 and len(key.read_bytes()) == 32


@pytest.mark.parametrize("damage", ["readable by others", "wrong length", "a symlink"])
def test_an_untrusted_key_file_is_replaced_and_its_blocks_become_misses(
        damage: str, home: Path, tmp_path: Path) -> None:
    tokens, kv = list(range(8)), _kv(8)
    PrefixCache(10**7, block_size=4, spill=KVSpill(tmp_path / "s", 10**7)).insert("t", tokens, kv)
    key = home / "keys" / "kv-hmac.key"
    first = key.read_bytes()
    if damage == "readable by others":
        os.chmod(key, 0o644)
    elif damage == "wrong length":
        key.write_bytes(first[:16])
    else:
        (tmp_path / "mine").write_bytes(first)
        key.unlink()
        key.symlink_to(tmp_path / "mine")
    cache = PrefixCache(10**7, block_size=4, spill=KVSpill(tmp_path / "s", 10**7))
    assert not key.is_symlink() and _mode(key) == 0o600 and key.read_bytes() != first
    assert _ok_lookup(cache, tokens, kv) == 0 and cache.to_dict()["rejected_blocks"] == 1


def test_a_key_made_first_by_another_process_is_used(home: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = b"t" * 32
    real_link = os.link

    def link(src: str, dst: str) -> None:  # another process links its key just before us
        Path(dst).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, theirs)
        os.close(fd)
        real_link(src, dst)

    monkeypatch.setattr(os, "link", link)
    spill = KVSpill(tmp_path / "s", 10**7)
    assert (home / "keys" / "kv-hmac.key").read_bytes() == theirs
    assert [p.name for p in (home / "keys").iterdir()] == ["kv-hmac.key"]
    spill.save(b"\1" * 16, [1, 2], _kv(2))
    assert KVSpill(tmp_path / "s", 10**7, key=theirs).load(b"\1" * 16, [1, 2], "cpu")


# -- several processes on one folder -------------------------------------------------------


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.kv"))


def test_two_processes_on_one_folder_keep_it_within_the_budget(tmp_path: Path) -> None:
    probe = KVSpill(tmp_path / "probe", 10**7)
    probe.save(b"\0" * 16, [1, 2, 3, 4], _kv(4))
    block = _folder_bytes(tmp_path / "probe")
    budget = 5 * block
    a, b = KVSpill(tmp_path / "s", budget), KVSpill(tmp_path / "s", budget)
    for i in range(24):  # interleaved writes of the two processes
        (a if i % 2 else b).save(i.to_bytes(16, "big"), [i, 1, 2, 3], _kv(4, seed=i))
        assert _folder_bytes(tmp_path / "s") <= budget + block
    assert 3 <= len(list((tmp_path / "s").glob("*.kv"))) <= 5
    for spill in (a, b):  # each estimate was corrected by its latest recount
        assert spill.bytes_used <= budget


def test_files_vanishing_under_a_process_are_skipped(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "s"
    spill = KVSpill(folder, 10**7)
    tokens = [1, 2, 3, 4]
    spill.save(b"\1" * 16, tokens, _kv(4))
    block = _folder_bytes(folder)
    ghost = folder / ("ee" * 16 + ".kv")
    # The listing names a file another process deletes before it is stat'ed ...
    real_listdir, real_glob = os.listdir, Path.glob
    monkeypatch.setattr(os, "listdir", lambda p: [*real_listdir(p), ghost.name])
    monkeypatch.setattr(Path, "glob", lambda self, pat, **kw: [*real_glob(self, pat, **kw), ghost])
    small = KVSpill(folder, block * 3 // 2)  # over its budget: the trim meets the ghost
    small.save(b"\2" * 16, tokens, _kv(4))
    small.save(b"\3" * 16, tokens, _kv(4))
    assert len(list(real_glob(folder, "*.kv"))) == 1
    monkeypatch.undo()
    # ... and the file a read found is deleted before its time is refreshed.
    spill.save(b"\4" * 16, tokens, _kv(4))
    real_read = Path.read_bytes

    def read_then_vanish(self: Path) -> bytes:
        data = real_read(self)
        self.unlink()
        return data

    monkeypatch.setattr(Path, "read_bytes", read_then_vanish)
    assert spill.load(b"\4" * 16, tokens, "cpu") is not None  # the KV read is still valid
    assert spill.rejected == 0


# -- the counters; two models of one name ------------------------------------------------


def test_the_counters_of_the_disk_copies_are_in_to_dict(tmp_path: Path) -> None:
    cache = PrefixCache(10**7, block_size=4, spill=KVSpill(tmp_path, 10**7))
    summary = cache.to_dict()
    assert summary["rejected_blocks"] == summary["spill_write_errors"] == 0
    assert summary["restored_blocks"] == 0
    assert PrefixCache(10**7).to_dict()["rejected_blocks"] == 0  # memory only


def _save_tiny(folder: Path, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=64, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder)


def test_two_models_of_one_name_never_share_kv_files_or_cost_curves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaForCausalLM

    from agentspec.models import ModelFiles
    from agentspec.targets import hf

    def fake_load(model: str, dtype: str, device: str) -> tuple[object, None, ModelFiles]:
        path = tmp_path / model
        return LlamaForCausalLM.from_pretrained(path).eval(), None, ModelFiles(path, path.name)

    monkeypatch.setattr(hf, "load_model_and_tokenizer", fake_load)
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path / "home"))

    def load(model: str) -> HFTarget:
        return HFTarget.load(TargetConfig(model=model, device="cpu", prefix_spill_bytes=10**6,
                                          measure_costs=False))

    def where(target: HFTarget) -> tuple[str, str]:
        assert target.prefix_cache is not None and target.prefix_cache.spill is not None
        return str(target.prefix_cache.spill.folder), target.curves.key

    _save_tiny(tmp_path / "a" / "final", seed=1)
    _save_tiny(tmp_path / "b" / "final", seed=2)
    a, b = where(load("a/final")), where(load("b/final"))
    assert a[0] != b[0] and a[1] != b[1]
    assert where(load("a/final")) == a  # the same files: the same folder and curves
    _save_tiny(tmp_path / "a" / "final", seed=3)  # new weights at the same path
    assert where(load("a/final"))[0] != a[0]
