"""torch.distributed from MPI: :func:`init_process_group` (a gloo process group whose rank and
size are MPI's), and the checks that a DDP process group and the hook's communicator hold the
same processes in the same order (under torchrun each process is an MPI world of one)."""

from __future__ import annotations

import os
import socket
import sys
import zlib
from typing import Any

from ..._agree import watch
from ..._launch import torch_launcher_mismatch
from ..._mpilib import mpi as _mpi
from ...comm import Communicator

__all__ = ["group_comm", "group_mismatch", "init_process_group", "torch_module", "world_mismatch"]


def torch_module() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise RuntimeError("PyTorch is not available: pip install 'sparsecoll[torch]'") from exc
    return torch


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_process_group(
    comm: Any = None,
    backend: str = "gloo",
    *,
    addr: str | None = None,
    port: int | None = None,
    **kwargs: Any,
) -> None:
    """Initialize ``torch.distributed`` with the rank and size of the MPI communicator.

    Rank 0 picks the rendezvous address and port and broadcasts them over MPI. The address
    is, in order: ``addr``, the environment's ``MASTER_ADDR``, 127.0.0.1 when every rank
    runs on the same host, else rank 0's host name resolved; the port: ``port``, the
    environment's ``MASTER_PORT``, else a free TCP port. ``kwargs`` go to
    ``torch.distributed.init_process_group`` (e.g. ``timeout``).

    Launch with mpiexec. Under torchrun each process is an MPI world of one: when
    ``WORLD_SIZE``, ``RANK``, ``LOCAL_WORLD_SIZE`` or ``LOCAL_RANK`` (set by torchrun)
    disagree with MPI's COMM_WORLD on any rank, every rank raises RuntimeError, naming the
    rank, before torch's rendezvous.
    """
    torch_module()
    import torch.distributed as dist

    c = Communicator.wrap(comm)
    if dist.is_initialized():
        raise RuntimeError("a torch process group is already initialized")
    world = _mpi_world()
    mismatch = torch_launcher_mismatch(world.Get_size(), world.Get_rank())
    # the MPI exchanges watched as a blocking call (SPARSECOLL_TIMEOUT), so that a rank that
    # skips the call ends in the watchdog's diagnostic (torch's own timeout covers its
    # rendezvous only)
    with c.serial(), watch(c, "init_process_group()"):
        seen = c.allgather_object((socket.gethostname(), mismatch))
        for r, (_, why) in enumerate(seen):
            if why is not None:
                raise RuntimeError(f"{why} (rank {r})")
        hosts = [h for h, _ in seen]
        info: Any = None
        if c.rank == 0:
            try:
                info = _rendezvous(hosts, addr, port)
            except ValueError as exc:  # (shared with every rank: none is left waiting)
                info = str(exc)
        info = c.bcast_object(info, 0)
    if isinstance(info, str):
        raise ValueError(f"{info} (rank 0)")
    host, port = info
    dist.init_process_group(
        backend, init_method=f"tcp://{host}:{port}", rank=c.rank, world_size=c.size, **kwargs
    )


def _mpi_world() -> Any:
    return _mpi().COMM_WORLD


def _rendezvous(hosts: list[str], addr: str | None, port: int | None) -> tuple[str, int]:
    """Rank 0's choice of the rendezvous address and port (see init_process_group)."""
    host = addr or os.environ.get("MASTER_ADDR")
    if host is None:
        same = all(h == hosts[0] for h in hosts)
        host = "127.0.0.1" if same else socket.gethostbyname(hosts[0])
    if port is None and os.environ.get("MASTER_PORT"):
        value = os.environ["MASTER_PORT"].strip()
        if not value.isdigit() or not 0 < int(value) < 65536:
            raise ValueError(f"MASTER_PORT must be a TCP port (1 to 65535), got {value!r}")
        port = int(value)
    return host, port or _free_port("127.0.0.1" if host == "127.0.0.1" else "")


def world_mismatch(comm: Communicator) -> str | None:
    """Why the hook cannot reduce over ``comm`` for torch.distributed's world (None when it
    can, or when torch.distributed is not initialized): ``comm`` is the whole MPI world
    but of another size than torch's, as under torchrun (each process an MPI world of one:
    every rank would average its gradients with itself alone). A sub-communicator is left
    alone (it may match a DDP process_group's subgroup). Every rank decides alike: torch's
    world size, ``comm``'s size and whether it spans COMM_WORLD are the same on each."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    size = dist.get_world_size()
    if size == comm.size:
        return None
    from mpi4py import MPI

    if MPI.Comm.Compare(comm.mpi_comm, MPI.COMM_WORLD) not in (MPI.IDENT, MPI.CONGRUENT):
        return None
    return (
        f"torch.distributed has {size} ranks but the hook's communicator, MPI's whole world, "
        f"has {comm.size}: the processes were not started as one MPI job (under torchrun "
        f"each is an MPI world of one, and the hook would average each rank's gradients "
        f"with itself alone); launch with `mpiexec -n {size} python script.py` and "
        f"sc_torch.init_process_group(), not torchrun"
    )


def _group_ranks(process_group: Any) -> list[int]:
    """``process_group``'s members as torch's global ranks, in its order. Raises
    RuntimeError when torch.distributed is not initialized, TypeError for what is no
    process group, ValueError when this process is not in it."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group given, but torch.distributed is not initialized")
    try:
        # (a group's rank -1: not a member, for which torch's list of the group's ranks is
        # another group's)
        member = dist.get_rank(process_group) >= 0
        ranks = [int(r) for r in dist.get_process_group_ranks(process_group)] if member else []
    except Exception:
        what = type(process_group).__name__
        raise TypeError(
            f"process_group must be a torch.distributed process group, got a {what}"
        ) from None
    if not member:
        raise ValueError(
            f"process_group: this process (torch's global rank {dist.get_rank()}) is not in "
            f"it: build a state only where DDP runs on that group"
        )
    return ranks


def group_comm(process_group: Any) -> Any:
    """An MPI communicator of ``process_group``'s processes in its order, built on the
    group's processes alone: they gather their MPI world ranks over the group (torch) and
    build it from MPI's world (MPI_Comm_create_group: collective over those processes
    only). Raises the same error on every process of the group when they are not one MPI
    job (under torchrun each is rank 0 of an MPI world of one)."""
    torch_module()
    import torch.distributed as dist

    members = _group_ranks(process_group)  # (no collective on a group that is not ours)
    world = _mpi_world()
    ranks: list[Any] = [None] * len(members)
    dist.all_gather_object(ranks, world.Get_rank(), group=process_group)
    if len(set(ranks)) != len(ranks):  # (the same list on every process of the group)
        raise RuntimeError(
            f"the process_group's processes are not one MPI job (their ranks in MPI's "
            f"world: {ranks}, as under torchrun, where each is an MPI world of one): launch "
            f"with `mpiexec -n N python script.py` and sc_torch.init_process_group()"
        )
    return world_subset(ranks)


def world_subset(ranks: list[int]) -> Any:
    """An MPI communicator of MPI's world ranks ``ranks``, in that order (MPI_Comm_create_group:
    collective over those processes only)."""
    world = _mpi_world()
    whole = world.Get_group()
    part = whole.Incl(ranks)
    try:
        return world.Create_group(part)
    finally:
        part.Free()
        whole.Free()


def group_mismatch(
    comm: Communicator, process_group: Any
) -> tuple[BaseException | None, list[int] | None, Any]:
    """Whether ``comm`` holds exactly ``process_group``'s processes in its order: this
    rank's error (None when its own part agrees), the signature the ranks must agree on
    (the group's global ranks, as a CRC) and that value named for a mismatch's message.
    Every rank agreeing that its communicator rank is the group's global rank at that
    position, in groups alike of the communicator's size, makes the two the same."""
    try:
        ranks = _group_ranks(process_group)
    except Exception as exc:  # (shared with every rank by the caller's agreement)
        return exc, None, None
    me = sys.modules["torch.distributed"].get_rank()
    detail = (((0,), {"process_group (torch's global ranks)": ranks}),)
    sig = [zlib.crc32(repr(ranks).encode())]
    remedy = (
        "DDP's gradients would be averaged over other processes than its group's; pass "
        "process_group alone (the state builds its communicator from the group), or a "
        "communicator of exactly the group's processes in its order"
    )
    error: BaseException | None = None
    if len(ranks) != comm.size:
        error = ValueError(
            f"the hook's communicator has {comm.size} ranks but the process_group has "
            f"{len(ranks)} (torch's global ranks {ranks}): {remedy}"
        )
    elif ranks[comm.rank] != me:
        error = ValueError(
            f"this process is rank {comm.rank} of the hook's communicator but rank "
            f"{ranks.index(me)} of the process_group (torch's global rank {me}; the group: "
            f"{ranks}): {remedy}"
        )
    return error, sig, detail
