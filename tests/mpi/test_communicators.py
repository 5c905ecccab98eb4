"""Communicators a user of mpi4py may pass: sub-communicators used at once, derived and
subclassed ones, an intercommunicator, a freed one, a fatal error handler; and bad counts
given to a Communicator's own methods."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from mpi4py import MPI

import sparsecoll
from sparsecoll import CollectiveInputError, CollectiveTypeError
from sparsecoll.algorithms.base import reference_sum
from sparsecoll.registry import algorithm_class, available_algorithms
from sparsecoll.sparse import SparseVector
from sparsecoll.training import GradientReducer

from .cases import Case, assert_all, local_input, mismatch

N = 1000
EXACT = ["allgather", "dsa", "recursive_doubling", "rabenseifner", "dense", "auto"]


def _case(seed: int) -> Case:
    return Case(N, "random", "float64", seed, 0.05, False)


def _reduce(mpi_comm, seed: int, algorithm: str = "allgather", nonblocking=False, via=None):
    """This rank's input of ``_case(seed)`` (by its rank in ``mpi_comm``), reduced over
    ``mpi_comm`` (or ``via``, a Communicator wrapping it)."""
    case = _case(seed)
    vals, idx = local_input(case, mpi_comm.Get_rank(), mpi_comm.Get_size())
    call = sparsecoll.iallreduce if nonblocking else sparsecoll.allreduce
    return call(via or mpi_comm, vals, idx, n=N, algorithm=algorithm)


def _wrong(result, mpi_comm, seed: int) -> str | None:
    return mismatch(result, _case(seed), mpi_comm.Get_size())


def test_split_communicators_at_once_and_with_the_world(comm):
    """Sub-communicators of Split (a different exact algorithm and size per colour), their
    calls blocking and nonblocking, interleaved with calls on the whole communicator and
    waited for in reverse order: every result is the exact sum over its own ranks. A
    GradientReducer on each sub-communicator steps between them."""
    world = comm.mpi_comm
    colour = comm.rank % 3 if comm.size > 3 else comm.rank % 2
    sub = world.Split(colour, comm.rank)
    algorithm = EXACT[colour]
    red = GradientReducer(sub, N, "oktopk", 0.01)
    pending, bad = [], []
    for seed in range(3):
        pending.append((sub, seed, _reduce(sub, seed, algorithm, nonblocking=True)))
        pending.append((world, seed, _reduce(world, 10 + seed, "dsa", nonblocking=True)))
        grad = np.random.default_rng([seed, comm.rank]).standard_normal(N)
        update = red.step(grad)  # waits for the sub-communicator's pending calls
        same = sub.allgather(update.tobytes())
        bad += [] if all(u == same[0] for u in same) else ["reducer updates differ"]
        bad.append(_wrong(_reduce(sub, 20 + seed, algorithm), sub, 20 + seed))
        bad.append(_wrong(_reduce(world, 30 + seed), world, 30 + seed))
    for mpi_comm, seed, req in reversed(pending):
        offset = 0 if mpi_comm is sub else 10
        bad.append(_wrong(req.wait(timeout=120), mpi_comm, offset + seed))
    sub.Free()
    bad = [b for b in bad if b]
    assert_all(comm, not bad, f"colour {colour} ({algorithm}): {bad}")


class _Intracomm(MPI.Intracomm):
    """A user's subclass of mpi4py's Intracomm."""


def _derived(world, kind: str):
    """(communicator, whether to free it) for ``kind``; COMM_NULL on ranks left out."""
    if kind == "dup":
        return world.Dup(), True
    if kind == "cart":
        return world.Create_cart([world.Get_size()], periods=[True]), True
    if kind == "group":  # the even ranks; the odd ones get COMM_NULL
        group = world.Get_group().Incl(list(range(0, world.Get_size(), 2)))
        out = world.Create_group(group)
        group.Free()
        return out, out != MPI.COMM_NULL
    if kind == "subclass":
        return _Intracomm(world), False
    return MPI.COMM_SELF, False


@pytest.mark.parametrize("kind", ["dup", "cart", "group", "subclass", "self"])
def test_derived_communicators(comm, kind):
    """A Dup, a Cartesian communicator, one from Create_group, an Intracomm subclass and
    COMM_SELF: exact sums over their ranks (blocking, nonblocking, several algorithms), a
    reducer step; the ranks Create_group leaves out get a TypeError saying why."""
    mine, free = _derived(comm.mpi_comm, kind)
    bad = []
    if mine == MPI.COMM_NULL:
        try:
            sparsecoll.allreduce(mine, [1.0], [0], n=N)
            bad.append("COMM_NULL accepted")
        except TypeError as exc:
            if "not in the communicator" not in str(exc):
                bad.append(str(exc))
    else:
        for seed, algorithm in enumerate(EXACT):
            bad.append(_wrong(_reduce(mine, seed, algorithm), mine, seed))
        bad.append(_wrong(_reduce(mine, 9, "dsa", nonblocking=True).wait(timeout=120), mine, 9))
        red = GradientReducer(mine, N, "exdyna", 0.05)
        update = red.step(np.ones(N))
        same = mine.allgather(update.tobytes())
        bad.append(None if all(u == same[0] for u in same) else "reducer updates differ")
    if free:
        mine.Free()
    bad = [b for b in bad if b]
    assert_all(comm, not bad, f"{kind}: {bad}")


def test_intercommunicator_is_refused_on_every_rank(comm):
    """An intercommunicator (two groups, no allreduce of one vector over both) is refused
    with a TypeError naming it, on every rank, by every entry point."""
    if comm.size == 1:
        pytest.skip("an intercommunicator needs two groups")
    world = comm.mpi_comm
    half = world.Split(comm.rank % 2, comm.rank)
    inter = half.Create_intercomm(0, world, 1 - comm.rank % 2, 7)
    vals, idx = local_input(_case(0), comm.rank, comm.size)
    got = []
    for call in (
        lambda: sparsecoll.allreduce(inter, vals, idx, n=N),
        lambda: sparsecoll.iallreduce(inter, vals, idx, n=N),
        lambda: GradientReducer(inter, N),
        lambda: sparsecoll.Communicator(inter),
    ):
        try:
            call()
            got.append("accepted")
        except TypeError as exc:
            got.append("ok" if "Intracomm" in str(exc) and "Intercomm" in str(exc) else str(exc))
    inter.Free()
    half.Free()
    assert_all(comm, got == ["ok"] * 4, f"{got}")


def test_fatal_error_handler_and_a_freed_communicator(comm):
    """With ERRORS_ARE_FATAL (on the communicator and on COMM_WORLD and COMM_SELF, where
    MPI reports errors on a null handle): bad input on one rank is the usual error on every
    rank (it is checked before MPI sees it), and a call on a communicator freed under a
    Communicator or a GradientReducer raises TypeError. That call used to reach MPI with
    the null handle: mpi4py's Exception by default, under a fatal handler the job aborted
    ("Fatal error in MPII_Comm_get_attr: Invalid communicator")."""
    world, self_comm = MPI.COMM_WORLD, MPI.COMM_SELF
    saved = world.Get_errhandler(), self_comm.Get_errhandler()
    mine = comm.mpi_comm.Dup()
    got = []
    try:
        for c in (mine, world, self_comm):
            c.Set_errhandler(MPI.ERRORS_ARE_FATAL)
        vals, idx = local_input(_case(0), comm.rank, comm.size)
        spoiled = idx.copy()
        if comm.rank == comm.size - 1:
            spoiled[0] = N + 3
        try:
            sparsecoll.allreduce(mine, vals, spoiled, n=N)
            got.append("bad input accepted")
        except sparsecoll.CollectiveInputError as exc:
            got.append("ok" if f"on rank {comm.size - 1}" in str(exc) else str(exc))
        wrapped = sparsecoll.Communicator(mine)
        red = GradientReducer(mine, N, "gtopk", 0.05)
        got.append(_wrong(_reduce(mine, 1, "rabenseifner", via=wrapped), mine, 1) or "ok")
        mine.Free()
        for call in (
            lambda: sparsecoll.allreduce(wrapped, vals, idx, n=N),
            lambda: sparsecoll.iallreduce(wrapped, vals, idx, n=N),
            lambda: red.step(np.ones(N)),
            lambda: wrapped.barrier(),
        ):
            try:
                call()
                got.append("accepted")
            except TypeError as exc:
                got.append("ok" if "freed" in str(exc) else str(exc))
    finally:
        world.Set_errhandler(saved[0])
        self_comm.Set_errhandler(saved[1])
        for h in saved:
            h.Free()
    assert_all(comm, got == ["ok"] * 6, f"{got}")


def _selected(mpi_comm, algo, seed: int, n: int = N) -> str:
    """Reduce this rank's input of ``_case(seed)`` (length ``n``) over ``mpi_comm`` with the
    selecting instance ``algo``: "ok" when the result meets its contract (``algo.verify``
    against every rank's input), else why not, or the error raised."""
    case = dataclasses.replace(_case(seed), n=n)
    vals, idx = local_input(case, mpi_comm.Get_rank(), mpi_comm.Get_size())
    try:
        out = sparsecoll.allreduce(mpi_comm, vals, idx, n=n, algorithm=algo)
    except Exception as exc:  # (what the caller expects is checked there)
        return f"{type(exc).__name__}: {exc}"
    inputs = [SparseVector.from_coo(i, v, n) for v, i in mpi_comm.allgather((vals, idx))]
    if not algo.verify(out, reference_sum(inputs), inputs):
        return f"result breaks the contract: {out.info}"
    return "ok"


def test_a_stateful_instance_moved_between_communicators(comm):
    """An oktopk instance (threshold, regions and step of its earlier calls) called on a
    sub-communicator of another size starts afresh there (docs/guide/algorithms.md: a call with
    another n or communicator size resets it), as it does for another n: exact top-k, step
    0. Back on the whole communicator, the states the two halves left differ, and every
    rank refuses them, naming a rank and the remedy (reset() on every rank, or one instance
    per communicator), until each calls reset(). An exdyna instance (its partitions are set
    up for one n and size) raises CollectiveInputError (a ValueError) on every rank of the
    sub-communicator instead, saying what it was set up for and to call reset() (it raised
    a plain ValueError); after reset() it works there, and after another on the whole
    communicator; oktopk still works there too."""
    world = comm.mpi_comm
    sub = world.Split(comm.rank % 2, comm.rank)
    resized = sub.Get_size() != comm.size
    oktopk = sparsecoll.get_algorithm("oktopk", k=7, tau=100)
    exdyna = sparsecoll.get_algorithm("exdyna", k=7)
    got = []
    for seed in range(3):  # a stream: reuse calls from the second on
        got += [_selected(world, oktopk, seed), _selected(world, exdyna, seed)]
    step = oktopk.step
    colour = 3 + 10 * (comm.rank % 2)  # (each half its own data, so its own state)
    got.append(_selected(sub, oktopk, colour))
    if resized and oktopk.step != 1:  # (the sub-communicator's first call, a recompute)
        got.append(f"oktopk kept its step ({step}) on a communicator of another size")
    refused = _selected(sub, exdyna, colour)
    if resized:  # (the class's name: CollectiveInputError is a ValueError, errors.py)
        want = f"CollectiveInputError: exdyna was set up for n={N} on {comm.size} ranks"
        said = refused.startswith(want) and "call its reset() on every rank" in refused
        got.append("ok" if said else f"exdyna on the sub-communicator: {refused}")
        exdyna.reset()
        got.append(_selected(sub, exdyna, colour))
        exdyna.reset()
    else:
        got.append(refused)
    back = _selected(world, oktopk, 4)
    if comm.size > 1:  # the halves' states differ (their data did)
        want = "CollectiveInputError: algorithm options (and the state of earlier calls)"
        remedy = "call its reset(), or its GradientReducer's, on every rank first, or keep "
        said = back.startswith(want) and "rank 1 differs from rank 0" in back
        said = said and remedy + "one instance per communicator" in back
        got.append("ok" if said else f"back: {back}")
        oktopk.reset()
        got.append(_selected(world, oktopk, 5))
    else:
        got.append(back)
    got.append(_selected(world, exdyna, 6))
    step = oktopk.step
    got.append(_selected(world, oktopk, 7, n=2 * N))  # another n: a fresh start too
    if step and oktopk.step != 1:
        got.append(f"oktopk kept its step ({step}) for another n")
    sub.Free()
    bad = [g for g in got if g != "ok"]
    assert_all(comm, not bad, f"{bad}")


def test_the_callers_pending_messages_do_not_meet_the_algorithms(comm):
    """sparsecoll's messages travel on a duplicate of the caller's communicator: a receive
    the caller left pending across the calls with ``ANY_SOURCE``/``ANY_TAG`` matched an
    algorithm's message (the job hung), and one of the caller's sends with an algorithm's
    tag was taken for the algorithm's (MPI: "Message truncated"). Every algorithm, and a
    GradientReducer's steps, with such a receive pending: each result is the exact sum (or
    the same on every rank, for a selecting one), and the receive gets the caller's message
    sent after them."""
    world = comm.mpi_comm
    buf = np.zeros(1 << 16, np.uint8)
    wild = world.Irecv(buf, MPI.ANY_SOURCE, MPI.ANY_TAG)
    bad = []
    for seed, name in enumerate(available_algorithms()):
        if algorithm_class(name).exact:
            bad.append(_wrong(_reduce(world, seed, name), world, seed))
        else:
            vals, idx = local_input(_case(seed), comm.rank, comm.size)
            out = sparsecoll.allreduce(world, vals, idx, n=N, algorithm=name, k=20)
            same = world.allgather((out.indices.tobytes(), out.values.tobytes()))
            bad += [] if all(s == same[0] for s in same) else [f"{name}: results differ"]
    red = GradientReducer(world, N, "oktopk", 0.02)
    for step in range(3):
        red.step(np.random.default_rng([step, comm.rank]).standard_normal(N))
    status = MPI.Status()
    if wild.Test(status):
        bad.append(
            f"the caller's receive matched {status.Get_count(MPI.BYTE)} bytes from "
            f"rank {status.Get_source()} with tag {status.Get_tag()}"
        )
    world.Barrier()  # (every rank has tested before any sends its message)
    note = np.frombuffer(b"mine %d" % comm.rank, np.uint8)
    world.Send(note, (comm.rank + 1) % comm.size, tag=77)  # (eager: a few bytes)
    wild.Wait(status)
    source = (comm.rank - 1) % comm.size
    if (status.Get_source(), status.Get_tag()) != (source, 77):
        bad.append(f"the caller's receive got {status.Get_source()}, {status.Get_tag()}")
    elif bytes(buf[: status.Get_count(MPI.BYTE)]) != b"mine %d" % source:
        bad.append("the caller's receive got another message")
    assert_all(comm, not [b for b in bad if b], f"{bad}")


def test_the_duplicate_is_freed_with_the_communicator(comm):
    """The duplicate that carries a blocking call's messages is freed when the user frees
    the communicator (kept, a loop making, using and freeing sub-communicators ran out of
    MPICH's 2048 context ids after about 2000 rounds: "Too many communicators")."""
    from sparsecoll import _keyvals

    sub = comm.mpi_comm.Split(0, comm.rank)
    result = sparsecoll.allreduce(sub, np.ones(2), [0, 1], n=4, algorithm="recursive_doubling")
    dup = sub.Get_attr(_keyvals._APART_KEYVAL)
    made = dup is not None and dup != MPI.COMM_NULL
    sub.Free()
    freed = dup is not None and dup == MPI.COMM_NULL
    ok = made and freed and result.values.tolist() == [comm.size] * 2
    assert_all(comm, ok, f"duplicate made {made}, freed {freed}, result {result.values}")


@pytest.mark.parametrize(
    ("what", "kind", "says"),
    [
        ("past the buffer", CollectiveInputError, "sendcounts add up to"),
        ("negative", CollectiveInputError, "sendcounts must be >= 0"),
        ("one count short", CollectiveInputError, "one count per rank"),
        ("a float", CollectiveTypeError, "cannot be interpreted as an integer"),
    ],
)
def test_alltoallv_counts_bad_on_one_rank_raise_everywhere(comm, what, kind, says):
    """Communicator.alltoallv's sendcounts, bad on the last rank alone: every rank raises
    the same error naming it, in the counts' exchange (no extra round). Counts adding up
    past the buffer sent the memory that followed it, silently (MPI read it); a negative
    count raised numpy's "negative dimensions are not allowed" on one rank and MPI's
    "Invalid count" on another; a float was truncated. Good counts then work."""
    x = np.arange(2 * comm.size, dtype=np.float64) + 100 * comm.rank
    counts: list = [2] * comm.size
    if comm.rank == comm.size - 1:
        counts = {
            "past the buffer": [2] * (comm.size - 1) + [3],
            "negative": [-1] + [2] * (comm.size - 1),
            "one count short": [2] * (comm.size - 1),
            "a float": [2.0] * comm.size,
        }[what]
    with pytest.raises(kind) as info:
        comm.alltoallv(x, counts)
    msg = str(info.value)
    same = len(set(comm.allgather_object(msg))) == 1
    assert_all(comm, same and says in msg and msg.endswith(f"on rank {comm.size - 1}"), msg)
    out, got = comm.alltoallv(x, [2] * comm.size)
    want = [
        v for r in range(comm.size) for v in (100 * r + 2 * comm.rank, 100 * r + 2 * comm.rank + 1)
    ]
    assert_all(comm, got == [2] * comm.size and out.tolist() == want, f"{got} {out}")
