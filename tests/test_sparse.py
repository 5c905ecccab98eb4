"""SparseVector and coalesce: local logic, in-process."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sparsecoll import SparseVector
from sparsecoll._array import index_dtype
from sparsecoll.sparse import check_local, coalesce

from .mpi.cases import DLPackOnly


@given(
    n=st.integers(1, 200),
    data=st.data(),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
)
def test_coalesce_sums_repeats_and_sorts(n, data, dtype):
    m = data.draw(st.integers(0, 300))
    idx = data.draw(hnp.arrays(np.int64, m, elements=st.integers(0, n - 1)))
    vals = data.draw(
        hnp.arrays(dtype, m, elements=st.floats(-100, 100, width=np.dtype(dtype).itemsize * 8))
    )
    out = coalesce(idx, vals, n)
    assert out.indices.dtype == index_dtype(n)
    assert out.values.dtype == dtype
    assert np.all(np.diff(out.indices) > 0)
    want = np.zeros(n)
    np.add.at(want, idx, vals.astype(np.float64))
    got = np.zeros(n)
    got[out.indices] = out.values
    eps = float(np.finfo(dtype).eps)
    bound = eps * (m + 1) * float(np.abs(vals.astype(np.float64)).sum())  # summation error
    assert np.allclose(got, want, rtol=4 * eps, atol=bound + 1e-300)
    assert set(out.indices.tolist()) == set(idx.tolist())


def test_coalesce_does_not_modify_input():
    idx = np.array([5, 1, 5, 0])
    vals = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    out = coalesce(idx, vals, 10)
    assert idx.tolist() == [5, 1, 5, 0] and vals.tolist() == [1, 2, 3, 4]
    assert out.indices.tolist() == [0, 1, 5] and out.values.tolist() == [4, 2, 4]


@pytest.mark.parametrize(
    ("dtype", "vals"),
    [
        ("float16", [60000.0, 60000.0]),
        ("float32", [3e38, 3e38]),
        ("float64", [1e308, 1e308]),
        ("float32", [np.inf, -np.inf]),
        ("float16", [-np.inf, np.inf]),
    ],
)
def test_repeats_summing_past_the_dtype_give_ieee_results_without_a_warning(dtype, vals):
    """from_coo sums repeated indices as allreduce does, IEEE and silent: an overflow is
    inf, inf - inf is NaN (it warned 'overflow encountered in reduceat' / 'in cast', where
    allreduce of the same input did not)."""
    with np.errstate(all="ignore"):
        want = np.asarray(np.sum(np.array(vals, np.float64))).astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = SparseVector.from_coo([3, 3], np.array(vals, dtype), 4)
    assert out.indices.tolist() == [3]
    assert out.values.dtype == dtype
    assert np.array_equal(out.values, [want], equal_nan=True)


def test_index_dtype_switches_above_int32():
    assert index_dtype(2**31) == np.int32  # largest index 2**31 - 1 still fits
    assert index_dtype(2**31 + 1) == np.int64
    big = coalesce(np.array([2**40 - 1, 3], np.int64), np.ones(2, np.float32), 2**40)
    assert big.indices.tolist() == [3, 2**40 - 1]  # nothing wrapped


def test_from_dense_round_trip():
    x = np.array([0, 1.5, 0, -2, 0], np.float32)
    v = SparseVector.from_dense(x)
    assert v.indices.tolist() == [1, 3]
    assert np.array_equal(v.to_dense(), x)
    assert v.nnz == 2 and len(v) == 5
    with pytest.raises(ValueError, match="1-D or 2-D"):
        SparseVector.from_dense(np.ones((2, 3, 4), np.float32))
    with pytest.raises(TypeError, match="float16, float32 or float64"):
        SparseVector.from_dense(np.arange(4))


@pytest.mark.parametrize(
    ("idx", "vals", "n", "etype", "text"),
    [
        (np.array([0, 10]), np.ones(2, np.float32), 10, ValueError, "index 10 out of range"),
        (np.array([-1]), np.ones(1, np.float32), 10, ValueError, "index -1 out of range"),
        (np.array([0.0]), np.ones(1, np.float32), 10, TypeError, "integers"),
        (np.array([0]), np.ones(1, np.int64), 10, TypeError, "float16, float32 or float64"),
        (np.array([0, 1]), np.ones(1, np.float32), 10, ValueError, "differ in length"),
        (np.array([0]), np.ones((1, 1, 1), np.float32), 10, ValueError, "1-D"),
        (np.array([0]), np.ones((1, 0), np.float32), 10, ValueError, "at least one value"),
        (np.array([0]), np.ones(1, np.float32), 2.5, TypeError, "n must be an integer"),
        (np.array([0]), np.ones(1, np.float32), -3, ValueError, "non-negative"),
    ],
)
def test_check_local_rejects(idx, vals, n, etype, text):
    with pytest.raises(etype, match=text):
        check_local(idx, vals, n)


def _representations(vals, idx):
    """(label, values, indices) of the same numbers as numpy and torch users hold them."""
    out = [
        ("lists", vals.tolist(), idx.tolist()),
        ("tuples", tuple(vals.tolist()), tuple(idx.tolist())),
        ("memoryviews", memoryview(vals), memoryview(idx)),
        ("big-endian", vals.astype(vals.dtype.newbyteorder(">")), idx.astype(">u8")),
        ("strided", np.repeat(vals, 2)[::2], idx.astype(np.uint8)),
    ]
    torch = pytest.importorskip("torch")
    out.append(("torch", torch.from_numpy(vals.copy()), torch.from_numpy(idx.astype(np.int32))))
    return out


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_from_coo_and_from_dense_take_array_likes(dtype):
    """What allreduce takes, SparseVector.from_coo and from_dense take too (they read
    ``.ndim`` of the raw argument: a list was "not 1-D, got shape None", a memoryview an
    AttributeError, a torch tensor or big-endian array "not float32"); torch comes back
    as torch, and to_dense works on it (it asked numpy for a torch dtype)."""
    idx = np.array([5, 1, 5, 0], np.int64)
    vals = np.array([1.0, 2.0, 3.0, -4.0], dtype)
    want = np.zeros(7)
    np.add.at(want, idx, vals)
    for label, v, i in _representations(vals, idx):
        for x in (SparseVector.from_coo(i, v, 7), SparseVector.from_dense(v)):
            dense = x.to_dense()
            assert type(dense) is type(v if label == "torch" else vals), label
            floats = np.float64 if label in ("lists", "tuples") else dtype
            assert np.asarray(dense).dtype == floats, label
        got = SparseVector.from_coo(i, v, 7)
        assert np.array_equal(np.asarray(got.to_dense()), want), label
        assert np.array_equal(np.asarray(SparseVector.from_dense(v).to_dense()), vals), label


@pytest.mark.parametrize("which", ["values", "indices", "x"])
def test_masked_entries_are_refused(which):
    """numpy's conversion drops a mask: the hidden entries would be summed."""
    idx = np.array([0, 2, 4])
    vals = np.array([1.0, 2.0, 3.0])
    masked = np.ma.masked_array(idx if which == "indices" else vals, mask=[0, 1, 0])
    build = {
        "x": lambda: SparseVector.from_dense(masked),
        "indices": lambda: SparseVector.from_coo(masked, vals, 5),
        "values": lambda: SparseVector.from_coo(idx, masked, 5),
    }[which]
    with pytest.raises(TypeError, match=f"{which}: a masked array with 1 of 3 entries masked"):
        build()
    unmasked = SparseVector.from_coo(np.ma.masked_array(idx), np.ma.masked_array(vals), 5)
    assert type(unmasked.values) is np.ndarray
    assert unmasked.to_dense().tolist() == [1, 0, 2, 0, 3]


@pytest.mark.parametrize("writeable", [True, False])
def test_from_coo_owns_its_arrays(writeable):
    """Input already coalesced (sorted, unique, of the index dtype) came back as is: the
    vector's arrays were the caller's, so writing to one changed the other, and a read-only
    input gave a read-only vector (unsorted input gave arrays of its own)."""
    idx = np.array([0, 2, 4], np.int32)
    vals = np.array([1.0, 2.0, 3.0], np.float32)
    idx.flags.writeable = vals.flags.writeable = writeable
    v = SparseVector.from_coo(idx, vals, 5)
    assert not np.shares_memory(v.values, vals) and not np.shares_memory(v.indices, idx)
    v.values *= 2
    v.indices[0] = 1
    assert vals.tolist() == [1, 2, 3] and idx.tolist() == [0, 2, 4]
    d = SparseVector.from_dense(vals)
    assert d.values.flags.writeable and not np.shares_memory(d.values, vals)
    torch = pytest.importorskip("torch")
    t = torch.tensor([1.0, 2.0])
    SparseVector.from_coo(torch.tensor([0, 3]), t, 4).values.mul_(2)
    assert t.tolist() == [1.0, 2.0]


@pytest.mark.parametrize(
    ("indices", "etype", "text"),
    [
        ([2**63, 1], ValueError, r"index 9223372036854775808 out of range \(indices lie"),
        ((1, -1, 2**64 - 1), ValueError, "index 18446744073709551615 out of range"),
        ([2**70], ValueError, "index 1180591620717411303424 out of range"),
        ([np.uint64(2**63), np.int64(-1)], ValueError, "index 9223372036854775808 out of"),
        ([1.0, 2], TypeError, "indices must be integers, got float64"),
        ([True, 2**70], ValueError, "index 1180591620717411303424 out of range"),
        ([True, 2**64], ValueError, "index 18446744073709551616 out of range"),
        ([np.True_, 2**63], ValueError, "index 9223372036854775808 out of range"),
        ([True, 2.5, 2**70], TypeError, "indices must be integers, got object"),
    ],
)
def test_integers_beyond_int64_in_a_list_are_out_of_range(indices, etype, text):
    """A list of integers one of which fits neither int64 nor uint64 is float64 to numpy
    (rounded) or object: it was refused as "indices must be integers, got float64", of
    integers (a TypeError, where an index out of range is a ValueError)."""
    with pytest.raises(etype, match=text):
        SparseVector.from_coo(indices, np.ones(len(indices)), 10)


def test_dlpack_only_host_arrays_are_taken():
    """numpy wraps such an object in a 0-d object array without raising, so the DLPack
    fallback never ran: "values must be 1-D, got shape ()"."""
    vals = np.array([1.0, 2.0, 3.0], np.float32)
    v = SparseVector.from_coo(DLPackOnly(np.array([4, 1, 4])), DLPackOnly(vals), 6)
    assert v.indices.tolist() == [1, 4] and v.values.tolist() == [2.0, 4.0]
    assert v.values.dtype == np.float32
    assert SparseVector.from_dense(DLPackOnly(vals)).to_dense().tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    ("indices", "values", "text"),
    [
        (None, [1.0], "indices must be an array, got NoneType"),
        ("0123", [1.0], "indices must be an array, got str"),
        ({1, 2}, [1.0], "indices must be an array, got set"),
        ([1], None, "values must be an array, got NoneType"),
        ([1], {1: 2.0}, "values must be an array, got dict"),
        ([1], b"\x00" * 8, "values must be an array, got bytes"),
        ([1], (x for x in [1.0]), "values must be an array, got generator"),
    ],
)
def test_what_numpy_only_wraps_is_not_an_array(indices, values, text):
    """numpy wraps None, a str, a set in a 0-d object or string array: refused as "values
    must be 1-D, got shape ()", a ValueError for what is a wrong type (TypeError, as
    docs/guide/api.md's table says of non-float values)."""
    with pytest.raises(TypeError, match=text):
        SparseVector.from_coo(indices, values, 3)


def test_a_bfloat16_tensor_is_refused_with_the_way_out():
    """numpy has no bfloat16: the error says to widen the tensor, rather than numpy's own
    message alone."""
    torch = pytest.importorskip("torch")
    vals = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"bfloat16.*widen it to float32 first"):
        SparseVector.from_coo(np.arange(3), vals, 8)


def test_a_tensor_numpy_refuses_for_another_reason_gets_no_widening_hint():
    """The hint 'widen it to float32 first' came with any float tensor numpy refused: a
    float32 sparse COO tensor (the natural thing to hand a sparse allreduce, as values or
    as indices), a negative view, bfloat16 indices. A sparse tensor now gets the way to
    pass its entries, which works; the others numpy's own message alone."""
    torch = pytest.importorskip("torch")
    t = torch.sparse_coo_tensor([[3, 1]], [2.0, 1.0], (8,), check_invariants=True)
    for indices, values in ((np.arange(2), t), (t, np.ones(2))):
        with pytest.raises(TypeError, match=r"layout sparse_coo.*t\.indices\(\)\[0\]") as info:
            SparseVector.from_coo(indices, values, 8)
        assert "widen" not in str(info.value)
    for indices, values in (
        (np.arange(2), torch.ones(2)._neg_view()),
        (torch.ones(2, dtype=torch.bfloat16), np.ones(2)),
    ):
        with pytest.raises(TypeError, match="numpy cannot take") as info:
            SparseVector.from_coo(indices, values, 8)
        assert "widen" not in str(info.value)
    c = t.coalesce()
    v = SparseVector.from_coo(c.indices()[0], c.values(), 8)
    assert v.to_dense().tolist() == [0, 1, 0, 2, 0, 0, 0, 0]


@pytest.mark.parametrize(
    ("n", "etype", "text"),
    [
        (5.5, TypeError, "n must be an integer, got float"),
        (5.0, TypeError, "n must be an integer, got float"),
        ("7", TypeError, "n must be an integer, got str"),
        (True, TypeError, "n must be an integer, got bool"),
        (-1, ValueError, "n must be non-negative, got -1"),
    ],
)
def test_the_plain_constructor_checks_n(n, etype, text):
    """SparseVector(indices, values, n) trusts its arrays, but int(n) made 5.5 a vector of
    length 5 (its to_dense() 5 long), "7" one of 7, True one of 1, silently."""
    with pytest.raises(etype, match=text):
        SparseVector(np.array([1]), np.array([2.0]), n)
    assert SparseVector(np.array([1]), np.array([2.0]), np.uint8(6)).to_dense().shape == (6,)


def test_to_dense_fills_out():
    """to_dense(out=) (as scipy's toarray(out=)) zeroes the given array, writes the entries
    and returns it, strided or a torch tensor too; an out holding the vector's own arrays
    is written correctly; a wrong shape, dtype, a read-only or a list is refused."""
    v = SparseVector.from_coo([4, 1, 4], [1.0, 2.0, 3.0], n=6)
    want = [0.0, 2.0, 0.0, 0.0, 4.0, 0.0]
    out = np.full(6, 9.0)
    assert v.to_dense(out=out) is out and out.tolist() == want
    grid = np.full((6, 2), 9.0)
    v.to_dense(out=grid[:, 1])
    assert grid[:, 1].tolist() == want and grid[:, 0].tolist() == [9.0] * 6
    buf = np.array([5.0, 6.0, 0.0, 0.0, 0.0])
    own = SparseVector(np.array([3, 4]), buf[:2], 5)
    assert own.to_dense(out=buf).tolist() == [0.0, 0.0, 0.0, 5.0, 6.0]
    read_only = np.zeros(6)
    read_only.flags.writeable = False
    for bad, etype, text in (
        (np.zeros(5), ValueError, r"shape \(6,\), got \(5,\)"),
        (np.zeros((6, 1)), ValueError, r"shape \(6,\), got \(6, 1\)"),
        (np.zeros(6, np.float32), TypeError, "must be float64 .* got float32"),
        (read_only, ValueError, "read-only"),
        ([0.0] * 6, TypeError, "array written in place"),
        # (elements that share memory: the last entry was left in every place, silently)
        (np.lib.stride_tricks.as_strided(np.zeros(1), (6,), (0,)), ValueError, "share memory"),
        (np.lib.stride_tricks.as_strided(np.zeros(4), (6,), (4,)), ValueError, "share memory"),
    ):
        with pytest.raises(etype, match=text):
            v.to_dense(out=bad)
    torch = pytest.importorskip("torch")
    t = SparseVector.from_coo(torch.tensor([4, 1]), torch.tensor([1.0, 2.0]), 6)
    out = torch.full((6,), 7.0)
    assert t.to_dense(out=out) is out and out.tolist() == [0.0, 2.0, 0.0, 0.0, 1.0, 0.0]
    out = torch.zeros(1).expand(6)  # (as torch's own in-place writes refuse it)
    with pytest.raises(ValueError, match="share memory"):
        t.to_dense(out=out)
    assert out.tolist() == [0.0] * 6
    one = SparseVector.from_coo([0], [3.0], 1)  # (one element: any stride is its own)
    assert one.to_dense(out=np.lib.stride_tricks.as_strided(np.zeros(1), (1,), (0,))).tolist() == [
        3.0
    ]


# -- row values: an index per row of D values ---------------------------------------------


@given(
    n=st.integers(1, 60),
    width=st.sampled_from([1, 3, 16]),
    data=st.data(),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
)
def test_coalesce_sums_repeated_rows(n, width, data, dtype):
    m = data.draw(st.integers(0, 100))
    idx = data.draw(hnp.arrays(np.int64, m, elements=st.integers(0, n - 1)))
    vals = data.draw(hnp.arrays(dtype, (m, width), elements=st.integers(-50, 50).map(float)))
    v = SparseVector.from_coo(idx, vals, n)
    assert v.width == width and v.row_shape == (width,) and v.shape == (n, width)
    assert v.values.shape == (v.nnz, width) and v.values.flags.c_contiguous
    assert np.all(np.diff(v.indices.astype(np.int64)) > 0)
    want = np.zeros((n, width))
    np.add.at(want, idx, vals.astype(np.float64))  # small integers: every sum is exact
    assert v.to_dense().shape == (n, width)
    assert np.array_equal(v.to_dense().astype(np.float64), want)
    assert v.indices.tolist() == np.unique(idx).tolist()  # a row summing to 0 stays


def test_rows_to_dense_from_dense_and_out():
    vals = np.arange(6, dtype=np.float32).reshape(3, 2)
    v = SparseVector.from_coo([4, 1, 4], vals, n=6)
    assert v.indices.tolist() == [1, 4]
    assert v.values.tolist() == [[2.0, 3.0], [4.0, 6.0]]
    dense = v.to_dense()
    assert dense.shape == (6, 2) and dense[4].tolist() == [4.0, 6.0] and dense[0].tolist() == [0, 0]
    out = np.full((6, 2), 7.0, np.float32)
    assert v.to_dense(out=out) is out and np.array_equal(out, dense)
    with pytest.raises(ValueError, match=r"shape \(6, 2\)"):
        v.to_dense(out=np.zeros(6, np.float32))
    with pytest.raises(ValueError, match="share memory"):
        v.to_dense(out=np.broadcast_to(np.zeros(2, np.float32), (6, 2)))
    # a dense (n, D) array: the rows holding a nonzero (-0.0 and 0 alone are no nonzero)
    back = SparseVector.from_dense(np.array([[0, 0], [0, -2.5], [-0.0, 0], [1, 0]], np.float64))
    assert back.indices.tolist() == [1, 3] and back.values.tolist() == [[0, -2.5], [1, 0]]
    assert repr(back) == "SparseVector(n=4, nnz=2, dtype=float64, width=2)"
    assert np.asarray(back).shape == (4, 2)


def test_empty_rows_and_scalar_width():
    e = SparseVector.empty(10, np.float16, width=4)
    assert e.values.shape == (0, 4) and e.width == 4 and e.to_dense().shape == (10, 4)
    s = SparseVector.empty(10)
    assert s.width is None and s.row_shape == () and s.shape == (10,)
    assert coalesce(np.zeros(0, np.int64), np.zeros((0, 3), np.float32), 5).values.shape == (0, 3)


def test_rows_through_torch_and_dlpack():
    torch = pytest.importorskip("torch")
    vals = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    v = SparseVector.from_coo(torch.tensor([2, 0, 2]), vals, 3)
    assert isinstance(v.values, torch.Tensor) and tuple(v.values.shape) == (2, 2)
    assert v.to_dense().tolist() == [[3.0, 4.0], [0.0, 0.0], [6.0, 8.0]]
    d = SparseVector.from_coo(DLPackOnly(np.array([1, 1])), DLPackOnly(vals.numpy()[:2]), 3)
    assert d.values.tolist() == [[4.0, 6.0]]
