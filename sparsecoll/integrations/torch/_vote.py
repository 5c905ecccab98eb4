"""The backend's call agreement: what every ``all_reduce`` on a sparsecoll group agrees on
before it picks its path (gloo for a dense tensor, sparsecoll for a sparse one).

:func:`call_check` runs :func:`sparsecoll._agree.agreement` over a communicator that
every rank reaches whatever its tensor (a duplicate of the group's MPI communicator, or
:class:`GlooVotes` over the group's own gloo backend), on the tensor's layout, sparse and
dense dimensions, shape (the size of a dense tensor), dtype, op and device: one small
MAX-allreduce when the ranks agree; when one rank's tensor is of another kind, or fails
its own checks, every rank raises the same error, naming that rank, and none takes a path
the others do not.
"""

from __future__ import annotations

import pickle
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..._agree import agreement
from ...errors import SparseCollError

__all__ = ["GlooVotes", "call_check"]

# the signature's values, in order (the shape as a CRC of its repr)
NAMES = ("tensor layout", "sparse dims", "dense dims", "shape", "element type", "op", "device")
_LAYOUTS = {torch.strided: "dense", torch.sparse_coo: "sparse COO"}


class _Text(str):
    """A value a mismatch names as it is (no quotes)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def _crc(value: Any) -> int:
    return zlib.crc32(repr(value).encode())


class _Wait:
    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> None:
        self.work.wait()


class GlooVotes:
    """The communicator an agreement needs (``rank``, ``size``, ``iallreduce_ints``,
    ``bcast_object``, ``allgather_object``) over a gloo backend: its calls go to the
    backend itself, never through the process group that holds it."""

    __slots__ = ("backend", "rank", "size")

    def __init__(self, backend: Any, rank: int, size: int) -> None:
        self.backend, self.rank, self.size = backend, rank, size

    def iallreduce_ints(self, values: Any, op: str = "max", poll: Any = None) -> tuple[Any, Any]:
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        t = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = reduce_op[op]
        return _Wait(self.backend.allreduce([t], opts)), t.numpy()

    def _bytes_bcast(self, t: Any, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.backend.broadcast([t], opts).wait()

    def bcast_object(self, obj: Any, root: int) -> Any:
        data = pickle.dumps(obj) if self.rank == root else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._bytes_bcast(size, root)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
        if buf is None:
            buf = torch.empty(int(size[0]), dtype=torch.uint8)
        if buf.numel():
            self._bytes_bcast(buf, root)
        return pickle.loads(buf.numpy().tobytes())

    def allgather_object(self, obj: Any) -> list[Any]:
        data = pickle.dumps(obj)
        sizes = torch.empty(self.size, dtype=torch.int64)
        mine = torch.tensor([len(data)], dtype=torch.int64)
        self.backend._allgather_base(sizes, mine).wait()
        width = int(sizes.max())
        padded = np.zeros(width, np.uint8)
        padded[: len(data)] = np.frombuffer(data, np.uint8)
        out = torch.empty(self.size * width, dtype=torch.uint8)
        self.backend._allgather_base(out, torch.from_numpy(padded)).wait()
        rows = out.numpy().reshape(self.size, width)
        return [pickle.loads(rows[r, : int(sizes[r])].tobytes()) for r in range(self.size)]


def call_check(
    votes: GlooVotes, tensors: list[Any], op: str, local: Callable[[Any], Any], call: str
) -> Any:
    """Agree on ``all_reduce(tensors, op)`` across the ranks; return ``local(tensor)`` for a
    sparse COO tensor (its own checks, run before the vote: their error is this rank's),
    None for dense tensors. Every rank raises the same error when a rank's tensor is of
    another kind (layout, shape, dtype, device), its op differs, or ``local`` raised."""
    t = tensors[0] if tensors else None
    kind = _LAYOUTS.get(t.layout, str(t.layout)) if t is not None else "no tensor"
    sparse = kind == "sparse COO"

    def detail() -> Any:
        if t is None:
            return None
        shape = ("sparse tensor shape", tuple(t.shape)) if sparse else ("tensor size", t.numel())
        dtype = "sparse tensor dtype" if sparse else "tensor dtype"
        values = {
            "tensor layout": _Text(kind),
            "sparse dims": t.sparse_dim() if sparse else 0,
            shape[0]: shape[1],
            dtype: str(t.dtype),
            "op": op,
            "device": t.device.type,
        }
        return ((tuple(range(len(NAMES))), values),)

    result = None
    try:
        with agreement(votes, NAMES, detail, call=call) as agree:
            if t is None or kind not in _LAYOUTS.values():
                raise ValueError(f"all_reduce takes dense or sparse COO tensors, got {kind}")
            if sparse:
                if len(tensors) != 1:
                    raise ValueError(f"expecting one sparse tensor, got {len(tensors)}")
                result = local(t)
            size = _crc(tuple(t.shape)) if sparse else t.numel()
            agree.signature = [
                1 if sparse else 0,
                t.sparse_dim() if sparse else 0,
                t.dense_dim() if sparse else 0,
                size,
                _crc(str(t.dtype)),
                _crc(op),
                _crc(t.device.type),
            ]
    except SparseCollError:
        raise
    except RuntimeError as exc:  # (gloo's: its timeout, a closed connection)
        raise RuntimeError(
            f"{call} on rank {votes.rank}: the ranks' agreement on the call failed ({exc}): "
            f"some rank skipped this call, is stuck before it or died"
        ) from exc
    return result
