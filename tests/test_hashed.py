"""hashed's pieces in process: the permutation of [0, n) and how runs are packed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sparsecoll
from sparsecoll.algorithms._hashwire import decode_run, encode_run, run_bytes, uses_bitmap
from sparsecoll.algorithms._stripes import Stripes


@pytest.mark.parametrize("seed", [0, 1, 7, 2**62])
@pytest.mark.parametrize("shift", [0, 2, 6])
def test_every_index_has_one_owner_and_place_for_every_small_n(seed, shift):
    """locate is one-to-one into [0, P)×[0, L), indices() undoes it, and each owner's
    coordinates ascend with the indices (its runs map back sorted)."""
    for P in (2, 3, 5, 8):
        for n in (*range(1, 130), 1000, 4099):
            st = Stripes(n, P, shift, seed)
            i = np.arange(n, dtype=np.int32)
            owner, coord = st.locate(i)
            assert owner.min() >= 0 and owner.max() < P and coord.max() < st.length
            assert np.unique(owner * st.length + coord).shape[0] == n, (P, n)
            for j in range(P):
                mine = owner == j
                assert np.all(np.diff(coord[mine]) > 0)
                assert np.array_equal(st.indices(coord[mine], j), i[mine])


@given(n=st.integers(2**31 - 2, 2**63 - 1), seed=st.integers(0, 2**63 - 1), data=st.data())
def test_locate_and_back_at_huge_n(n, seed, data):
    picks = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=50))
    x = np.array([0, 1, n - 2, n - 1, *picks], dtype=np.int64)
    for P in (2, 7):
        s = Stripes(n, P, 6, seed)
        owner, coord = s.locate(x)
        assert coord.max() < s.length and s.length * P < n + 64 * P + 64
        for j in range(P):
            assert np.array_equal(s.indices(coord[owner == j], j), x[owner == j])


def test_any_run_of_blocks_is_spread_within_a_block_per_owner():
    """Every stripe gives one block to each owner: a contiguous region's blocks differ by
    at most one per owner; every k-th stripe (a strided pattern) spreads by the rotation."""
    n, shift = 2**24, 6
    for P in (2, 3, 5, 8, 64):
        s = Stripes(n, P, shift)
        for start, length in ((0, 10_000), (12_345_678, 100_000), (n - 5000, 5000)):
            owner, _ = s.locate(np.arange(start, start + length) >> shift << shift)
            counts = np.bincount(owner, minlength=P) >> shift
            assert counts.max() - counts.min() <= 2, (P, start, counts)
        # one block in every 8·P: same stripe position each time
        blocks = np.arange(0, n >> shift, 8 * P)
        owner, _ = s.locate(blocks << shift)
        counts = np.bincount(owner, minlength=P)
        assert counts.max() <= counts.mean() + max(4, 0.1 * counts.mean()), (P, counts)


@pytest.mark.parametrize("otype", [np.int32, np.int64])
@pytest.mark.parametrize("vtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("length", [1, 7, 8, 9, 1000, 4099])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.05, 0.2, 1.0])
def test_runs_round_trip_in_either_form(otype, vtype, length, density):
    rng = np.random.default_rng(length)
    m = round(density * length)
    off = np.sort(rng.choice(length, m, replace=False)).astype(otype)
    vals = rng.standard_normal(m).astype(vtype)
    size = run_bytes(m, length, otype, vtype)
    bitmap = uses_bitmap(m, length, otype)
    head = (length + 7) // 8 if bitmap else m * np.dtype(otype).itemsize
    assert size == (head + m * np.dtype(vtype).itemsize if m else 0)
    # the smaller form, COO on a tie
    assert bitmap == ((length + 7) // 8 < m * np.dtype(otype).itemsize)
    buf = np.full(size + 1, 0xAB, np.uint8)[1:]  # (misaligned, and not zeroed)
    encode_run(off, vals, length, buf)
    got_off, got_vals = decode_run(buf, m, length, otype, vtype)
    assert got_off.dtype == otype and got_vals.dtype == vtype
    assert np.array_equal(got_off, off) and np.array_equal(got_vals, vals)


def test_a_bitmap_with_the_wrong_count_is_refused():
    off = np.arange(0, 64, 2, dtype=np.int32)
    buf = np.empty(run_bytes(32, 64, np.int32, np.float32), np.uint8)
    encode_run(off, np.ones(32, np.float32), 64, buf)
    buf[0] |= 2  # one more bit set than the count says
    with pytest.raises(RuntimeError, match="corrupt bitmap run: 33 bits set, expecting 32"):
        decode_run(buf, 32, 64, np.int32, np.float32)


def test_seed_option():
    algo = sparsecoll.get_algorithm("hashed", seed=5)
    assert algo.seed == 5 and algo.signature() == [5, 0]
    assert sparsecoll.get_algorithm("hashed").signature() == [0, 0]
    assert sparsecoll.get_algorithm("hashed", wire="compact").signature() == [0, 1]
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        sparsecoll.get_algorithm("hashed", seed=-1)
    for bad in (1.0, True, "3"):
        with pytest.raises(TypeError, match="seed must be an integer"):
            sparsecoll.get_algorithm("hashed", seed=bad)
    with pytest.raises(ValueError, match="seed must be below 2\\*\\*63"):
        sparsecoll.get_algorithm("hashed", seed=2**63)


def test_stripes_and_runs_on_a_device_as_on_the_host():
    """The device forms (CuPy's uint64 arithmetic; packbits) give the host's."""
    from sparsecoll._array import to_host

    from . import fakecupy

    rng = np.random.default_rng(9)
    idx = np.sort(rng.choice(50_000, 3000, replace=False))
    s = Stripes(50_000, 5, 6, seed=3)
    off = np.sort(rng.choice(1000, 400, replace=False)).astype(np.int32)
    vals = rng.standard_normal(400).astype(np.float32)
    buf = np.empty(run_bytes(400, 1000, np.int32, np.float32), np.uint8)
    encode_run(off, vals, 1000, buf)
    want = s.locate(idx)
    with fakecupy.installed() as xp:
        got = s.locate(xp.asarray(idx))
        assert all(np.array_equal(to_host(a), b) for a, b in zip(got, want))
        back = s.indices(xp.asarray(want[1][want[0] == 2]), 2)
        assert np.array_equal(to_host(back), idx[want[0] == 2])
        dbuf = xp.empty(buf.shape[0], np.uint8)
        encode_run(xp.asarray(off), xp.asarray(vals), 1000, dbuf)
        run = decode_run(dbuf, 400, 1000, np.int32, np.float32)
        assert np.array_equal(to_host(dbuf), buf)
        assert all(np.array_equal(to_host(a), b) for a, b in zip(run, (off, vals)))
