"""bench/train_cluster.py's inputs that one rank alone may lack (its corpus cache, the
rendezvous interface): every rank exits 2 (the failing rank named, rank 0 alone printing),
none left waiting for another."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 64


def _train_cluster():
    path = ROOT / "bench" / "train_cluster.py"
    spec = importlib.util.spec_from_file_location("train_cluster", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load(comm, cache_dir: Path, capsys):
    """``load_corpus`` on every rank; (the exit code or None, what rank 0 printed)."""
    mod = _train_cluster()
    code = None
    try:
        ids = mod.load_corpus(comm, VOCAB, cache_dir)
    except SystemExit as exc:
        code = exc.code
    else:
        assert ids.dtype == np.int32
    return code, capsys.readouterr().err


def test_a_cache_rank_0_cannot_write_stops_every_rank(comm, tmp_path, capsys) -> None:
    """Rank 0 (which tokenizes and writes) used to raise FileNotFoundError in np.save alone
    while the others waited in the barrier after it."""
    cache = tmp_path / "missing" if comm.rank == 0 else tmp_path
    code, err = _load(comm, cache, capsys)
    assert code == 2
    if comm.rank == 0:
        path = _train_cluster().corpus_path(cache, VOCAB)
        assert err.strip().endswith(f"error: argument --cache-dir: cannot write {path}"), err
    else:
        assert err == ""


def test_a_cache_another_rank_cannot_read_stops_every_rank(comm, tmp_path, capsys) -> None:
    """A folder rank 0 wrote but another rank does not see (not shared between hosts): that
    rank used to raise FileNotFoundError in np.load alone, rank 0 going on to train."""
    mod = _train_cluster()
    np.save(mod.corpus_path(tmp_path, VOCAB), np.arange(100, dtype=np.int32))
    cache = tmp_path if comm.rank == 0 else tmp_path / "elsewhere"
    code, err = _load(comm, cache, capsys)
    if comm.size == 1:
        assert code is None  # rank 0 reads what it wrote
        return
    assert code == 2
    if comm.rank == 0:
        assert "error: argument --cache-dir: cannot read " in err
        assert err.strip().endswith("(on rank 1)"), err


def test_an_interface_rank_0_lacks_stops_every_rank(comm, capsys) -> None:
    """--iface naming no interface of rank 0's: its OSError alone, the others went on into
    the process group's rendezvous."""
    mod = _train_cluster()
    with pytest.raises(SystemExit) as exc:
        mod.rendezvous_address(comm, "nosuch0")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error: argument --iface: no IPv4 address on 'nosuch0'") == (comm.rank == 0)
    assert (mod.rendezvous_address(comm, "lo") == "127.0.0.1") == (comm.rank == 0)


@pytest.fixture
def tmp_path(comm, tmp_path_factory):
    """A folder of this rank's own (pytest's default one may be shared by every rank)."""
    return tmp_path_factory.mktemp(f"rank{comm.rank}")
