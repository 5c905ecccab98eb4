"""The training step's Numba kernels: the fused error-feedback pass, its hits' top-k, the update."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba import types as nbtypes
from numba.core import cgutils
from numba.extending import intrinsic

from .._jit import cached_njit
from ._numba_core import CHUNKS_PER_THREAD, _bounds, _ctz, _kernels, _keys, _parallel, _run, _u
from ._numba_select import _select_rank

__all__ = ["Buckets", "accumulate", "finish_step", "topk_hits", "write_dense"]

LANES = 8  # elements per vector step of the fused pass (8 mask bits)
BAD = 2 * LANES  # where the non-finite bits start in its mask (the nonzero bits: at LANES)
NT_ALIGN = 32  # bytes: where the pass's streaming (non-temporal) vector stores must start


@intrinsic
def _fused_lanes(
    typingctx, g, r, u, uo, m, acc, z, i, cut, nt, zt, zh, zc, tmp, t, nz
):  # pragma: no cover
    """LANES elements from i, as vectors: ``uo = m·u + g`` (with u), ``acc = (uo or g) +
    r`` (also into ``tmp[t:t + LANES]``, a scratch row in cache that the copy loop reads:
    acc itself may have bypassed the cache), ``z = 0`` (with z); returns a bit mask, bit j
    for |acc[i+j]| >= cut, bit BAD + j for a non-finite acc[i+j] and, with ``nz`` (an
    array or None: only its type is read), bit LANES + j for acc[i+j] != 0 (NaN included,
    as np.count_nonzero counts); with ``zh`` (zero hits) acc gets 0 where bit j is set and
    |acc[i+j]| >= zc (tmp keeps the value). Every load comes before any store, so ``acc``
    may be ``r`` and ``z`` may be ``g``. With ``nt`` the stores to uo and acc are
    non-temporal (streaming, NT_ALIGN-aligned addresses required), and
    with ``zt`` those to z: a written line is not read first, so the pass moves a quarter
    less memory than ``np.add`` does. (z = g is zeroed by plain stores: its lines are in
    cache, just read, and streaming stores to them made a whole step 1.6x slower.) Written as
    LLVM vector code because the compare-to-mask step (one movmsk) is what LLVM's loop
    vectorizer does not find in a scalar loop: that loop ran at half the memory bandwidth."""
    has_u = not isinstance(u, nbtypes.NoneType)
    has_z = not isinstance(z, nbtypes.NoneType)
    has_nz = not isinstance(nz, nbtypes.NoneType)
    flag_t = nbtypes.boolean
    idx_t = nbtypes.intp
    sig = nbtypes.uint32(
        g, r, u, uo, m, acc, z, idx_t, cut, flag_t, flag_t, flag_t, cut, tmp, idx_t, nz
    )

    def codegen(context, builder, signature, args):
        ga, ra, ua, uoa, mv, aa, za, idx, cv, ntf, ztf, zhf, zcv, ta, toff, _ = args
        ty = signature.args
        fty = context.get_value_type(ty[0].dtype)
        vty = ir.VectorType(fty, LANES)
        i32 = ir.IntType(32)
        flag = builder.module.add_metadata([i32(1)])

        def ptr(value, aty, at=idx):
            data = context.make_array(aty)(context, builder, value).data
            return builder.bitcast(builder.gep(data, [at]), vty.as_pointer())

        def splat(x):
            xty = ir.VectorType(x.type, LANES)
            v = builder.insert_element(ir.Constant(xty, ir.Undefined), x, i32(0))
            lanes = ir.Constant(ir.VectorType(i32, LANES), [0] * LANES)
            return builder.shuffle_vector(v, v, lanes)

        stores = []
        gv = builder.load(ptr(ga, ty[0]), align=1)
        rv = builder.load(ptr(ra, ty[1]), align=1)
        if has_u:
            uv = builder.load(ptr(ua, ty[2]), align=1)
            gv = builder.fadd(builder.fmul(splat(mv), uv), gv)  # no contraction: as numpy
            stores.append((gv, ptr(uoa, ty[3])))
        av = builder.fadd(gv, rv)
        width = 32 if isinstance(fty, ir.FloatType) else 64
        fabs = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vty, [vty]), f"llvm.fabs.v{LANES}f{width}"
        )
        mag = builder.call(fabs, [av])
        hit = builder.fcmp_ordered(">=", mag, splat(cv))
        zero = ir.Constant(vty, None)
        zap = builder.and_(
            builder.and_(hit, splat(zhf)), builder.fcmp_ordered(">=", mag, splat(zcv))
        )
        stores.append((builder.select(zap, zero, av), ptr(aa, ty[5])))
        builder.store(av, ptr(ta, ty[13], toff), align=1)

        def store(value, where, streaming):
            with builder.if_else(streaming) as (nt_store, plain):  # loop-invariant flags:
                with nt_store:  # LLVM unswitches the loop
                    builder.store(value, where, align=NT_ALIGN).set_metadata("nontemporal", flag)
                with plain:
                    builder.store(value, where, align=1)

        for value, where in stores:
            store(value, where, ntf)
        if has_z:
            store(zero, ptr(za, ty[6]), ztf)
        diff = builder.fsub(av, av)  # NaN exactly where av is NaN or infinite
        bad = builder.fcmp_unordered("uno", diff, diff)
        bits = ir.IntType(LANES)
        hits = builder.zext(builder.bitcast(hit, bits), i32)
        bads = builder.zext(builder.bitcast(bad, bits), i32)
        out = builder.or_(hits, builder.shl(bads, i32(BAD)))
        if has_nz:
            nonzero = builder.fcmp_unordered("!=", av, zero)
            nonzero = builder.zext(builder.bitcast(nonzero, bits), i32)
            out = builder.or_(out, builder.shl(nonzero, i32(LANES)))
        return out

    return sig, codegen


@intrinsic
def _popcount(typingctx, x):  # pragma: no cover - compiled
    """The set bits of a uint64 (LLVM's ctpop)."""
    sig = nbtypes.int64(nbtypes.uint64)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        ctpop = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i64, [i64]), "llvm.ctpop.i64"
        )
        return builder.call(ctpop, [args[0]])

    return sig, codegen


@njit(inline="always")
def _count_in(word, b0, span, lo, hi):  # pragma: no cover - compiled
    # the set bits j of word with lo <= b0 + j < hi (word: span bits from position b0)
    if lo <= b0 and b0 + span <= hi:
        return _popcount(word)
    count = 0
    while word:
        j = _ctz(word)
        word &= word - np.uint64(1)
        count += lo <= b0 + j and b0 + j < hi
    return count


@intrinsic
def _store_fence(typingctx):  # pragma: no cover - compiled
    """A full memory fence: streaming stores are weakly ordered, so a thread that made
    some fences them before anyone (another thread, MPI) reads what they wrote."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return nbtypes.void(), codegen


BUCKETS = 4096  # histogram bins of the pass's hits: [cut, 2·cut) in BUCKETS - 1 equal
# steps, the last bin everything above


@njit(inline="always")
def _bin(v, cut, scale):  # pragma: no cover - compiled
    # the histogram bin of a hit v (|v| >= cut): the pass and topk_hits must agree exactly
    f = (abs(np.float64(v)) - cut) * scale
    return int(f) if f < BUCKETS - 1 else BUCKETS - 1


@njit(inline="always")
def _take_hits(word, b0, span, lo, hi, tmp, acc, zh, out_idx, out_val, p, end):  # pragma: no cover
    # append the positions b0 + j of word's set bits (and their values, tmp[j]) that lie
    # in [lo, hi); with zh, those outside get their values back in acc
    if not zh and (b0 >= hi or b0 + span <= lo):
        return p
    inside = lo <= b0 and b0 + span <= hi
    while word:
        j = _ctz(word)
        word &= word - np.uint64(1)
        i = b0 + j
        v = tmp[j]
        if inside or (lo <= i and i < hi):
            # (written out here: a helper function taking the arrays cost 80 ns a hit)
            if p < end:
                out_idx[p] = i
                out_val[p] = v
            elif zh:  # not recorded: its value back
                acc[i] = v
            p += 1
        elif zh:
            acc[i] = v
    return p


TAKES = 4  # hits of a 64-block stored without a branch (the rest, rare, by the loop)


@njit(inline="always")
def _take_first(word, b0, tmp, out_idx, out_val, p):  # pragma: no cover - compiled
    # store the lowest TAKES set bits' positions and values at p, p + 1, ... whether or not
    # there are that many (the slots past the hits are scratch: the caller checked that
    # 64 slots are free); returns (p moved past the hits stored, the bits left). Whether a
    # 64-block has 0, 1 or 2 hits is a coin toss at the reducer's ~1.6% hits: the branches
    # of a loop over its set bits mispredict about once a block (bench/pass_hits.py).
    for _ in range(TAKES):
        j = _ctz(word) & 63  # (cttz(0) is 64)
        out_idx[p] = b0 + j
        out_val[p] = tmp[j]
        p += word != 0
        word &= word - np.uint64(1)
    return p, word


@njit(inline="always")
def _fused_scalar(
    g, r, u, uo, m, acc, z, cut, zh, zc, lo, hi, s, e, tmp, out_idx, out_val, p, end, nz
):  # pragma: no cover
    # elements s..e-1 one by one (a chunk's ends); returns (p, non-finite seen, the nonzeros
    # in [lo, hi) when nz is not None)
    flag = np.uint32(0)
    count = 0
    for i in range(s, e):
        if u is None:
            a = g[i] + r[i]
        else:
            v = m * u[i] + g[i]
            uo[i] = v
            a = v + r[i]
        hit = abs(a) >= cut
        acc[i] = 0 if zh and hit and abs(a) >= zc else a
        if z is not None:
            z[i] = 0
        flag |= np.uint32((a - a) != 0)
        if nz is not None:
            count += a != 0 and lo <= i and i < hi
        if hit:
            tmp[0] = a
            p = _take_hits(np.uint64(1), i, 1, lo, hi, tmp, acc, zh, out_idx, out_val, p, end)
    return p, flag, count


@_kernels()
def _accumulate(
    g, r, u, uo, m, acc, z, cut, far, lo, hi, nt, zt, zh, zc, base, bounds, starts, caps,
    out_idx, out_val, counts, bad, nz,
):  # pragma: no cover - compiled  # fmt: skip
    # One pass over chunk c: uo = m·u + g (momentum, when u is not None), acc = (uo or g)
    # + r, z = 0 (when z is not None), and the index and value of each acc[i] with
    # |acc[i]| >= cut and lo <= i < hi written to out[starts[c]:] while caps[c] slots last
    # (counting on after); bad[c] counts non-finite acc. Optional arrays are None, so Numba
    # compiles each combination without the branch. Vector code does LANES elements at a
    # time and returns their hits as a bit mask; eight masks make a 64-bit word, and the
    # copy loop visits a word's set bits only (a branch per 8 elements, taken at random a
    # few percent of the time, cost more than the memory traffic). Non-finite values only
    # raise a flag; the rare chunk that has one is counted again. With nt (streaming
    # stores) the elements before the first NT_ALIGN-aligned one (``base``: acc's address
    # mod NT_ALIGN) go one by one, as do the last < 8; the last < 64 go by 8. Blocks of
    # 8 or 64 wholly outside [lo, hi) compare with ``far`` (inf) instead of cut: no hits
    # there to visit and drop (nor, with zh, values zeroed to give back by scattered
    # writes into lines just streamed out). With nz (not None), nz[c] counts the nonzero
    # acc[i] in [lo, hi) (before zh zeroes them): one more compare per LANES elements.
    size = acc.itemsize
    for c in prange(bounds.shape[0] - 1):
        s = bounds[c]
        e = bounds[c + 1]
        head = 0
        if nt:
            head = min(e - s, ((NT_ALIGN - (base + s * size) % NT_ALIGN) % NT_ALIGN) // size)
        p = starts[c]
        end = p + caps[c]
        tmp = np.empty(64, acc.dtype)
        p, flag, nonzeros = _fused_scalar(
            g, r, u, uo, m, acc, z, cut, zh, zc, lo, hi, s, s + head, tmp,
            out_idx, out_val, p, end, nz,
        )  # fmt: skip
        s1 = s + head
        e64 = s1 + (e - s1) // 64 * 64
        e8 = s1 + (e - s1) // LANES * LANES
        # the 64-blocks from s1: [q1, q2) are those that overlap [lo, hi)
        nb = (e64 - s1) // 64
        q1 = min(max(0, -((s1 + 63 - lo) // 64)), nb)
        q2 = min(max(q1, -((s1 - hi) // 64)), nb)
        for seg in range(3):  # before, overlapping, after: a cut fixed in each loop
            cb = cut if seg == 1 else far
            first = s1 + 64 * (0 if seg == 0 else q1 if seg == 1 else q2)
            last = s1 + 64 * (q1 if seg == 0 else q2 if seg == 1 else nb)
            for b0 in range(first, last, 64):
                word = np.uint64(0)
                nzw = np.uint64(0)
                for q in range(64 // LANES):
                    t = q * LANES
                    mask = _fused_lanes(
                        g, r, u, uo, m, acc, z, b0 + t, cb, nt, zt, zh, zc, tmp, t, nz
                    )  # fmt: skip
                    word |= np.uint64(mask & np.uint32(255)) << np.uint64(t)
                    flag |= mask >> np.uint32(BAD)
                    if nz is not None:
                        bits = np.uint64((mask >> np.uint32(LANES)) & np.uint32(255))
                        nzw |= bits << np.uint64(t)
                if nz is not None and seg == 1:
                    nonzeros += _count_in(nzw, b0, 64, lo, hi)
                if seg == 1 and lo <= b0 and b0 + 64 <= hi and p + 64 <= end:
                    p, word = _take_first(word, b0, tmp, out_idx, out_val, p)
                if word:
                    p = _take_hits(
                        word, b0, 64, lo, hi, tmp, acc, zh, out_idx,
                        out_val, p, end,
                    )  # fmt: skip
        for b0 in range(e64, e8, LANES):
            cb = cut if b0 < hi and b0 + LANES > lo else far
            mask = _fused_lanes(g, r, u, uo, m, acc, z, b0, cb, nt, zt, zh, zc, tmp, 0, nz)
            flag |= mask >> np.uint32(BAD)
            if nz is not None:
                nzw = np.uint64((mask >> np.uint32(LANES)) & np.uint32(255))
                nonzeros += _count_in(nzw, b0, LANES, lo, hi)
            word = np.uint64(mask & np.uint32(255))
            if word:
                p = _take_hits(
                    word, b0, LANES, lo, hi, tmp, acc, zh, out_idx,
                    out_val, p, end,
                )  # fmt: skip
        p, tail, last = _fused_scalar(
            g, r, u, uo, m, acc, z, cut, zh, zc, lo, hi, e8, e, tmp,
            out_idx, out_val, p, end, nz,
        )  # fmt: skip
        if nt:
            _store_fence()
        nbad = 0
        if flag | tail:
            for i in range(s, e):
                nbad += (acc[i] - acc[i]) != 0
            if zh:  # infinite hits recorded were zeroed in acc (inf >= zc)
                for q in range(starts[c], min(p, end)):
                    nbad += (out_val[q] - out_val[q]) != 0
        counts[c] = p - starts[c]
        bad[c] = nbad
        if nz is not None:
            nz[c] = nonzeros + last


PAGE = 4096  # bytes: the L1 data cache's set index lies within a page's offset


def _scratch(
    workspace: dict | None, name: str, size: int, dtype: Any, apart: np.ndarray | None = None
) -> np.ndarray:
    """An empty array of ``size`` elements: ``workspace[name]`` (or its start) when that is
    large enough, else a new one, kept there. Reusing the last step's memory saves the page
    faults of fresh memory (one per 4 KiB written: over a thousand a step at k = 168K, 2-3 ms
    of a 10 ms step in docs/reports/benchmarks.md), which malloc may or may not avoid by itself.
    With ``apart``, the array starts half a page from it (address mod PAGE): the pass
    writes both at the same running position, and two large arrays from malloc start at
    the same page offset, so those writes met in one L1 set. In some processes (chosen by
    where the arrays landed) that cost the pass 1.4x its time (docs/reports/benchmarks.md § 4)."""
    pad = PAGE // np.dtype(dtype).itemsize if apart is not None else 0
    a = workspace.get(name) if workspace is not None else None
    if a is None or a.dtype != dtype or a.shape[0] < size + pad:
        a = np.empty(size + pad, dtype)
        if workspace is not None:
            workspace[name] = a
    if apart is None:
        return a[:size]
    want = (apart.ctypes.data + PAGE // 2 - a.ctypes.data) % PAGE
    skip = want // a.itemsize  # (malloc's arrays start at a multiple of the itemsize)
    return a[skip : skip + size]


def _streaming_ok(acc: np.ndarray, *others: Any) -> tuple[bool, int]:
    """Whether the pass may use streaming stores (every written array at the same address
    offset mod NT_ALIGN as acc, element-aligned), and acc's offset."""
    base = acc.ctypes.data % NT_ALIGN
    ok = base % acc.itemsize == 0 and all(
        a.ctypes.data % NT_ALIGN == base for a in others if a is not None
    )
    return ok, base


def accumulate(
    g, r, u, uo, m, acc, z, cut, lo, hi, cap, itype, zero_cut=math.inf, buckets=False,
    workspace=None, nonzeros=False,
):  # fmt: skip
    """The fused pass (see ``sparsecoll.select.accumulate``); float16 goes to numpy (Numba
    has no float16 arithmetic). With ``buckets``, the recorded hits' histogram over
    ``|value|`` (``Buckets``) comes back too, for :func:`topk_hits`. ``workspace``: a dict
    whose arrays hold the hits (kept there for the next call). With ``nonzeros``, the
    nonzeros of ``acc[lo:hi]`` (before the pass zeroes any) come back last, counted in
    the pass."""
    if g.dtype == np.float16:
        from . import _numpy

        return _numpy.accumulate(
            g, r, u, uo, m, acc, z, cut, lo, hi, cap, itype, zero_cut, nonzeros=nonzeros
        )
    n = g.shape[0]
    dt = g.dtype.type
    # one chunk on one thread: its hits come back as a slice, with no concatenation
    bounds = _bounds(n, CHUNKS_PER_THREAD if _parallel(n) else 1)
    parts = bounds.shape[0] - 1
    # each chunk's room: all it could hold (np.empty reserves address space; only the pages
    # written are ever touched), so no chunk overflows unless the whole cap does
    overlap = np.clip(np.minimum(bounds[1:], hi) - np.maximum(bounds[:-1], lo), 0, None)
    room = np.minimum(overlap, cap)
    starts = np.zeros(parts, np.int64)
    np.cumsum(room[:-1], out=starts[1:])
    out_idx = _scratch(workspace, "indices", int(room.sum()), itype)
    out_val = _scratch(workspace, "values", out_idx.shape[0], g.dtype, apart=out_idx)
    counts = np.empty(parts, np.int64)
    bad = np.empty(parts, np.int64)
    nz = np.empty(parts, np.int64) if nonzeros else None
    if r is None:  # the kernel always adds a residual: a zero one (pages never written)
        r = np.zeros_like(g)
    nt, base = _streaming_ok(acc, uo)
    # a zero buffer that is g is stored to plainly (its lines were just read into cache)
    zt = nt and z is not None and _streaming_ok(acc, z)[0] and not np.may_share_memory(z, g)
    zh = zero_cut < math.inf
    _run(
        _accumulate, n, g, r, u, uo, dt(m), acc, z, dt(cut), dt(math.inf), np.int64(lo),
        np.int64(hi), nt, zt, zh, dt(zero_cut if zh else 0), np.int64(base), bounds,
        starts, room, out_idx, out_val, counts, bad, nz,
    )  # fmt: skip
    count = int(nz.sum()) if nonzeros else None
    hits = int(counts.sum())
    nbad = int(bad.sum())
    kept = np.minimum(counts, room)
    if hits > cap or np.any(counts > room):  # the room ran out: nothing is selected
        if zh:  # the recorded hits get their values back
            for a, h in zip(starts.tolist(), kept.tolist()):
                acc[out_idx[a : a + h]] = out_val[a : a + h]
        return out_idx[:0], out_val[:0], hits, nbad, None, count
    if parts == 1:
        idx, val = out_idx[:hits], out_val[:hits]
    else:
        pieces = [slice(a, a + h) for a, h in zip(starts.tolist(), counts.tolist())]
        idx = np.concatenate([out_idx[c] for c in pieces])
        val = np.concatenate([out_val[c] for c in pieces])
    found = None
    if buckets and 0 < cut < math.inf:
        # counted after the pass, over the hits it wrote: a counter per hit inside the
        # pass slowed it more (docs/reports/benchmarks.md)
        hcut = float(dt(cut))  # the value the pass compared with
        hscale = (BUCKETS - 1) / hcut
        hist = np.zeros(BUCKETS, np.int64)
        _bucket_counts(val, hcut, hscale, hist)
        found = Buckets(hist, hcut, hscale)
    return idx, val, hits, nbad, found, count


@cached_njit(nogil=True)
def _bucket_counts(vals, cut, scale, hist):  # pragma: no cover - compiled
    for i in range(vals.shape[0]):
        hist[_bin(vals[i], cut, scale)] += 1


class Buckets(NamedTuple):
    """A histogram of a pass's hits over |value|: ``counts[b]`` hits with
    ``int((|v| - cut)·scale) == b`` (the last bin: all from there up)."""

    counts: np.ndarray
    cut: float
    scale: float


@cached_njit(nogil=True)
def _bucket_keys(vals, bits, mask, cut, scale, want, out):  # pragma: no cover - compiled
    # the keys of the values in bucket ``want`` (as the pass binned them), in out[:count]
    q = 0
    for i in range(vals.shape[0]):
        if _bin(vals[i], cut, scale) == want:
            out[q] = bits[i] & mask
            q += 1
    return q


def topk_hits(idx: np.ndarray, vals: np.ndarray, found: Buckets, k: int):
    """The top-k of a pass's hits (1 <= k <= len(vals), no NaN): their global indices,
    ascending, their values, and a mask over the hits marking them. The pass's histogram
    names the bin holding the k-th largest |value|; only that bin's keys are ranked, then
    one scatter takes the k. None when the k-th lies in the open top bin (the cut was far
    below it)."""
    counts = found.counts
    above = np.cumsum(counts[::-1])[::-1]  # above[b]: hits in bins b and up
    want = int(np.searchsorted(-above, -k, side="right")) - 1  # last bin with above >= k
    if want >= BUCKETS - 1:
        return None
    b, info = _keys(vals)
    keys = np.empty(int(counts[want]), info.utype)
    got = _bucket_keys(vals, b, _u(info, info.mask), found.cut, found.scale, want, keys)
    assert got == keys.shape[0]
    keys[::-1].sort()  # descending
    need = k - int(above[want + 1])  # taken from this bin
    kth = keys[need - 1]
    taken = np.zeros(b.shape[0], np.bool_)
    if _parallel(b.shape[0]):
        out_idx, out_bits = _select_rank(b, info, int(kth), k, idx, idx.dtype, taken)
        return out_idx, out_bits.view(vals.dtype), taken
    gt = int(above[want + 1]) + int(np.count_nonzero(keys > kth))
    out_idx = np.empty(k + 1, idx.dtype)  # one slot past k: every key is written, p advances
    out_bits = np.empty(k + 1, info.utype)
    got = _take_top(b, idx, _u(info, info.mask), kth, k - gt, out_idx, out_bits, taken)
    assert got == k
    return out_idx[:k], out_bits[:k].view(vals.dtype), taken


@cached_njit(nogil=True)
def _take_top(bits, src, mask, kth, quota, out_idx, out_bits, taken):  # pragma: no cover
    # keys above kth and the first ``quota`` equal to it, in order, without a branch on
    # whether a key is taken (about half the candidates are, at random): every key is
    # written at p and p advances when it is taken. 2.7x faster than _scatter_gt_eq's
    # blocks on candidates. Ties with kth are rare: a branch, predicted not taken.
    p = 0
    q = quota
    for i in range(bits.shape[0]):
        key = bits[i] & mask
        take = key > kth
        if key == kth:
            take = q > 0
            q -= take
        out_idx[p] = src[i]
        out_bits[p] = bits[i]
        taken[i] = take
        p += take
    return p


@cached_njit(nogil=True)
def _finish_step(
    acc, vel, sent, update, old, idx, vals, divisor, cand, cval, zc, want, dropped
):  # pragma: no cover - compiled
    if dropped:  # acc[sent] is 0 already
        pass
    elif cand is None:  # resolved at compile time (typed None or an array), as vel
        for i in range(sent.shape[0]):
            acc[sent[i]] = 0
    else:  # acc is 0 at the candidates with |value| >= zc: make it 0 where want says
        # (sent). The candidates zeroed wrongly are listed first without a branch on the
        # data, then only those are written: a branch per candidate mispredicted often.
        fix = np.empty(cand.shape[0], np.int64)
        p = 0
        for q in range(cand.shape[0]):
            fix[p] = q
            p += want[q] != (abs(cval[q]) >= zc)
        for f in range(p):
            q = fix[f]
            acc[cand[q]] = 0 if want[q] else cval[q]
    if vel is not None:
        for i in range(sent.shape[0]):
            vel[sent[i]] = 0
    if old is not None:
        for i in range(old.shape[0]):
            update[old[i]] = 0
    if divisor == 1:
        for j in range(idx.shape[0]):
            update[idx[j]] = vals[j]
    else:
        for j in range(idx.shape[0]):
            update[idx[j]] = vals[j] / divisor


def finish_step(
    acc, vel, sent, update, old, idx, vals, divisor: int, zeroed=None, dense=False,
    dropped=False,
) -> None:  # fmt: skip
    """A training step's O(k) fix-ups (see ``sparsecoll.training._finish``); with ``dense``
    the update is written whole (it was not zeroed: :func:`write_dense`); with ``dropped``
    ``acc[sent]`` is 0 already."""
    dt = acc.dtype.type
    cand, cval, zc, want = (None, None, 0.0, None) if zeroed is None else zeroed
    vals = vals.astype(acc.dtype, copy=False)
    scatter = idx[:0] if dense else idx
    _finish_step(
        acc, vel, sent, update, old, scatter, vals, dt(divisor), cand, cval, dt(zc), want,
        bool(dropped),
    )  # fmt: skip
    if dense:
        write_dense(update, idx, vals, divisor)


SEGMENT = 4096  # elements of the update built in cache, then stored in one run


@intrinsic
def _copy_lanes(typingctx, dst, i, src, t, nt):  # pragma: no cover - compiled
    """``dst[i:i + LANES] = src[t:t + LANES]`` as one vector; with ``nt`` a streaming store
    (``dst``'s address at i NT_ALIGN-aligned)."""
    sig = nbtypes.void(dst, nbtypes.intp, src, nbtypes.intp, nbtypes.boolean)

    def codegen(context, builder, signature, args):
        da, di, sa, si, ntf = args
        ty = signature.args
        vty = ir.VectorType(context.get_value_type(ty[0].dtype), LANES)

        def ptr(value, aty, at):
            data = context.make_array(aty)(context, builder, value).data
            return builder.bitcast(builder.gep(data, [at]), vty.as_pointer())

        v = builder.load(ptr(sa, ty[2], si), align=1)
        where = ptr(da, ty[0], di)
        flag = builder.module.add_metadata([ir.IntType(32)(1)])
        with builder.if_else(ntf) as (nt_store, plain):
            with nt_store:
                builder.store(v, where, align=NT_ALIGN).set_metadata("nontemporal", flag)
            with plain:
                builder.store(v, where, align=1)
        return context.get_dummy_value()

    return sig, codegen


@_kernels()
def _write_dense(update, idx, vals, divisor, bounds, first, base, nt):  # pragma: no cover
    # update[bounds[c]:bounds[c + 1]] = 0 except update[idx[j]] = vals[j] / divisor for the
    # idx[first[c]:first[c + 1]] (ascending) in that range: SEGMENT elements at a time are
    # built in a zeroed scratch row in cache (the values scattered in, then zeroed again)
    # and stored in one vector run, streaming with nt from the first NT_ALIGN-aligned
    # element. Each line of the update is written once and never read; zeroing it and
    # scattering k values into it afterwards read ~k random lines back from memory.
    size = update.itemsize
    for c in prange(bounds.shape[0] - 1):
        s = bounds[c]
        e = bounds[c + 1]
        j = first[c]
        stop = first[c + 1]
        head = 0
        if nt:
            head = min(e - s, ((NT_ALIGN - (base + s * size) % NT_ALIGN) % NT_ALIGN) // size)
        for i in range(s, s + head):
            update[i] = 0
        while j < stop and idx[j] < s + head:
            update[idx[j]] = vals[j] if divisor == 1 else vals[j] / divisor
            j += 1
        tmp = np.zeros(SEGMENT, update.dtype)
        for a in range(s + head, e, SEGMENT):
            b = min(a + SEGMENT, e)
            j0 = j
            while j < stop and idx[j] < b:
                tmp[idx[j] - a] = vals[j] if divisor == 1 else vals[j] / divisor
                j += 1
            whole = (b - a) // LANES * LANES
            for t in range(0, whole, LANES):
                _copy_lanes(update, a + t, tmp, t, nt)
            for t in range(whole, b - a):
                update[a + t] = tmp[t]
            for q in range(j0, j):
                tmp[idx[q] - a] = 0
        if nt:
            _store_fence()


@cached_njit(nogil=True)
def _ascending(x):  # pragma: no cover - compiled
    # strictly ascending (a numpy comparison allocates k booleans: page faults every step);
    # counted without a branch, so that it vectorizes
    bad = 0
    for i in range(1, x.shape[0]):
        bad += x[i] <= x[i - 1]
    return bad == 0


def write_dense(update: np.ndarray, idx: np.ndarray, vals: np.ndarray, divisor: int) -> None:
    """``update[...] = 0; update[idx] = vals / divisor`` (``vals`` in update's dtype, divided
    only when divisor != 1) for strictly ascending ``idx``, writing each element once: one
    streaming pass instead of a zeroing pass and ~k random writes that read their lines
    back. Unsorted ``idx`` fall back to exactly that."""
    dt = update.dtype.type
    if not _ascending(idx):
        update[...] = 0
        update[idx] = vals / dt(divisor) if divisor != 1 else vals
        return
    n = update.shape[0]
    bounds = _bounds(n, CHUNKS_PER_THREAD if _parallel(n) else 1)
    # where each chunk's indices start (bounds in idx's dtype: a wider key casts all of idx)
    inner = bounds[1:-1].astype(idx.dtype)  # < n: fits
    first = np.empty(bounds.shape[0], np.int64)
    first[0], first[-1] = 0, idx.shape[0]
    first[1:-1] = np.searchsorted(idx, inner)
    nt, base = _streaming_ok(update)
    _run(_write_dense, n, update, idx, vals, dt(divisor), bounds, first, np.int64(base), nt)
