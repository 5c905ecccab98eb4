"""The step machinery :class:`~sparsecoll.GradientReducer` inherits: one step from its input
checks through the ranks' agreement, the pass over the gradient, the strategy's collective
(:mod:`._steps`) and the O(k) end, on the reducer's buffers (the residual, the velocity,
their spares, the reused update).

What the reducer keeps (buffers, the strategy's state, statistics) changes only once the
step succeeded on every rank: a step that fails anywhere raises on every rank and leaves
every rank's reducer as it was. The accumulated vector is written to a spare buffer, not over
the residual; that spare holds the residual before the last step until the next one.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import numpy as np

from .. import select
from .._agree import algorithm_signature, collective_check, watch
from .._array import (
    as_array,
    device_scope,
    fresh,
    get_array_module,
    identity,
    same_device,
    to_host,
    to_module,
    wait_for_foreign,
)
from ..comm import CommStats
from ..errors import NonFiniteError
from ..sparse import VALUE_DTYPES
from ._finish import finish
from ._steps import Prepared, StepStrategy, numba_host, restore, snapshot

__all__ = ["StepInfo", "Stepping", "add_totals"]


class Stepping:
    """GradientReducer's step internals (its attributes are the reducer's: see reducer.py)."""

    def _wait_pending(self) -> None:
        """Wait for the step_async calls submitted so far: they use (and change) the state."""
        engine = self.comm._attached_engine()
        if engine is not None and not engine.is_worker_thread():
            engine.drain()

    def _update_free(self) -> bool:
        """Whether a step made now may write the reused update buffer: reuse_update is on,
        and no step_async's update in it is still to be handed over (by wait(); a request
        dropped unwaited hands over nothing). Never waits: a step whose request has not
        completed yet still holds the buffer."""
        if not self.reuse_update:
            return False
        req = None if self._update_lent is None else self._update_lent()
        return req is None or req._taken or (req.test() and req._error is not None)

    def _run_step(
        self, grad: Any, out: Any, failed: BaseException | None = None, reuse: bool = False
    ) -> Any:
        self._wait_pending()
        label = f"step({self.algorithm_name!r})"
        with self.comm.serial(), watch(self.comm, label), contextlib.ExitStack() as scope:
            return self._step(grad, out, scope, failed, reuse, label)

    def _step(
        self,
        grad: Any,
        out: Any,
        scope: contextlib.ExitStack,
        failed: BaseException | None,
        reuse: bool,
        label: str,
    ) -> Any:
        arr, wrap, dest, error, prepared, saved, sig = None, identity, None, None, None, None, None
        self._can_take_back = False  # (a step failing on any rank leaves nothing to take back)
        try:
            if failed is not None:
                raise failed
            arr, wrap = as_array(grad, "grad")
            # work on grad's GPU, whatever the current device (step_async's progress thread
            # starts on device 0, as every new CUDA host thread does)
            scope.enter_context(device_scope(arr))
            self.comm.check_buffer(arr, "grad")  # (an NCCLCommunicator's GPU)
            self._check_local(arr)
            if out is not None:
                dest, _ = as_array(out, "out", writable=True)
                self._check_out(dest, arr)
            # what the selection moves in _prepare (a ReuseThreshold's schedule, a sampler's
            # generator, the cut prediction): given back below if the step fails on any rank
            saved = snapshot(self._prediction, self._selector)
            flat = None if dest is None else dest.reshape(-1)
            prepared = self._prepare(arr.reshape(-1), flat, reuse)
            if self.check:
                code = VALUE_DTYPES.index(arr.dtype)
                sig = [self.n, code, self._crc, self.steps, *algorithm_signature(self.algorithm)]
        except Exception as exc:  # (shared with every rank: none is left waiting)
            error = exc
        t0 = time.perf_counter()
        try:
            if self.check:
                names = self._signature_names
                collective_check(self.comm, error, sig, names, self._detail, call=label)
            elif error is not None:
                raise error
            self._last.comm_s = time.perf_counter() - t0
            # (apart: the algorithm's messages on a duplicate of the communicator, where the
            # caller's own, pending across the step, cannot match them)
            with self.comm.measure() as st, self.comm.apart():
                # (an error the algorithm agrees on is raised on every rank: the step then
                # changes nothing, as one failing above)
                update = self._reduce(prepared)
        except BaseException:
            if saved is not None:
                restore(self._prediction, self._selector, saved)
            raise
        self._last.stats = st
        add_totals(self._totals, st)
        self.steps += 1
        if out is not None:
            wait_for_foreign(out, dest)
            return out
        update = update.reshape(arr.shape)
        return fresh(wrap, update) if reuse else wrap(update)  # (DLPack orders the stream)

    def _check_local(self, arr: Any) -> None:
        if int(arr.size) != self.n:
            raise ValueError(f"grad must have {self.n} elements, got {int(arr.size)}")
        if arr.dtype not in VALUE_DTYPES:
            raise TypeError(f"grad must be float16, float32 or float64, got {arr.dtype}")
        res = self.residual
        if res is not None and res.dtype != arr.dtype:
            if self._residual is None:  # (a restored state's, before its first step)
                raise TypeError(
                    f"the state restored by load_state_dict() was saved from {res.dtype} "
                    f"gradients (step with those, load it with its residual and velocity cast "
                    f"to {arr.dtype}, or reset() to drop it), grad is {arr.dtype}"
                )
            raise TypeError(f"grad dtype changed from {res.dtype} to {arr.dtype}")

    @staticmethod
    def _check_out(dest: Any, arr: Any) -> None:
        if int(dest.size) != int(arr.size) or dest.dtype != arr.dtype:
            raise ValueError(
                f"out must have {int(arr.size)} elements of {arr.dtype}, got {int(dest.size)} "
                f"of {dest.dtype}"
            )
        if not same_device(dest, arr):
            where = "a host array" if get_array_module(dest) is np else f"GPU {dest.device.id}"
            raise TypeError(f"out must live on the same device as grad, got it on {where}")
        if not dest.flags.c_contiguous:  # (written as flat memory in C order)
            raise ValueError(
                "out must be C-contiguous, got a non-C-contiguous array (e.g. Fortran order, "
                "channels_last or a strided view): pass a C-contiguous buffer, or copy the "
                "returned update into it"
            )
        if not getattr(dest.flags, "writeable", True):  # (CuPy arrays have no such flag)
            raise ValueError("out must be writeable, got a read-only array")

    def _buffers(self, g: Any, prep: Prepared) -> None:
        """Fill ``prep`` with the residual and velocity to read (zeros before the first
        step, or restored ones moved to g's module) and the spare buffers to write, on g's
        module and dtype. What the reducer keeps changes only when the step succeeds."""
        xp = get_array_module(g)

        def current(a: Any) -> Any:
            if a is None:
                return xp.zeros(self.n, g.dtype)
            if same_device(a, g) and a.dtype == g.dtype:
                return a
            # (kept on the host, or on another GPU than this step's gradient)
            return to_module(to_host(a), xp).astype(g.dtype)

        def spare(a: Any) -> Any:
            ok = a is not None and same_device(a, g) and a.dtype == g.dtype
            return a if ok else xp.empty(self.n, g.dtype)

        res = self._residual if self._residual is not None else self._pending_residual
        prep.res, prep.acc = current(res), spare(self._spare)
        if self.momentum:
            prep.old_velocity = current(self._velocity)
            prep.velocity = spare(self._spare_velocity)

    def _prepare(self, g: Any, dest: Any, reuse: bool) -> Prepared:
        """One pass over ``g``: the accumulated vector (in the spare buffer), the new
        velocity, the update buffer zeroed (or marked to be written whole after the
        collective), and this step's selection or its candidates.
        Nothing the reducer keeps is changed (the step may still fail on some rank)."""
        xp = get_array_module(g)
        prep = Prepared()
        self._buffers(g, prep)
        step = self._warmup_step if self.steps < self.warmup else self._strategy
        prep.strategy = step
        numba = numba_host(g)
        # a float16 average: the P-sum may overflow float16 where the mean does not, so the
        # sparse step's collective returns the mean itself (dense steps: op="mean")
        prep.averaged = self.average and self.comm.size > 1 and g.dtype == np.float16
        if dest is None and reuse:
            if self._update is None or not same_device(self._update, g):
                self._update, self._update_nnz = xp.zeros(self.n, g.dtype), None
            prep.update, prep.reused = self._update, True
        else:  # (made here, before the ranks agree: n values can run out on this rank alone)
            prep.update = dest if dest is not None else xp.empty(self.n, g.dtype)
            # a sparse update is scattered into zeros: zeroed in the same pass, or (Numba)
            # written whole after the collective, each line once (prep.late_zero)
            prep.late_zero = numba and not step.dense
        plan = step.plan(prep, g, numba)
        prep.found = select.accumulate(
            g,
            prep.res if self.error_feedback else None,
            out=prep.acc,
            cut=plan.cut if plan.cut > 0 else math.inf,
            lo=plan.lo,
            hi=plan.hi,
            cap=plan.cap,
            velocity=prep.old_velocity,
            velocity_out=prep.velocity,
            momentum=self.momentum,
            zero=None if step.dense or prep.reused or prep.late_zero else prep.update,
            zero_cut=plan.zero_cut,
            buckets=plan.buckets,
            workspace=self._workspace,
            nonzeros=plan.nonzeros,
        )
        if prep.found.nonfinite:
            raise NonFiniteError(
                f"grad holds NaN or Inf: {prep.found.nonfinite} entries of grad + residual "
                f"are not finite (the step is skipped, the residual kept)"
            )
        step.choose(prep, plan, g.dtype)
        return prep

    def _reduce(self, prep: Prepared) -> Any:
        step = prep.strategy
        update = self._reduce_dense(prep) if step.dense else self._reduce_sparse(prep, step)
        # the step succeeded on every rank: keep what it wrote, recycle what it read
        self._residual, self._spare, self._pending_residual = prep.acc, prep.res, None
        if prep.velocity is not None:
            self._velocity, self._spare_velocity = prep.velocity, prep.old_velocity
        self._can_take_back = True
        return update

    def _reduce_dense(self, prep: Prepared) -> Any:
        """A dense step (warm-up, or the dense algorithm): all of acc is reduced and sent."""
        t0 = time.perf_counter()
        # (the mean is taken in float32 for float16)
        op = "mean" if self.average else "sum"
        update = self.comm.allreduce(prep.acc, out=prep.update, op=op, check=False, work=prep.work)
        self._last.comm_s += time.perf_counter() - t0
        prep.acc[...] = 0
        self._last.record(self.n, self.n)
        if self._is_dense and self.steps >= self.warmup:  # ("dense" past its warm-up)
            self._sparse_steps += 1
            self._density_sum += 1.0
        self._update_nnz = None  # (the reused update buffer, if it was that, is full)
        return update

    def _reduce_sparse(self, prep: Prepared, step: StepStrategy) -> Any:
        """A sparse step: the strategy's collective, then the O(k) end."""
        result, sent, selected, zeroed, seconds = step.exchange(prep)
        self._last.comm_s += seconds
        update = prep.update  # zeroed by the pass, written whole at the end, or reused
        old = None
        if prep.reused:
            if self._update_nnz is None:
                update[...] = 0
            else:
                old = self._update_nnz
            nnz = result.indices  # kept for the next step: not in the pass's workspace
            shared = any(np.may_share_memory(nnz, a) for a in self._workspace.values())
            self._update_nnz = nnz.copy() if shared else nnz
        # what reached the update leaves the residual (and the velocity: momentum factor
        # masking); the update's old entries are zeroed, the result scattered
        p = self.comm.size
        divisor = p if self.average and p > 1 and not prep.averaged else 1
        finish(
            prep.acc, prep.velocity, sent, update, old, result.indices, result.values,
            divisor, zeroed, prep.late_zero, step.drops_sent,
        )  # fmt: skip
        self._last.record(result.nnz, selected)
        self._sparse_steps += 1
        self._density_sum += result.nnz / self.n if self.n else 0.0
        return update


def add_totals(totals: CommStats, delta: CommStats) -> None:
    """Add a step's traffic to the running totals (the fields :meth:`GradientReducer.stats`
    counts)."""
    for f in ("bytes_sent", "bytes_recv", "messages_sent", "meta_bytes_sent"):
        setattr(totals, f, getattr(totals, f) + getattr(delta, f))


class StepInfo:
    __slots__ = ("comm_s", "nnz", "selected", "stats")

    def __init__(self) -> None:
        self.nnz = 0
        self.selected = 0
        self.stats = CommStats()
        self.comm_s = 0.0

    def record(self, nnz: int, selected: int) -> None:
        self.nnz, self.selected = nnz, selected
