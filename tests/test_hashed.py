"""hashed's pieces in process: the permutation of [0, n) and how runs are packed."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sparsecoll
from sparsecoll.algorithms._blocksort import relabel
from sparsecoll.algorithms._hashperm import AffinePermutation
from sparsecoll.algorithms._hashwire import decode_run, encode_run, run_bytes, uses_bitmap
from sparsecoll.algorithms.base import range_bounds


@pytest.mark.parametrize("seed", [0, 1, 7, 2**62])
def test_permutation_is_a_bijection_with_its_inverse_for_every_small_n(seed):
    for n in range(1, 300):
        perm = AffinePermutation.from_seed(n, seed)
        x = np.arange(n, dtype=np.int32)
        y = perm.apply(x)
        assert np.array_equal(np.sort(y), np.arange(n)), (n, perm)
        assert np.array_equal(perm.inverse().apply(y), x), (n, perm)
        assert np.array_equal(perm._apply_xp(x, np), y)


@given(
    n=st.one_of(st.integers(2**31 - 2, 2**31 + 2), st.integers(2**32, 2**63 - 1)),
    seed=st.integers(0, 2**63 - 1),
    data=st.data(),
)
def test_permutation_matches_python_integers_at_huge_n(n, seed, data):
    """No intermediate product overflows: the kernel and the array form equal a·i + c mod n
    in Python integers, ends of the range included, and the inverse undoes it."""
    perm = AffinePermutation.from_seed(n, seed)
    assert math.gcd(perm.a, n) == 1 and 0 <= perm.c < n
    picks = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=50))
    x = np.array([0, 1, n - 2, n - 1, *picks], dtype=np.int64)
    want = np.array([(perm.a * int(i) + perm.c) % n for i in x], dtype=np.int64)
    y = perm.apply(x)
    assert np.array_equal(y, want)
    assert np.array_equal(perm._apply_xp(x, np), want)
    assert np.array_equal(perm.inverse().apply(y), x)


def test_a_contiguous_region_spreads_evenly_over_the_ranges():
    """The Weyl property: any run of consecutive indices lands within a few of its share
    on each of P ranges (a random hash would be off by about √share)."""
    n = 2**24
    perm = AffinePermutation.from_seed(n)
    for P in (2, 3, 5, 8, 64):
        bounds = range_bounds(n, P)
        for start, length in ((0, 10_000), (12_345_678, 100_000), (n - 5000, 5000)):
            y = np.sort(perm.apply(np.arange(start, start + length)))
            counts = np.diff(np.searchsorted(y, bounds))
            assert counts.max() - counts.min() <= 4, (P, start, counts)


def test_a_non_permutation_is_refused():
    with pytest.raises(ValueError, match="not a permutation"):
        AffinePermutation(4, 0, 10)
    with pytest.raises(ValueError, match="not a permutation"):
        AffinePermutation(3, 10, 10)


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
    assert algo.seed == 5 and algo.signature() == [5]
    assert sparsecoll.get_algorithm("hashed").signature() == [0]
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        sparsecoll.get_algorithm("hashed", seed=-1)
    for bad in (1.0, True, "3"):
        with pytest.raises(TypeError, match="seed must be an integer"):
            sparsecoll.get_algorithm("hashed", seed=bad)
    with pytest.raises(ValueError, match="seed must be below 2\\*\\*63"):
        sparsecoll.get_algorithm("hashed", seed=2**63)


@pytest.mark.parametrize("shift", [0, 3, 6])
@pytest.mark.parametrize(("n", "m"), [(1, 1), (100, 0), (100, 37), (5000, 4000), (2**20, 300)])
def test_relabel_sorts_blocks_by_their_new_labels(shift, n, m):
    """Both ways of ordering the segments (bitmap rank for dense labels, argsort for sparse
    ones) give the relabelled coordinates in ascending order and where each came from."""
    rng = np.random.default_rng([n, m, shift])
    coords = np.sort(rng.choice(n, m, replace=False)).astype(np.int32)
    perm = AffinePermutation.from_seed(-(-n >> shift), seed=3)
    c = coords.astype(np.int64)
    want = perm.apply(c >> shift) << shift | (c & ((1 << shift) - 1))
    new, order = relabel(coords, perm, shift)
    assert np.array_equal(new, np.sort(want))
    assert np.array_equal(want[order], new)
    assert np.array_equal(
        perm.inverse().apply(new >> shift) << shift | (new & ((1 << shift) - 1)), c[order]
    )


def test_relabel_and_runs_on_a_device_as_on_the_host():
    """The device forms (an argsort of the entries' labels; packbits) give the host's."""
    from sparsecoll._array import to_host

    from . import fakecupy

    rng = np.random.default_rng(9)
    coords = np.sort(rng.choice(50_000, 3000, replace=False))
    perm = AffinePermutation.from_seed(-(-50_000 >> 6))
    off = np.sort(rng.choice(1000, 400, replace=False)).astype(np.int32)
    vals = rng.standard_normal(400).astype(np.float32)
    buf = np.empty(run_bytes(400, 1000, np.int32, np.float32), np.uint8)
    encode_run(off, vals, 1000, buf)
    with fakecupy.installed() as xp:
        new, order = relabel(xp.asarray(coords), perm, 6)
        dbuf = xp.empty(buf.shape[0], np.uint8)
        encode_run(xp.asarray(off), xp.asarray(vals), 1000, dbuf)
        got = decode_run(dbuf, 400, 1000, np.int32, np.float32)
        assert np.array_equal(to_host(dbuf), buf)
        assert all(np.array_equal(to_host(a), b) for a, b in zip(got, (off, vals)))
    want = relabel(coords, perm, 6)
    assert np.array_equal(to_host(new), want[0]) and np.array_equal(to_host(order), want[1])
