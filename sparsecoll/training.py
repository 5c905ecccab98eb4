"""GradientReducer: a stateful sparse gradient allreduce with error feedback, for training loops.

Each step, on every rank: ``accumulated = grad + residual``; about ``density·n`` entries of it
are selected and reduced with the chosen algorithm; the averaged (or summed) dense update comes
back, the same on every rank; whatever of ``accumulated`` did not reach the update stays in
``residual`` (error feedback), so nothing is lost::

    sum of updates (× P when averaging) + sum over ranks of residuals == sum of all gradients

How each kind of algorithm is driven:

* ``dense``: no selection; a dense allreduce of the accumulated gradient (the baseline);
* exact algorithms (allgather, rabenseifner, ...): this rank's top-k of ``accumulated``
  (``k = round(density·n)``), reduced exactly; the selected entries leave the residual;
* selecting algorithms (gtopk, oktopk): the local top-k goes in; ``result.contributed`` says
  which of this rank's entries reached the result, and only those leave the residual;
* exdyna: the algorithm sparsifies the dense accumulated gradient itself (its own partition,
  its own threshold, ``k = round(density·n)`` globally); every rank drops all selected entries.

``warmup`` steps of dense allreduce come first (all algorithms). The state (residual, step,
the algorithm's state, byte counters) can be saved with :meth:`state_dict` and restored with
:meth:`load_state_dict`; every rank saves and restores its own.
"""

from __future__ import annotations

import copy
import zlib
from typing import Any

import numpy as np

from . import select
from ._array import as_array, get_array_module, identity, to_host, to_module
from .algorithms.base import Algorithm
from .api import collective_check
from .comm import CommStats, Communicator
from .registry import algorithm_class
from .sparse import VALUE_DTYPES, SparseVector

__all__ = ["GradientReducer"]

STATE_VERSION = 1
# local selection policies for the algorithms that take a local top-k (not dense, not exdyna)
SELECTIONS = {
    "exact": None,  # select.topk every step
    "reuse": select.ReuseThreshold,  # Ok-Topk: exact every `interval` steps, nudged between
    "sampling": select.SamplingThreshold,  # DGC: threshold from a random sample
    "gaussian": select.GaussianThreshold,  # Gaussian-k: normal quantile, refined
}


class GradientReducer:
    """Sparse allreduce of gradients with error feedback; one instance per gradient vector.

    Args:
        comm: an mpi4py Intracomm or a :class:`sparsecoll.Communicator`.
        n: the gradient length (every step's gradient must have n elements, any shape).
        algorithm: a registered algorithm name (``"dense"`` for the uncompressed baseline).
        density: the fraction of entries to send: ``k = round(density·n)`` entries per rank
            (exact algorithms, gtopk, oktopk) or in all (exdyna). In ``(0, 1]``.
        warmup: number of first steps reduced densely (no selection, no residual).
        average: divide the sum by the number of ranks (the usual data-parallel mean).
        error_feedback: keep what was not applied in the residual (default); False drops it.
        momentum: momentum correction (DGC, Lin et al. 2018) when > 0: the reducer keeps a
            velocity ``u = momentum·u + grad`` and accumulates ``u`` instead of ``grad``; the
            velocity is zeroed where entries were sent (momentum factor masking). Use it
            with a momentum-free optimizer (plain SGD): the update already carries the
            momentum. Default 0 (the optimizer's own momentum acts on the sparse updates).
        selection: how this rank picks its ~k entries (algorithms that take a local top-k):
            ``"exact"`` (top-k every step), or a :mod:`sparsecoll.select` estimator:
            ``"reuse"`` (Ok-Topk's threshold reuse), ``"sampling"`` (DGC), ``"gaussian"``;
            ``selection_options`` go to its constructor (e.g. ``{"interval": 32}``). Its
            state is part of the checkpoint.
        check: agree on every step's input collectively (one small allreduce), so a bad
            gradient on one rank raises the same error on every rank instead of hanging.
        **options: more constructor options for the algorithm (e.g. ``tau=`` for oktopk).

    Every rank must build its reducer with the same arguments and call :meth:`step` the same
    number of times.
    """

    def __init__(
        self,
        comm: Any,
        n: int,
        algorithm: str = "allgather",
        density: float = 0.01,
        *,
        warmup: int = 0,
        average: bool = True,
        error_feedback: bool = True,
        momentum: float = 0.0,
        selection: str = "exact",
        selection_options: dict[str, Any] | None = None,
        check: bool = True,
        **options: Any,
    ) -> None:
        self.comm = Communicator.wrap(comm)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"n must be a non-negative integer, got {n!r}")
        if not isinstance(algorithm, str):
            raise TypeError(f"algorithm must be a registered name, got {type(algorithm).__name__}")
        density = float(density)
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, (int, np.integer)) or warmup < 0:
            raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
        momentum = float(momentum)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        self.n = int(n)
        self.density = density
        self.momentum = momentum
        self.k = min(self.n, max(1, round(density * self.n))) if self.n else 0
        self.warmup = int(warmup)
        self.average = bool(average)
        self.error_feedback = bool(error_feedback)
        self.check = bool(check)
        self.algorithm_name = algorithm
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, got {selection!r}")
        self.selection = selection
        est = SELECTIONS[selection]
        self._selector = None if est is None else est(k=self.k, **(selection_options or {}))
        cls = algorithm_class(algorithm)
        opts = cls.default_options(self.n, self.k)
        opts.update(options)
        self.algorithm: Algorithm = cls(**opts)
        self._crc = zlib.crc32(algorithm.encode())
        self._is_dense = algorithm == "dense"
        self._has_dense_path = hasattr(self.algorithm, "reduce_dense")
        self.steps = 0
        self._residual: Any = None
        self._pending_residual: np.ndarray | None = None  # restored, not yet on its module
        self._velocity: Any = None  # momentum correction's u (None when momentum is 0)
        self._last = _StepInfo()
        self._totals = CommStats()
        self._sparse_steps = 0
        self._density_sum = 0.0

    # -- public ---------------------------------------------------------------------------
    @property
    def residual(self) -> Any:
        """This rank's error-feedback memory (dense, the module and dtype of the gradients;
        None before the first step)."""
        if self._residual is None and self._pending_residual is not None:
            return self._pending_residual
        return self._residual

    @property
    def velocity(self) -> Any:
        """This rank's momentum-correction velocity after the last step (masked where sent;
        None without momentum or before the first step)."""
        return self._velocity

    def step(self, grad: Any) -> Any:
        """Reduce this rank's gradient; return the dense update, the same on every rank.

        ``grad`` is a numpy/CuPy array (or a torch tensor, returned as torch) of n elements
        and float16/32/64 dtype; it is not modified. The update has its shape and dtype.
        """
        arr, wrap, error, prepared = None, identity, None, None
        try:
            arr, wrap = as_array(grad, "grad")
            self._check_local(arr)
            prepared = self._prepare(arr.reshape(-1))  # selection raises on NaN: agreed below
        except (TypeError, ValueError) as exc:
            error = exc
        if self.check:
            sig = None
            if error is None:
                sig = [self.n, VALUE_DTYPES.index(arr.dtype), self.steps, self._crc]
                sig += self.algorithm.signature()[:4]
            collective_check(self.comm, error, sig, ("n", "grad dtype", "step", "algorithm"))
        elif error is not None:
            raise error
        with self.comm.measure() as st:
            update = self._reduce(*prepared)
        self._last.stats = st
        for f in ("bytes_sent", "bytes_recv", "messages_sent", "meta_bytes_sent"):
            setattr(self._totals, f, getattr(self._totals, f) + getattr(st, f))
        self.steps += 1
        return wrap(update.reshape(arr.shape))

    def step_async(self, grad: Any, out: Any = None) -> Any:
        """Start :meth:`step` on the communicator's progress thread; ``wait()`` on the
        returned :class:`sparsecoll.SparseRequest` gives the update (or the step's error).

        Steps run in submission order. ``grad`` (and ``out``) are borrowed, and the
        reducer's state is in use, until the request completes: wait for it before
        calling :meth:`step` or reading the reducer's state.
        """
        kw = {} if out is None else {"out": out}
        return self.comm.engine().submit(
            lambda: self.step(grad, **kw), f"step_async({self.algorithm_name!r})", self.comm
        )

    def stats(self) -> dict[str, Any]:
        """Requested and achieved density, and bytes per rank (last step and in total).

        ``achieved_density`` is the nonzero count of the last update over n (the union over
        ranks for exact algorithms: their build-up shows here); ``selected_density`` is this
        rank's own selection over n; ``mean_achieved_density`` averages the sparse steps.
        ``dense_bytes`` is what one dense allreduce step moves per rank, for comparison.
        """
        st, tot = self._last.stats, self._totals
        p = self.comm.size
        itemsize = self._residual.dtype.itemsize if self._residual is not None else 4
        return {
            "algorithm": self.algorithm_name,
            "steps": self.steps,
            "warmup": self.warmup,
            "requested_density": self.density,
            "achieved_density": self._last.nnz / self.n if self.n else 0.0,
            "selected_density": self._last.selected / self.n if self.n else 0.0,
            "mean_achieved_density": (
                self._density_sum / self._sparse_steps if self._sparse_steps else 0.0
            ),
            "bytes_sent": st.bytes_sent,
            "bytes_recv": st.bytes_recv,
            "meta_bytes_sent": st.meta_bytes_sent,
            "bytes_sent_total": tot.bytes_sent,
            "bytes_recv_total": tot.bytes_recv,
            "meta_bytes_sent_total": tot.meta_bytes_sent,
            "dense_bytes": 2 * (p - 1) * self.n * itemsize // p,
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's state as plain Python objects and numpy arrays (picklable).

        Everything but the communicator: the residual (copied to the host), the step
        counter, the algorithm instance's state and the statistics.
        """
        res = self.residual
        return {
            "version": STATE_VERSION,
            "n": self.n,
            "algorithm": self.algorithm_name,
            "density": self.density,
            "steps": self.steps,
            "residual": None if res is None else np.array(to_host(res), copy=True),
            "velocity": None if self._velocity is None else np.array(to_host(self._velocity)),
            "algorithm_state": _host_copy(vars(self.algorithm)),
            "selection_state": _host_copy(_slot_values(self._selector)),
            "totals": self._totals.as_dict(),
            "density_sum": self._density_sum,
            "sparse_steps": self._sparse_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved by a reducer built with the same arguments."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"state version {state.get('version')} != {STATE_VERSION}")
        for key, mine in (("n", self.n), ("algorithm", self.algorithm_name)):
            if state[key] != mine:
                raise ValueError(f"state is for {key}={state[key]!r}, this reducer has {mine!r}")
        self.steps = int(state["steps"])
        res = state["residual"]
        self._residual = None
        self._pending_residual = None if res is None else np.array(res, copy=True)
        vel = state.get("velocity")
        self._velocity = None if vel is None else np.array(vel, copy=True)
        vars(self.algorithm).update(copy.deepcopy(state["algorithm_state"]))
        for name, value in copy.deepcopy(state["selection_state"]).items():
            setattr(self._selector, name, value)
        self._totals = CommStats(**state["totals"])
        self._density_sum = float(state["density_sum"])
        self._sparse_steps = int(state["sparse_steps"])

    def __repr__(self) -> str:
        return (
            f"GradientReducer(n={self.n}, algorithm={self.algorithm_name!r}, "
            f"density={self.density}, steps={self.steps})"
        )

    # -- internals --------------------------------------------------------------------------
    def _check_local(self, arr: Any) -> None:
        if int(arr.size) != self.n:
            raise ValueError(f"grad must have {self.n} elements, got {int(arr.size)}")
        if arr.dtype not in VALUE_DTYPES:
            raise TypeError(f"grad must be float16, float32 or float64, got {arr.dtype}")
        res = self.residual
        if res is not None and res.dtype != arr.dtype:
            raise TypeError(f"grad dtype changed from {res.dtype} to {arr.dtype}")

    def _prepare(self, g: Any) -> tuple[Any, Any, Any]:
        """``(accumulated, selected indices or None, this step's velocity or None)``, before
        anything moves. The residual and the velocity are untouched until the step succeeds,
        so a step that fails on some rank changes nothing.
        """
        xp = get_array_module(g)
        res = self._residual
        if res is None and self._pending_residual is not None:
            res = to_module(self._pending_residual, xp).astype(g.dtype)
        u = None
        if self.momentum:
            vel = self._velocity
            u = (
                g.copy()
                if vel is None
                else to_module(vel, xp).astype(g.dtype, copy=False) * self.momentum + g
            )
            g = u
        acc = g + res if res is not None and self.error_feedback else g.copy()
        if self._is_dense or self.steps < self.warmup or self._has_dense_path:
            return acc, None, u
        if self._selector is None:
            idx, vals = select.topk(acc, self.k)
        else:
            chosen = self._selector.select(acc)
            idx, vals = chosen.indices, chosen.values
        return acc, idx[vals != 0], u  # exact zeros carry nothing

    def _reduce(self, acc: Any, sel: Any, velocity: Any) -> Any:
        xp = get_array_module(acc)
        p = self.comm.size
        if sel is None and (self._is_dense or self.steps < self.warmup):
            update = self.comm.allreduce(acc)
            acc[...] = 0
            self._last.record(self.n, self.n)
        else:
            if sel is None:  # exdyna: the algorithm selects from the dense accumulated array
                result = self.algorithm.reduce_dense(self.comm, acc)
                sel = result.indices
                selected = int(result.info["selected"])
            else:
                result = self.algorithm.reduce(self.comm, SparseVector(sel, acc[sel], self.n))
                selected = int(sel.shape[0])
                if result.contributed is not None:
                    sel = sel[result.contributed]
            acc[sel] = 0  # what reached the update leaves the residual
            if velocity is not None:
                velocity[sel] = 0  # momentum factor masking
            update = xp.zeros(self.n, dtype=acc.dtype)
            update[result.indices] = result.values
            self._last.record(result.nnz, selected)
            self._sparse_steps += 1
            self._density_sum += result.nnz / self.n if self.n else 0.0
        self._residual, self._pending_residual = acc, None
        if velocity is not None:
            self._velocity = velocity
        if self.average and p > 1:
            update /= p
        return update


class _StepInfo:
    __slots__ = ("nnz", "selected", "stats")

    def __init__(self) -> None:
        self.nnz = 0
        self.selected = 0
        self.stats = CommStats()

    def record(self, nnz: int, selected: int) -> None:
        self.nnz, self.selected = nnz, selected


def _slot_values(obj: Any) -> dict[str, Any]:
    """The state of a ``__slots__`` object (the selection estimators), as a dict."""
    if obj is None:
        return {}
    names = [n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
    return {n: getattr(obj, n) for n in names if hasattr(obj, n)}


def _host_copy(obj: Any) -> Any:
    """A deep copy with device arrays moved to the host (numpy)."""
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v) for v in obj)
    if hasattr(obj, "__cuda_array_interface__"):
        return to_host(obj).copy()
    return copy.deepcopy(obj)
