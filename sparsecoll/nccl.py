"""NCCLCommunicator: a Communicator whose bulk collectives on device buffers run on NCCL.

With CuPy buffers, the payload of ``allgatherv`` (grouped ncclBroadcast), ``alltoallv``
(grouped ncclSend/ncclRecv) and ``allreduce`` (ncclAllReduce) moves over NCCL
(``pip install 'sparsecoll[gpu]'``). Counts, metadata, host buffers and point-to-point
messages stay on MPI: NCCL has no tags or probe, and its blocking send waits for the peer's
receive, so MPI-style ordering could deadlock. Each NCCL call runs on the communicator's GPU
(current when it was built), on CuPy's current stream there, synchronized before it returns;
a device array on another GPU is refused. Byte accounting follows the MPI rules; with the
watchdog on, construction and each call are watched as blocking calls; nonblocking calls
are not supported.

NCCL needs one GPU per rank: the constructor raises ValueError on every rank when two ranks
share one (select a device per rank first, e.g. ``cupy.cuda.Device(local_rank).use()``).
With several ranks on one GPU use the plain Communicator (staging through pinned memory).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._agree import share_error, watch
from ._array import cupy_or_none, is_device_array, nccl_or_none, wait_for_foreign
from ._buffers import in_dtype
from .comm import Communicator

__all__ = ["NCCLCommunicator", "nccl_available"]


def nccl_available() -> bool:
    """Whether CuPy, a GPU and the NCCL library are usable in this process."""
    return nccl_or_none() is not None


def _offsets(counts: Sequence[int]) -> list[int]:
    return np.concatenate(([0], np.cumsum(counts, dtype=np.int64)[:-1])).tolist()


class NCCLCommunicator(Communicator):
    """A :class:`Communicator` that moves device payloads of collectives over NCCL.

    Built collectively on every rank of ``comm`` (an mpi4py Intracomm, default COMM_WORLD, or
    a Communicator), each rank on its current CuPy device. Raises RuntimeError on every rank
    when a rank lacks CuPy or NCCL, ValueError when two ranks share a GPU.
    """

    def __init__(self, comm: Any = None) -> None:
        super().__init__(comm)
        # watched as one call: NCCL's own setup waits for every rank too
        with watch(self, "NCCLCommunicator()"):
            self._setup()

    def _setup(self) -> None:
        cp, nccl = cupy_or_none(), nccl_or_none()
        error, where = None, None
        if cp is None:
            error = "CuPy with a CUDA device is not available"
        elif nccl is None:
            error = "NCCL is not available to CuPy (pip install 'sparsecoll[gpu]')"
        else:
            try:
                where = (socket.gethostname(), str(cp.cuda.Device().pci_bus_id))
            except Exception as exc:
                error = f"cannot identify the current GPU: {exc}"
        every = self.allgather_object((error, where))
        for r, (e, _) in enumerate(every):
            if e:
                raise RuntimeError(f"{e} on rank {r}")
        owner: dict[Any, int] = {}
        for r, (_, w) in enumerate(every):
            if w in owner:
                raise ValueError(
                    f"NCCL needs one GPU per rank: ranks {owner[w]} and {r} share GPU "
                    f"{w[1]} on {w[0]}; select a device per rank or use Communicator"
                )
            owner[w] = r
        uid = self.bcast_object(nccl.get_unique_id() if self.rank == 0 else None, 0)
        self._nccl = nccl
        self.device: int = int(cp.cuda.Device().id)  # the GPU it moves memory of
        self.nccl_comm = nccl.NcclCommunicator(self.size, uid, self.rank)

    def close(self) -> None:
        """Free the NCCL communicator (collective; the MPI communicator stays usable)."""
        if self.nccl_comm is not None:
            self.nccl_comm.destroy()
            self.nccl_comm = None

    # -- helpers ------------------------------------------------------------------------
    @staticmethod
    def _stream() -> Any:
        return cupy_or_none().cuda.get_current_stream()

    @staticmethod
    def _bytes(a: Any) -> Any:
        return cupy_or_none().ascontiguousarray(a).reshape(-1).view(np.uint8)

    def _live(self) -> Any:
        if self.nccl_comm is None:
            raise RuntimeError("the NCCL communicator was closed")
        return self.nccl_comm

    @contextlib.contextmanager
    def _watched(self, call: str) -> Iterator[None]:
        """Run a payload collective on this communicator's GPU, serialized and watched.

        With the watchdog on, it is watched as a blocking call (a rank that skipped it would leave
        the others in NCCL for ever), or as part of the watched call it runs inside.
        """
        device = cupy_or_none().cuda.Device(self.device)
        with self.serial(), watch(self, f"NCCLCommunicator.{call}"), device:
            yield

    def check_buffer(self, array: Any, name: str) -> None:
        """Raise ValueError for a device array on another GPU than the one NCCL was built on."""
        cp = cupy_or_none()
        if cp is not None and isinstance(array, cp.ndarray):  # as_array's view of a tensor
            dev = int(array.device.id)
            if dev != self.device:
                raise ValueError(
                    f"{name} is on GPU {dev}, not on GPU {self.device} where this "
                    f"NCCLCommunicator was built (NCCL moves that GPU's memory only: move "
                    f"{name} there, or build the NCCLCommunicator with GPU {dev} current)"
                )

    # -- payload collectives ------------------------------------------------------------
    def allgatherv(
        self, sendbuf: Any, counts: Sequence[int] | None = None
    ) -> tuple[Any, list[int]]:
        if not is_device_array(sendbuf):
            return super().allgatherv(sendbuf, counts)
        with self._watched("allgatherv()"):
            return self._allgatherv(sendbuf, counts)

    def _allgatherv(self, sendbuf: Any, counts: Sequence[int] | None) -> tuple[Any, list[int]]:
        cp, nccl, nc = cupy_or_none(), self._nccl, self._live()
        error = None
        try:
            self.check_buffer(sendbuf, "sendbuf")
        except ValueError as exc:
            error = exc
        if counts is None:  # the counts' exchange shares an error: a rank's -1
            counts = self.allgather_ints(-1 if error else int(sendbuf.shape[0]))
            share_error(self, counts, error, "NCCLCommunicator.allgatherv")
        elif error is not None:  # given counts: no exchange to share it in
            raise ValueError(f"{error} on rank {self.rank}") from error
        counts = [int(c) for c in counts]
        item = sendbuf.dtype.itemsize
        total = sum(counts)
        out = cp.empty(total, dtype=sendbuf.dtype)
        send, recv = self._bytes(sendbuf), out.reshape(-1).view(np.uint8)
        displs = _offsets([c * item for c in counts])
        stream = self._stream()
        nccl.groupStart()
        try:
            for r, c in enumerate(counts):
                if c:
                    dst = recv.data.ptr + displs[r]
                    src = send.data.ptr if r == self.rank else dst
                    nc.broadcast(src, dst, c * item, nccl.NCCL_UINT8, r, stream.ptr)
        finally:
            nccl.groupEnd()
        stream.synchronize()
        self._count_allgatherv((total - counts[self.rank]) * item)
        return out, counts

    def alltoallv(self, sendbuf: Any, sendcounts: Sequence[int]) -> tuple[Any, list[int]]:
        if not is_device_array(sendbuf):
            return super().alltoallv(sendbuf, sendcounts)
        with self._watched("alltoallv()"):
            return self._alltoallv(sendbuf, sendcounts)

    def _alltoallv(self, sendbuf: Any, sendcounts: Sequence[int]) -> tuple[Any, list[int]]:
        cp, nccl, nc = cupy_or_none(), self._nccl, self._live()
        sendcounts, recvcounts = self._alltoallv_counts(sendbuf, sendcounts)
        item = sendbuf.dtype.itemsize
        out = cp.empty(sum(recvcounts), dtype=sendbuf.dtype)
        send, recv = self._bytes(sendbuf), out.reshape(-1).view(np.uint8)
        sb = [c * item for c in sendcounts]
        rb = [c * item for c in recvcounts]
        sd, rd = _offsets(sb), _offsets(rb)
        me = self.rank
        if sb[me]:
            recv[rd[me] : rd[me] + rb[me]] = send[sd[me] : sd[me] + sb[me]]
        stream = self._stream()
        nccl.groupStart()
        try:
            for j in range(self.size):
                if j == me:
                    continue
                if sb[j]:
                    nc.send(send.data.ptr + sd[j], sb[j], nccl.NCCL_UINT8, j, stream.ptr)
                if rb[j]:
                    nc.recv(recv.data.ptr + rd[j], rb[j], nccl.NCCL_UINT8, j, stream.ptr)
        finally:
            nccl.groupEnd()
        stream.synchronize()
        self._count_alltoallv(sb, rb)
        return out, recvcounts

    def allreduce(
        self, buf: Any, out: Any = None, op: str = "sum", *, check: bool = True, work: Any = None
    ) -> Any:
        if not is_device_array(buf):
            return super().allreduce(buf, out, op, check=check, work=work)
        with self._watched(f"allreduce(op={op!r})"):
            return self._nccl_allreduce(buf, out, op, check, work)

    def _nccl_allreduce(self, buf: Any, out: Any, op: str, check: bool, work: Any) -> Any:
        nccl, nc = self._nccl, self._live()
        given = out
        # what it allocates is made before the ranks agree, as in Communicator.allreduce
        work, dest, out, wrap, orig = self._allreduce_args(buf, out, op, check, work)
        # NCCL sums in place when both pointers are the same (dest is work: contiguous)
        dtype = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64}
        if work.size:
            stream = self._stream()
            kind = dtype[work.dtype]
            nc.allReduce(work.data.ptr, dest.data.ptr, work.size, kind, nccl.NCCL_SUM, stream.ptr)
            stream.synchronize()
        if self.size > 1:
            self._count_allreduce(work.nbytes)
            if op == "mean":
                dest /= self.size
        total = in_dtype(dest, orig, out)
        wait_for_foreign(given, out)
        return given if given is not None else wrap(total)
