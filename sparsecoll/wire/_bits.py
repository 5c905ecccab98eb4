"""Bit-stream kernels: word-at-a-time bit I/O, small fields, bit-packed offsets, bitmaps.

Streams are little-endian uint64 words, bit ``b`` of the stream in word ``b >> 6`` at bit
``b & 63``. Writers are branchless: :func:`_put` stores the pending word on every call, so
every word a stream covers is written (buffers need no zeroing). Readers get two words of
slack past a stream's last word, so a two-word read never leaves the array. Every count,
position and shift is held in int64 or uint64 and never mixed (Numba would widen the mix
to float64).

Fixed-width fields of r < 8 bits go through :func:`swar_pack`: eight at a time, from one
byte each (BMI2's pext and pdep where Numba compiles for a CPU that has them, else shifts
and masks), so a field costs a few word operations and no bit-at-a-time loop.
"""

from __future__ import annotations

import os
import platform

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .._jit import cached_njit

try:  # LLVM's cttz / ctlz (the bit width for 0)
    from numba.cpython.unsafe.numbers import leading_zeros as _clz
    from numba.cpython.unsafe.numbers import trailing_zeros as _ctz
except ImportError:  # pragma: no cover - a Numba without them

    @cached_njit(inline="always")
    def _ctz(x):
        if x == 0:
            return 64
        j = 0
        while not (x >> np.uint64(j)) & np.uint64(1):
            j += 1
        return j

    @cached_njit(inline="always")
    def _clz(x):
        j = 0
        while j < 64 and not (x >> np.uint64(63 - j)) & np.uint64(1):
            j += 1
        return j


def _host_bmi2() -> bool:
    """Whether Numba compiles for an x86-64 CPU with BMI2 (pext, pdep)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if os.environ.get("NUMBA_CPU_NAME", "host") != "host":
        return False  # (a named target CPU: features not the host's)
    if _slow_bmi2():
        return False
    try:
        import llvmlite.binding as llb

        return bool(llb.get_host_cpu_features().get("bmi2"))
    except Exception:  # pragma: no cover - no feature query on this platform
        return False


def _slow_bmi2() -> bool:
    """AMD before Zen 3 (family 0x17 and older) runs pext and pdep in microcode, tens to
    hundreds of cycles each: shifts are faster there."""
    try:
        with open("/proc/cpuinfo") as f:
            head = f.read(4096)
    except OSError:
        return False
    fields = dict(
        (k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in head.splitlines())
    )
    family = fields.get("cpu family", "")
    return fields.get("vendor_id") == "AuthenticAMD" and family.isdigit() and int(family) < 0x19


BMI2 = _host_bmi2()  # (read by the kernels at compile time: one branch is compiled)


def _bmi2_intrinsic(name: str):
    @intrinsic
    def bmi2(typingctx, a, b):
        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(64)])
            return builder.call(builder.module.declare_intrinsic(name, fnty=fnty), args)

        return types.uint64(types.uint64, types.uint64), codegen

    return bmi2


_pext = _bmi2_intrinsic("llvm.x86.bmi.pext.64")  # bits of a under mask b, packed low
_pdep = _bmi2_intrinsic("llvm.x86.bmi.pdep.64")  # low bits of a spread to mask b


@intrinsic
def _popcount(typingctx, src):
    """LLVM's ctpop: the one bits of an integer."""
    if not isinstance(src, types.Integer):  # pragma: no cover - typing only
        return None

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return src(src), codegen


__all__ = ["SLACK", "_clz", "_ctz", "_peek", "_popcount", "_put", "group_words", "nwords",
           "ones", "swar_pack", "swar_unpack"]  # fmt: skip

SLACK = 2  # words a reader may touch past a stream's last word
BLOCK = 4096  # one-bit positions gathered at a time
ONE = np.uint64(1)
Z = np.uint64(0)


@cached_njit(inline="always")
def nwords(nbits):
    """Words a stream of nbits bits takes (counted without overflow near 2**63: a bitmap's
    span may be that long)."""
    return (nbits >> 6) + ((nbits & 63) != 0)


@cached_njit(inline="always")
def _peek(words, pos, nb):
    """The nb (<= 64) bits of ``words`` at bit pos (int64 >= 0)."""
    i = np.uint64(pos) >> np.uint64(6)
    off = np.uint64(pos) & np.uint64(63)
    v = (words[i] >> off) | ((words[i + ONE] << ONE) << (np.uint64(63) - off))
    if nb < 64:
        v &= (ONE << np.uint64(nb)) - ONE
    return v


@cached_njit(inline="always")
def _put(words, wi, acc, fill, val, nb):
    """Append the nb (0..64) low bits of val (< 2**nb) at word wi, of which fill bits are
    used by acc (all uint64, fill < 64); store the pending word, return (wi, acc, fill)."""
    out = acc | (val << fill)
    words[wi] = out
    nf = fill + nb
    full = nf >= np.uint64(64)
    carry = (val >> ONE) >> (np.uint64(63) - fill)
    return wi + np.uint64(full), carry if full else out, nf & np.uint64(63)


@cached_njit(inline="always")
def group_words(m, r):
    """Words of :func:`swar_pack`'s stream for m values of r bits (kernels call it too)."""
    return (((m + 7) >> 3) * 8 * r + 63) >> 6


@cached_njit(inline="always")
def _squeeze(e, s1, s2, s3):
    """The r low bits of each byte of e, back to back (s1, s2, s3: 8 − r, 16 − 2r, 32 − 4r)."""
    e = (e & np.uint64(0x00FF00FF00FF00FF)) | ((e & np.uint64(0xFF00FF00FF00FF00)) >> s1)
    e = (e & np.uint64(0x0000FFFF0000FFFF)) | ((e & np.uint64(0xFFFF0000FFFF0000)) >> s2)
    return (e & np.uint64(0x00000000FFFFFFFF)) | ((e >> np.uint64(32)) << (np.uint64(32) - s3))


@cached_njit(nogil=True)
def swar_pack(t, r, words):
    """Pack the r (1..7) low bits of each byte of ``t`` (uint64 words, 8 values each):
    8r bits per word of ``t``, back to back. Every 8 words of ``t`` make r words, written
    independently of the others."""
    rr = np.uint64(r)
    s1, s2, s3 = np.uint64(8) - rr, np.uint64(16) - 2 * rr, np.uint64(32) - 4 * rr
    mask = ((ONE << rr) - ONE) * np.uint64(0x0101010101010101)
    nb = np.uint64(8) * rr
    nblk = t.shape[0] >> 3
    for b in range(nblk):
        blk = words[b * r : (b + 1) * r]
        wi, acc, fill = Z, Z, Z
        for g in range(8):
            if BMI2:
                e = _pext(t[b * 8 + g], mask)
            else:
                e = _squeeze(t[b * 8 + g], s1, s2, s3)
            wi, acc, fill = _put(blk, wi, acc, fill, e, nb)
    wi, acc, fill = np.uint64(nblk * r), Z, Z
    for g in range(nblk * 8, t.shape[0]):
        if BMI2:
            e = _pext(t[g], mask)
        else:
            e = _squeeze(t[g], s1, s2, s3)
        wi, acc, fill = _put(words, wi, acc, fill, e, nb)
    if fill:
        words[wi] = acc


@cached_njit(nogil=True)
def swar_unpack(words, r, t):
    """Inverse of :func:`swar_pack`: one value of r bits per byte of ``t``."""
    rr = np.uint64(r)
    nb = 8 * r
    m1 = ((ONE << rr) - ONE) * np.uint64(0x0001000100010001)
    m2 = ((ONE << (2 * rr)) - ONE) * np.uint64(0x0000000100000001)
    m3 = (ONE << (4 * rr)) - ONE
    mask = ((ONE << rr) - ONE) * np.uint64(0x0101010101010101)
    for g in range(t.shape[0]):
        e = _peek(words, np.int64(g) * nb, nb)
        if BMI2:
            t[g] = _pdep(e, mask)
        else:
            e = (e & m3) | ((e >> (4 * rr)) << np.uint64(32))
            e = (e & m2) | (((e >> (2 * rr)) & m2) << np.uint64(16))
            t[g] = (e & m1) | (((e >> rr) & m1) << np.uint64(8))


@cached_njit(nogil=True)
def pack_encode(idx, lo, wbits, words):
    """Write each ``idx − lo`` in wbits bits."""
    wi, acc, fill = Z, Z, Z
    wb = np.uint64(wbits)
    for j in range(idx.shape[0]):
        wi, acc, fill = _put(words, wi, acc, fill, np.uint64(np.int64(idx[j]) - lo), wb)
    if fill:
        words[wi] = acc


@cached_njit(nogil=True)
def pack_decode(words, lo, wbits, out):
    """Read ``out.shape[0]`` offsets of wbits bits, adding lo."""
    for j in range(out.shape[0]):
        out[j] = lo + np.int64(_peek(words, np.int64(j) * wbits, wbits))


@cached_njit(nogil=True)
def bitmap_encode(idx, first, words):
    """Set bit ``i − first`` for each i of ``idx`` (every word up to the last bit written)."""
    wi, acc = Z, Z
    for j in range(idx.shape[0]):
        p = np.uint64(np.int64(idx[j]) - first)
        w = p >> np.uint64(6)
        while wi < w:
            words[wi] = acc
            acc = Z
            wi += ONE
        acc |= ONE << (p & np.uint64(63))
    words[wi] = acc


@cached_njit(inline="always")
def _put_ones(word, base, dst, j):
    """Write ``base`` plus the position of each one bit of ``word`` into ``dst`` from j,
    eight at a time (up to 7 entries past them are overwritten too); return j plus the
    count of ones."""
    c = np.int64(_popcount(word))
    jj = j
    while word:
        for t in range(8):
            dst[jj + t] = base + np.int64(_ctz(word))
            word &= word - ONE
        jj += 8
    return j + c


@cached_njit(nogil=True)
def ones(words, w0, w, w1, pos):
    """Put the positions (bit 0 of word w0 is 0) of the one bits of words[w:w1] in
    ``pos``, eight at a time, until it holds ``pos.shape[0] − 72`` or more (it needs 72
    entries of room past that); return how many and the next word."""
    full = pos.shape[0] - 72
    j = 0
    while w < w1 and j < full:
        j = _put_ones(words[w], np.int64(w - w0) << 6, pos, j)
        w += 1
    return j, w


@cached_njit(nogil=True)
def bitmap_decode(words, first, out):
    """Write the positions of the set bits (plus first) into ``out``; return how many
    (``out.shape[0] + 1`` where there are more).

    While ``out`` has room for a word's ones written eight at a time (72 entries), they
    go there directly (the last group's extra entries are overwritten by the next word's);
    the last ones through :func:`ones`' buffer."""
    m = out.shape[0]
    j, w = 0, 0
    while w < words.shape[0] and j + 72 <= m:
        j = _put_ones(words[w], first + (np.int64(w) << 6), out, j)
        w += 1
    pos = np.empty(BLOCK + 72, np.int64)
    while w < words.shape[0]:
        c, w = ones(words, 0, w, words.shape[0], pos)
        if j + c > m:
            return m + 1
        for t in range(c):
            out[j + t] = first + pos[t]
        j += c
    return j
