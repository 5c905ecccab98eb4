"""The DDP communication hooks: :func:`sparse_allreduce_hook` reduces each bucket at once,
:func:`async_sparse_allreduce_hook` on the communicator's progress thread. Both take a
:class:`SparseHookState`; a bucket is reduced densely during the warm-up, else by its
reducer, and an error on any rank reaches ``backward()`` on every rank alike."""

from __future__ import annotations

from typing import Any

from ..._agree import collective_check, watch
from ..._array import as_array, device_scope, is_device_array, synchronize
from ...comm import widening_buffer
from ...errors import NonFiniteError
from ...sparse import VALUE_DTYPES
from ...training import GradientReducer
from ._group import torch_module
from ._state import HOOK_AGREED, WARMUP_MARK, SparseHookState, add_traffic

__all__ = ["async_sparse_allreduce_hook", "sparse_allreduce_hook"]


def _reduce_bucket(
    state: SparseHookState,
    buf: Any,
    red: GradientReducer | None,
    iteration: int,
    last: bool,
    label: str,
    error: BaseException | None = None,
) -> Any:
    """The bucket's average, for DDP: dense during the warm-up (``red`` None), else ``red``'s
    sparse update; written over ``buf`` and ``buf`` returned, or a new sparse tensor for a
    sparse gradient's bucket. ``last``: the iteration's last bucket, after which an
    iteration in which a bucket failed is taken back. ``label``: the watchdog's name for it.
    ``error``: this rank's failure to get the bucket's reducer, raised on every rank."""
    try:
        return _reduce_one(state, buf, red, iteration, label, error)
    finally:
        if last:
            _end_iteration(state, iteration)


def _end_iteration(state: SparseHookState, iteration: int) -> None:
    """After the iteration's last bucket: if a bucket failed (on every rank alike), the
    training loop skips the batch (backward raised, or GradScaler saw the NaN), so the
    buckets that stepped take their residual back and nothing they sent is lost."""
    # (once each: a backward cut short before its last bucket leaves the iteration count
    # where it was, so a bucket of it may have stepped twice under that number)
    stepped = {id(red): red for it, red in state._stepped if it == iteration}.values()
    failed = iteration in state._failed
    state._stepped, state._failed = [], set()
    if failed:
        for red in stepped:
            red.take_back()


def _reduce_one(
    state: SparseHookState,
    buf: Any,
    red: GradientReducer | None,
    iteration: int,
    label: str,
    error: BaseException | None,
) -> Any:
    # numpy has no bfloat16: such a bucket is reduced in float32 (exact widening), its
    # residual kept in float32, and the update rounded back into the bucket. A sparse
    # gradient's bucket (nn.Embedding(sparse=True): DDP gives each its own, a sparse COO
    # tensor) is reduced as its dense gradient, and the update goes back to DDP as a sparse
    # tensor of the bucket's layout. The widening and the dense copy (n floats) can fail on
    # one rank alone (out of memory): the error joins the ranks' agreement (the step's, or
    # the warm-up's), so that every rank raises it alike
    torch = torch_module()
    work = buf
    sparse = buf.layout == torch.sparse_coo
    try:
        if sparse and error is None:
            work = buf.to_dense()  # (duplicate indices summed)
        if work.dtype == torch.bfloat16 and error is None:
            work = work.float()
    except Exception as exc:  # (shared with every rank: none is left waiting)
        error = exc
    try:
        if red is None:
            _reduce_dense(state, work, error, label)
        else:
            if error is not None:
                red.fail_step(error)  # (raises, on every rank)
            red.step(work, out=work)  # the update overwrites the gradient in place
    except NonFiniteError:  # (raised on every rank alike: every rank fills alike)
        state._failed.add(iteration)
        if state.nonfinite != "nan":
            raise
        work.fill_(float("nan"))
    except Exception:  # (agreed errors: raised on every rank alike)
        state._failed.add(iteration)
        raise
    else:
        if red is not None:
            state._stepped.append((iteration, red))
    if sparse:  # (DDP copies it into the gradient: the same sparse and dense dimensions)
        return work.to(buf.dtype).to_sparse(buf.sparse_dim())
    if work is not buf:
        buf.copy_(work)
    return buf


def _reduce_dense(
    state: SparseHookState, work: Any, error: BaseException | None, label: str
) -> None:
    """Overwrite ``work`` with its average over the ranks (the warm-up), after the ranks
    agree that every one has its bucket ready (``error``: this rank's failure to). Watched
    as a blocking call (with the watchdog on) under ``label``, as a bucket's step is."""
    arr, wide, sig = None, None, None
    if error is None:
        try:
            arr, _ = as_array(work, "bucket", writable=True)
            state.comm.check_buffer(arr, "bucket")  # (an NCCLCommunicator's GPU)
            sig = [int(arr.size), VALUE_DTYPES.index(arr.dtype), WARMUP_MARK]
            wide = widening_buffer(arr)  # (float16: the float32 array it is summed in)
        except Exception as exc:  # (shared with every rank: none is left waiting)
            error = exc
    # (the check and the allreduce as one: no other thread's messages come between them)
    with state.comm.serial(), watch(state.comm, label):
        collective_check(state.comm, error, sig, HOOK_AGREED)
        # on the bucket's GPU: the asynchronous hook runs this on the progress thread, whose
        # current device is 0 (as every new CUDA host thread's)
        with device_scope(arr), state.comm.measure() as st:
            # the bucket's average overwrites it (float16: taken in float32, no overflow of a
            # sum whose average fits)
            state.comm.allreduce(arr, out=arr, op="mean", check=False, work=wide)
            if is_device_array(arr):
                # its last writes (the mean, a float16 cast) are kernels on CuPy's stream into
                # torch's memory: nothing orders torch's stream after them, so wait (as
                # GradientReducer.step does for a foreign out)
                synchronize()
        add_traffic(state._outside_stats, st)


def _bucket_reducer(
    state: SparseHookState, bucket: Any
) -> tuple[GradientReducer | None, BaseException | None]:
    """The bucket's reducer (None during the warm-up, or when this rank failed to build it)
    and this rank's error in building it; counts the iteration on its last bucket. Building
    it can fail on one rank alone (memory running out for the copy of a restored state, or
    of the state carried to a new density): the error goes to the bucket's agreement, so
    that every rank raises it.
    Raises what every rank raises alike, before counting the bucket (the launch check)."""
    buf = bucket.buffer()
    red, error = None, None
    state._check_launch()  # (raised before the bucket is counted: every bucket raises it)
    try:
        if state.iteration >= state.warmup:
            numel, dtype = int(buf.numel()), str(buf.dtype)
            red = state.reducer(bucket.index(), numel, dtype, bucket.parameters())
    except Exception as exc:  # (shared with every rank: none is left waiting)
        error = exc
    if bucket.is_last():
        state.iteration += 1
    return red, error


# DDP checks a hook's annotations against dist.GradBucket / Future[Tensor] at registration;
# bucket and return stay unannotated so that torch need not be imported to define the hook.
def sparse_allreduce_hook(state: SparseHookState, bucket):
    """DDP communication hook: average the bucket's gradients with sparse allreduce.

    Returns a completed ``torch.futures.Future`` holding the bucket's buffer, overwritten
    with the averaged update (the same on every rank).
    """
    torch = torch_module()
    buf = bucket.buffer()
    fut = torch.futures.Future()
    iteration, last = state.iteration, bucket.is_last()
    try:
        red, error = _bucket_reducer(state, bucket)
        label = _label(state, bucket, red, iteration)
        out = _reduce_bucket(state, buf, red, iteration, last, label, error)
    except Exception as exc:
        # raised inside the hook, the error leaves DDP's reducer mid-iteration (the next
        # forward fails an internal assertion): like the asynchronous hook, hand it over in
        # the future, so that it reaches backward() after every bucket came by
        fut.set_exception(exc)
        return fut.then(_value)
    fut.set_result(out)
    return fut


def async_sparse_allreduce_hook(state: SparseHookState, bucket):
    """DDP communication hook, overlapping: like :func:`sparse_allreduce_hook`, but the
    bucket is reduced on the communicator's progress thread while backward goes on.

    Returns a pending ``torch.futures.Future``, completed from the progress thread with the
    bucket's buffer (overwritten with the averaged update) or with the reduction's error.
    DDP lends the bucket's buffer until the future completes. Buckets are reduced in the
    order DDP hands them over (the same on every rank); warm-up iterations too.
    """
    torch = torch_module()
    buf = bucket.buffer()
    iteration, last = state.iteration, bucket.is_last()
    red, error, refused = None, None, None
    try:
        red, error = _bucket_reducer(state, bucket)
    except Exception as exc:  # (raised in turn, as a reduction's error, on every rank)
        refused = exc
    fut = torch.futures.Future()

    def run() -> None:
        try:
            if refused is not None:
                raise refused
            out = _reduce_bucket(state, buf, red, iteration, last, label, error)
        except BaseException as exc:
            # DDP's backward raises as soon as it sees a failed future, with the later
            # buckets still queued here (they would then write into buffers DDP has given
            # to the next iteration): the error waits for the iteration's last bucket
            state._failures.append((fut, exc))
            raise
        else:
            fut.set_result(out)
        finally:
            if last:
                failures, state._failures = state._failures, []
                for failed, exc in failures:
                    failed.set_exception(exc)

    label = _label(state, bucket, red, iteration)
    state.comm.engine(label).submit(run, label, owner=state.comm)
    # DDP reads the future's value in C++: a future completed by set_exception holds the
    # exception as its value ("Unable to cast <message> to Tensor"); chained, the error
    # reaches backward() as an error, with its type and message
    return fut.then(_value)


def _label(state: SparseHookState, bucket: Any, red: Any, iteration: int) -> str:
    """The bucket's reduction as the watchdog names it."""
    what = "dense warm-up" if red is None else repr(state.algorithm)
    return f"ddp bucket {bucket.index()} ({what}, iteration {iteration})"


def _value(fut: Any) -> Any:
    return fut.value()  # raises the reduction's error
