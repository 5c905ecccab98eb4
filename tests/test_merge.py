"""The two-run merge behind dsa and recursive_doubling equals coalesce, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparsecoll.algorithms._merge import gather, keep_bucket, merge_two, take_at_least
from sparsecoll.algorithms.base import pack_pairs, sparse_is_cheaper, unpack_pairs
from sparsecoll.sparse import coalesce


@st.composite
def runs(draw):
    n = draw(st.sampled_from([1, 7, 1000, 2**31, 2**40]))
    itype = np.int32 if n <= 2**31 else np.int64
    dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    span = min(n, draw(st.sampled_from([1, 10, 5000])))
    out = []
    for _ in range(2):
        m = draw(st.integers(0, span))
        idx = np.sort(rng.choice(span, size=m, replace=False)).astype(itype)
        vals = rng.standard_normal(m).astype(dtype)
        vals[rng.random(m) < 0.1] = 0  # explicit zeros stay
        out.append((idx, vals))
    return n, out


@given(runs())
def test_merge_two_equals_coalesce(case):
    n, ((i1, v1), (i2, v2)) = case
    idx, vals = merge_two(i1, v1, i2, v2, n)
    ref = coalesce(np.concatenate([i1, i2]), np.concatenate([v1, v2]), n)
    assert idx.dtype == i1.dtype
    assert vals.dtype == v1.dtype
    np.testing.assert_array_equal(idx, ref.indices)
    np.testing.assert_array_equal(vals.view(np.uint8), ref.values.view(np.uint8))
    # commutative: the partner merging in the other order gets the same bits
    idx2, vals2 = merge_two(i2, v2, i1, v1, n)
    np.testing.assert_array_equal(idx2, idx)
    np.testing.assert_array_equal(vals2.view(np.uint8), vals.view(np.uint8))


def test_merge_two_does_not_alias_or_modify_inputs():
    i = np.array([1, 3], np.int32)
    v = np.array([1.0, 2.0], np.float32)
    e_i, e_v = np.zeros(0, np.int32), np.zeros(0, np.float32)
    for a, b in (((i, v), (e_i, e_v)), ((e_i, e_v), (i, v))):
        idx, vals = merge_two(*a, *b, 10)
        vals[:] = -1
        assert not np.shares_memory(idx, i)
        np.testing.assert_array_equal(v, [1.0, 2.0])


def test_misaligned_values_are_handled():
    # a float64 view at a 4-byte offset, as unpacked from an (int32, float64) pair buffer
    buf = np.zeros(4 + 8 * 3, np.uint8)
    vals = buf[4:].view(np.float64)
    vals[:] = [1.0, 2.0, 3.0]
    assert not vals.flags.aligned
    idx = np.array([0, 2, 4], np.int32)
    out_i, out_v = merge_two(idx, vals, np.array([2], np.int32), np.array([5.0]), 10)
    np.testing.assert_array_equal(out_i, [0, 2, 4])
    np.testing.assert_array_equal(out_v, [1.0, 7.0, 3.0])


@given(
    n=st.integers(0, 3000),
    dtype=st.sampled_from(["float16", "float32", "float64"]),
    itype=st.sampled_from(["int32", "int64"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_gather_is_fancy_indexing(n, dtype, itype, seed):
    """gather(x, idx) == x[idx]: repeats, any order, the first and last entries, empty; with
    drop, the entries read become 0."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(dtype)
    idx = rng.integers(0, n, rng.integers(0, 2 * n + 1)).astype(itype) if n else np.zeros(0, itype)
    got = gather(x, idx)
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got, x[idx])
    # drop=True (unique indices): the same values, and x is 0 exactly there afterwards
    unique = rng.permutation(n)[: rng.integers(0, n + 1)].astype(itype)
    want, rest = x[unique], x.copy()
    rest[unique] = 0
    np.testing.assert_array_equal(gather(x, unique, drop=True), want)
    np.testing.assert_array_equal(x, rest)


@given(
    x=st.lists(
        st.one_of(
            st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.5, -1.5])
        ),
        max_size=300,
    ),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
    t=st.sampled_from([0.0, 1.5, np.inf, np.nan]),
    zc=st.sampled_from([None, 0.5, 1.5, 3.0, np.inf]),
    itype=st.sampled_from([np.int32, np.int64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_take_at_least_is_boolean_indexing(x, dtype, t, zc, itype, seed):
    """take_at_least == boolean indexing at |x| >= t (ties at t kept, NaN never, empty),
    the indices in their dtype; with part, the entries a pass zeroed from zc are settled:
    part is 0 exactly where kept and holds its values elsewhere, whatever the two cuts
    are."""
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):
        xs = np.array(x, dtype=np.float64).astype(dtype)
    lo = int(rng.integers(0, 50))
    span = xs.shape[0] + int(rng.integers(0, 100))
    where = np.sort(rng.choice(span, xs.shape[0], replace=False))
    idx = (where + lo).astype(itype)
    t = xs.dtype.type(t)
    keep = np.abs(xs) >= t
    whole = np.zeros(span, dtype)
    whole[where] = xs
    part = whole.copy()
    if zc is not None:
        part[where[np.abs(xs) >= xs.dtype.type(zc)]] = 0  # what the pass left
    got, vals = take_at_least(xs, t, idx, lo, part if zc is not None else None, zc)
    np.testing.assert_array_equal(got, idx[keep])
    np.testing.assert_array_equal(vals, xs[keep])
    assert got.dtype == itype and vals.dtype == xs.dtype
    if zc is not None:
        want = whole.copy()
        want[where[keep]] = 0
        np.testing.assert_array_equal(part, want)


@given(
    x=st.lists(
        st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1.0, -1.5])),
        max_size=300,
    ),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
    cuts=st.sampled_from([(1.5, 1.0), (1.0, 1.0), (np.inf, 1.5), (2.0, 0.5)]),
    share=st.floats(0, 1),
)
def test_keep_bucket_is_the_mask(x, dtype, cuts, share):
    """keep_bucket: |x| >= hi, then the first ``quota`` in [lo, hi) in order (ties at both
    cuts, NaN never), as masks would keep them."""
    with np.errstate(over="ignore"):
        xs = np.array(x, dtype=np.float64).astype(dtype)
    idx = np.arange(xs.shape[0], dtype=np.int64) * 5 + 3
    hi, lo = (xs.dtype.type(c) for c in cuts)
    mags = np.abs(xs)
    chosen = mags >= hi
    bucket = np.flatnonzero((mags >= lo) & ~chosen)
    quota = int(share * bucket.shape[0])
    chosen[bucket[:quota]] = True
    got_idx, got_val = keep_bucket(idx, xs, hi, lo, ((0, quota),), int(chosen.sum()))
    np.testing.assert_array_equal(got_idx, idx[chosen])
    np.testing.assert_array_equal(got_val, xs[chosen])
    *again, got_mask = keep_bucket(idx, xs, hi, lo, ((0, quota),), int(chosen.sum()), mask=True)
    np.testing.assert_array_equal(got_mask, chosen)
    np.testing.assert_array_equal(again[0], idx[chosen])
    # two runs of the bucket's positions: a wrapped run from the middle
    if bucket.shape[0]:
        start = bucket.shape[0] // 2
        runs = (
            (start, min(start + quota, bucket.shape[0])),
            (0, max(start + quota - bucket.shape[0], 0)),
        )
        chosen = mags >= hi
        chosen[bucket[(start + np.arange(quota)) % bucket.shape[0]]] = True
        got = keep_bucket(idx, xs, hi, lo, runs, int(chosen.sum()), mask=True)
        np.testing.assert_array_equal(got[0], idx[chosen])
        np.testing.assert_array_equal(got[1], xs[chosen])
        np.testing.assert_array_equal(got[2], chosen)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("width", [1, 3, 16])
def test_merge_two_rows(dtype, width):
    """Rows merge as scalars do, equal indices summed elementwise, the same bits either way
    round and equal to a coalesce of the concatenation."""
    rng = np.random.default_rng(width)
    n = 50
    i1 = np.unique(rng.integers(0, n, 30)).astype(np.int32)
    i2 = np.unique(rng.integers(0, n, 20)).astype(np.int32)
    v1 = rng.standard_normal((i1.shape[0], width)).astype(dtype)
    v2 = rng.standard_normal((i2.shape[0], width)).astype(dtype)
    idx, vals = merge_two(i1, v1, i2, v2, n)
    idx2, vals2 = merge_two(i2, v2, i1, v1, n)
    want = coalesce(np.concatenate([i1, i2]), np.concatenate([v1, v2]), n)
    assert vals.dtype == dtype and vals.shape == (idx.shape[0], width)
    assert np.array_equal(idx, want.indices) and np.array_equal(idx, idx2)
    assert vals.tobytes() == vals2.tobytes() == want.values.tobytes()


@pytest.mark.parametrize("width", [None, 1, 5])
def test_pack_pairs_rows(width):
    idx = np.array([3, 9, 11], np.int64)
    shape = (3,) if width is None else (3, width)
    vals = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    buf = pack_pairs(idx, vals)
    assert buf.nbytes == idx.nbytes + vals.nbytes
    i2, v2 = unpack_pairs(buf, np.int64, np.float32, width)
    assert np.array_equal(i2, idx) and np.array_equal(v2, vals) and v2.shape == shape
    # the break-even rule counts one index a row: 3 rows of 5 are cheaper sparse among 5
    if width == 5:
        assert sparse_is_cheaper(3, 5, np.int64, np.float32, width)
        assert not sparse_is_cheaper(3, 5, np.int64, np.float32)
