"""GradientReducer: a stateful sparse gradient allreduce with error feedback, for training loops.

Each step, on every rank: ``accumulated = grad + residual``; about ``density·n`` entries of it
are selected and reduced with the chosen algorithm (how: :mod:`._steps`); the averaged (or
summed) dense update comes back, the same on every rank; whatever of ``accumulated`` did not
reach the update stays in ``residual`` (error feedback), so nothing is lost::

    sum of updates (× P when averaging) + sum over ranks of residuals == sum of all gradients

``warmup`` steps of dense allreduce come first. A step that fails on any rank (NaN or Inf in
``grad + residual``, bad input) raises on every rank and leaves every rank's residual and
velocity as they were. The state can be saved with :meth:`~GradientReducer.state_dict` and
restored with :meth:`~GradientReducer.load_state_dict` (format: :mod:`._checkpoint`); every
rank saves and restores its own.
"""

from __future__ import annotations

import weakref
import zlib
from typing import Any

import numpy as np

from .._agree import ALGORITHM_SIGNATURE_LEN, agreement, class_name, watch
from .._array import to_host
from .._options import canonical, check_density, choice, effective_options, flag, integer, read_only
from ..algorithms.base import Algorithm
from ..comm import CommStats, Communicator
from ..registry import (
    _accepts_any,
    algorithm_class,
    algorithm_options,
    get_algorithm,
    refuse_unknown,
)
from ._checkpoint import STATE_VERSION, host_copy, read_state
from ._config import (
    AGREED,
    RANK_LOCAL_SELECTION_OPTIONS,
    REDUCER_KEYWORDS,
    REDUCER_SETS,
    SELECTIONS,
    check_momentum,
    check_selection_options,
    selection_version,
)
from ._stepping import StepInfo, Stepping
from ._steps import (
    DenseStep,
    Prediction,
    StepStrategy,
    selects_by_itself,
    slot_values,
    strategy_for,
)

__all__ = ["GradientReducer"]


class GradientReducer(Stepping):
    """Sparse allreduce of gradients with error feedback; one instance per gradient vector.

    Args:
        comm: an mpi4py Intracomm, a :class:`sparsecoll.Communicator`, or None (COMM_WORLD).
        n: the gradient length (every step's gradient must have n elements, any shape).
        algorithm: a registered algorithm name; ``"oktopk"`` (the default) keeps each rank's
            volume near 2k(P−1)/P; ``"dense"`` is the uncompressed baseline.
        density: the fraction of entries to send: ``k = round(density·n)`` entries per rank
            (exact algorithms, gtopk, oktopk) or in all (exdyna), at least 1 (n > 0). In
            ``(0, 1]``.
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
            state is part of the checkpoint. ``dense`` and ``exdyna`` take no local top-k:
            an estimator with them raises ValueError.
        reuse_update: return the reducer's own update buffer from :meth:`step` (when no
            ``out`` is given) instead of a new array: the previous update's entries are
            zeroed and the new ones scattered, O(k) instead of writing all n. The returned
            array is then valid until the next step (copy it to keep it) and must not be
            written to; a :meth:`step_async` update, until a step submitted after its
            ``wait()`` (steps submitted before write new arrays). Default False.
        check: agree on every step's input collectively (one small allreduce), so a bad
            gradient on one rank raises the same error on every rank instead of hanging.
        **options: more constructor options for the algorithm (e.g. ``tau=`` for oktopk);
            not ``k``, which ``density`` sets (a ``k=`` raises TypeError).

    Every rank must build its reducer with the same arguments and call :meth:`step` the same
    number of times.

    Example (one rank here; run the script under ``mpiexec -n P``)::

        >>> import numpy as np
        >>> from mpi4py import MPI
        >>> import sparsecoll
        >>> red = sparsecoll.GradientReducer(MPI.COMM_WORLD, n=8, algorithm="oktopk", density=0.25)
        >>> grad = np.arange(8, dtype=np.float32)
        >>> red.step(grad)  # the two largest entries; the rest stays in the residual
        array([0., 0., 0., 0., 0., 0., 6., 7.], dtype=float32)
        >>> red.residual
        array([0., 1., 2., 3., 4., 5., 0., 0.], dtype=float32)
        >>> red.step(grad)  # grad + residual: 4 + 4 and 5 + 5 now beat 6 and 7
        array([ 0.,  0.,  0.,  0.,  8., 10.,  0.,  0.], dtype=float32)
    """

    def __init__(
        self,
        comm: Any,
        n: int,
        algorithm: str = "oktopk",
        density: float = 0.01,
        *,
        warmup: int = 0,
        average: bool = True,
        error_feedback: bool = True,
        momentum: float = 0.0,
        selection: str = "exact",
        selection_options: dict[str, Any] | None = None,
        reuse_update: bool = False,
        check: bool = True,
        **options: Any,
    ) -> None:
        self._comm = Communicator.wrap(comm)
        n = integer("n", n, 0, int64=True)
        if not isinstance(algorithm, str):
            raise TypeError(
                f"algorithm must be a registered name, got {type(algorithm).__name__} (the"
                " reducer builds its own: k from density, other options as keywords)"
            )
        density = check_density(density)
        # (set here, not through the setters: they agree anew, on what is built below)
        self._n = int(n)
        self._density = density
        self._momentum = check_momentum("momentum", momentum)
        self._k = min(self.n, max(1, round(density * self.n))) if self.n else 0
        self._warmup = integer("warmup", warmup, 0)
        self._average = flag("average", average)
        self._error_feedback = flag("error_feedback", error_feedback)
        self._check_input = flag("check", check)
        self._reuse_update = flag("reuse_update", reuse_update)
        self._algorithm_name = algorithm
        self._selection = choice("selection", selection, SELECTIONS)
        if selection_options is not None and not isinstance(selection_options, dict):
            raise TypeError(
                f"selection_options must be a dict of the estimator's options or None, got "
                f"{type(selection_options).__name__}"
            )
        check_selection_options(selection, selection_options or {})
        if SELECTIONS[selection] is not None:  # bad estimator options fail here, early
            SELECTIONS[selection](k=self.k, **(selection_options or {}))
        cls = algorithm_class(algorithm)
        if selection != "exact" and (algorithm == "dense" or selects_by_itself(cls)):
            # (the estimator would be built, checkpointed and agreed on, but never consulted)
            how = (
                "reduces the whole gradient densely"
                if algorithm == "dense"
                else "selects by itself (its own partition and threshold)"
            )
            raise ValueError(
                f"selection={selection!r} would go unused: algorithm {algorithm!r} takes no "
                f"local top-k, it {how}; leave selection='exact' (the default)"
            )
        if "k" in options:  # k comes from density; a k= here would disagree with it silently
            raise TypeError(
                f"GradientReducer sets k from density (k = round(density·n) = {self.k}); "
                f"pass density={options['k']}/n instead of k={options['k']}"
            )
        if not _accepts_any(cls):  # (the algorithm's options but k, which density sets)
            takes = [name for name in algorithm_options(algorithm) if name != "k"]
            what = f"GradientReducer(algorithm={algorithm!r}) (besides its own keywords)"
            refuse_unknown(what, options, takes, also=REDUCER_KEYWORDS)
        opts = cls.default_options(self.n, self.k)
        opts.update(options)
        # (through the registry: an unknown option is named with the ones it takes)
        self.algorithm: Algorithm = get_algorithm(algorithm, **opts)
        self._selector_args = selection_options or {}
        # what a checkpoint's options must be, defaults filled in (an option given at its
        # default is the same reducer)
        self._options = effective_options(cls, options, leave_out=REDUCER_SETS)
        self._selection_options = effective_options(
            SELECTIONS[selection], self._selector_args, leave_out=REDUCER_SETS
        )
        # agreed at every step with the algorithm: each changes what the ranks do together
        # (warmup: dense or sparse; average: the update's scale) or what a rank selects and
        # keeps. Not reuse_update (where the update lands), nor check (a rank without it
        # takes no part in the agreement); in a canonical form, plain values only (any rank
        # can pickle them); not a selection's seed: each rank may sample its own way
        agreed = {
            "algorithm": algorithm,
            # (which class the name stands for: each rank's registry may hold another)
            "algorithm class": class_name(cls),
            "warmup": self.warmup,
            "average": self.average,
            "density": density,
            "error_feedback": self.error_feedback,
            "momentum": self.momentum,
            "selection": selection,
        }
        agreed.update(
            (f"selection_options[{name!r}]", value)
            for name, value in self._selection_options.items()
            if name not in RANK_LOCAL_SELECTION_OPTIONS
        )
        self._agree_on(agreed)
        self._signature_names = AGREED
        self._is_dense = algorithm == "dense"
        self.reset()

    def _agree_on(self, agreed: dict[str, Any]) -> None:
        """Agree at every step on ``agreed`` (by name)."""
        self._agreed_options = canonical(agreed)
        self._crc = zlib.crc32(repr(self._agreed_options).encode())
        # (named in a mismatch's message: the CRC's, then the algorithm's options, which its
        # signature holds with its state, after the step)
        where = tuple(range(4, 4 + ALGORITHM_SIGNATURE_LEN))
        self._detail = (((2,), self._agreed_options), (where, canonical(self._options)))

    def reset(self) -> None:
        """Drop the residual, the velocity, the algorithm's and the selection's state and the
        statistics: the reducer is as newly built (warm-up steps included). Collective in
        effect: call it on every rank, between the same steps (it waits for pending
        :meth:`step_async` calls first)."""
        self._wait_pending()
        self.steps = 0
        self._residual: Any = None
        self._pending_residual: np.ndarray | None = None  # restored, not yet on its module
        self._velocity: Any = None  # momentum correction's u (None when momentum is 0)
        self._spare: Any = None  # where the next step writes its accumulated vector
        self._spare_velocity: Any = None
        self._update: Any = None  # the reused update buffer (reuse_update)
        self._update_nnz: Any = None  # its nonzero positions; None: unknown, zero it all
        # the step_async request whose update is that buffer (a weak reference), until a
        # wait() hands it over: steps submitted before then must not overwrite it
        self._update_lent: weakref.ref[Any] | None = None
        # where the pass leaves its hits (select.accumulate's workspace), reused every step
        self._workspace: dict[str, Any] = {}
        if hasattr(self.algorithm, "reset"):
            self.algorithm.reset()
        est = SELECTIONS[self.selection]
        self._selector = None if est is None else est(k=self.k, **self._selector_args)
        self._prediction = Prediction()  # the exact local top-k's candidate cut
        args = (self.algorithm, self.comm, self.n, self.k)
        self._warmup_step = DenseStep(*args)
        self._strategy: StepStrategy = strategy_for(
            *args, dense=self._is_dense, selector=self._selector, prediction=self._prediction
        )
        self._last = StepInfo()
        self._totals = CommStats()
        self._sparse_steps = 0
        self._density_sum = 0.0
        self._can_take_back = False  # the spare buffers hold the residual before the last step

    # -- public ---------------------------------------------------------------------------
    @property
    def density(self) -> float:
        """The requested density, fixed at construction (k, the algorithm's and the
        selection's state follow from it): a new density takes a new reducer, e.g. one
        that loads this one's state_dict() with the new density and the fresh reducer's
        algorithm and selection state."""
        return self._density

    # what the reducer's buffers, its algorithm instance and its estimator were built for
    n = read_only("_n", "n", "The length.")
    comm = read_only("_comm", "comm", "The communicator (a sparsecoll Communicator).")
    k = read_only(
        "_k", "k", "Entries sent: round(density·n) per rank (exdyna: in all), at least 1."
    )
    algorithm_name = read_only(
        "_algorithm_name", "algorithm_name", "The algorithm's registered name."
    )
    selection = read_only("_selection", "selection", "The local selection policy's name.")

    def _refuse(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"a GradientReducer's {name} is fixed at construction (its algorithm, estimator "
            f"and buffers are built for it), got {value!r}: build a new GradientReducer on "
            f"every rank (warmup, average, error_feedback, momentum, reuse_update and check "
            f"may be set between steps)"
        )

    def _set_agreed(self, name: str, value: Any) -> None:
        """Set an argument the ranks agree on at every step (after the pending step_async
        calls, which read it), and agree on the new value from the next step on: set on
        some ranks only, that step raises CollectiveInputError on every rank naming it."""
        self._wait_pending()
        setattr(self, f"_{name}", value)
        self._agree_on({**self._agreed_options, name: canonical(value)})

    @property
    def warmup(self) -> int:
        """Steps reduced densely first (the step counter decides: a warmup above it makes
        the next steps dense again). Settable between steps, alike on every rank."""
        return self._warmup

    @warmup.setter
    def warmup(self, value: int) -> None:
        self._set_agreed("warmup", integer("warmup", value, 0))

    @property
    def average(self) -> bool:
        """Whether the update is the mean over the ranks (else their sum). Settable
        between steps, alike on every rank."""
        return self._average

    @average.setter
    def average(self, value: bool) -> None:
        self._set_agreed("average", flag("average", value))

    @property
    def error_feedback(self) -> bool:
        """Whether the residual is added to the next step's gradient. Settable between
        steps, alike on every rank."""
        return self._error_feedback

    @error_feedback.setter
    def error_feedback(self, value: bool) -> None:
        self._set_agreed("error_feedback", flag("error_feedback", value))

    @property
    def momentum(self) -> float:
        """The momentum correction's factor (0: none). Settable between steps, alike on
        every rank: set to 0, the velocity is dropped (no reducer without momentum loads a
        state holding one); from 0, it starts at zero."""
        return self._momentum

    @momentum.setter
    def momentum(self, value: float) -> None:
        value = check_momentum("momentum", value)
        self._set_agreed("momentum", value)
        if not value:
            self._velocity = self._spare_velocity = None

    @property
    def reuse_update(self) -> bool:
        """Whether step() returns the reducer's own update buffer (this rank's own choice:
        not agreed)."""
        return self._reuse_update

    @reuse_update.setter
    def reuse_update(self, value: bool) -> None:
        value = flag("reuse_update", value)
        self._wait_pending()
        self._reuse_update = value

    @property
    def check(self) -> bool:
        """Whether each step's input is agreed on collectively. Not agreed itself (a rank
        without it takes no part in the agreement): set it alike on every rank."""
        return self._check_input

    @check.setter
    def check(self, value: bool) -> None:
        value = flag("check", value)
        self._wait_pending()
        self._check_input = value

    @property
    def residual(self) -> Any:
        """This rank's error-feedback memory (dense and flat, the array module and dtype of the
        gradients: numpy for numpy and torch CPU tensors, CuPy for device arrays; None before
        the first step). The reducer's own buffer, reused two steps later:
        copy it to keep it. With ``error_feedback=False`` it holds what the last step
        dropped (not carried into the next step)."""
        if self._residual is None and self._pending_residual is not None:
            return self._pending_residual
        return self._residual

    @property
    def velocity(self) -> Any:
        """This rank's momentum-correction velocity after the last step (masked where sent;
        None without momentum or before the first step). The reducer's own buffer, reused
        two steps later: copy it to keep it."""
        return self._velocity

    @property
    def traffic(self) -> CommStats:
        """This reducer's traffic since it was built or reset (a copy of its counters:
        bytes sent and received, messages and metadata bytes sent)."""
        return self._totals.copy()

    def step(self, grad: Any, out: Any = None) -> Any:
        """Reduce this rank's gradient; return the dense update, the same on every rank.

        ``grad`` is a numpy/CuPy array (a torch tensor or JAX array: returned as one) of n
        elements and float16/32/64 dtype; it is only read. The update has its shape and dtype; with
        ``out`` (an array or tensor of the same size, dtype and device; it may be ``grad``
        itself) it is written there and ``out`` is returned, saving an allocation of n.

        Raises:
            CollectiveInputError / CollectiveTypeError on every rank when any rank's input
            is bad: wrong size, dtype or ``out``, or NaN/Inf in ``grad + residual`` (the
            message names the rank). The residual and the velocity are then unchanged on
            every rank; ``out`` may have been zeroed.

        With the watchdog on (:func:`sparsecoll.set_timeout`), the communicator's progress
        engine watches the step, so that a rank left waiting for another ends in the
        watchdog's diagnostic instead of a hang.
        """
        reuse = out is None and self._update_free()
        if reuse:
            self._update_lent = None  # (this step returns the buffer itself)
        return self._run_step(grad, out, reuse=reuse)

    def step_async(self, grad: Any, out: Any = None) -> Any:
        """Start :meth:`step` on the communicator's progress thread; ``wait()`` on the
        returned :class:`sparsecoll.SparseRequest` gives the update (or the step's error).

        Steps run in submission order. ``grad`` (and ``out``) are borrowed, and the
        reducer's state is in use, until the request completes: wait for it before reading
        the reducer's state (a blocking :meth:`step`, :meth:`state_dict`,
        :meth:`load_state_dict` and :meth:`reset` wait for pending ones themselves).

        With ``reuse_update``, the update is the reducer's own buffer only if every earlier
        step's update in it has been handed over by ``wait()`` when this step is submitted
        (else this step's is a new array): so it stays valid until a step submitted after
        its own ``wait()``, as a blocking step's until the next step.
        """
        reuse = out is None and self._update_free()
        label = f"step_async({self.algorithm_name!r})"
        req = self.comm.engine(label).submit(
            lambda: self._run_step(grad, out, reuse=reuse), label, self.comm
        )
        if reuse:
            self._update_lent = weakref.ref(req)
        return req

    def fail_step(self, error: BaseException) -> None:
        """Take part in a step that failed on this rank before it could start (e.g. a
        framework's conversion of its gradient ran out of memory): the step's agreement
        raises ``error`` on every rank, naming this rank, as for a bad gradient. Always
        raises; the reducer is left as it was."""
        self._run_step(None, None, error)

    def take_back(self) -> None:
        """Undo the last step's effect on this reducer's memory, when its update was not
        applied (the training loop skipped the batch, e.g. because another reducer's step
        failed): the residual and the velocity go back to what they were before that step,
        so nothing the step sent is lost and its gradient counts as never fed. The step
        counter, the algorithm's and the selection's state and the statistics stay
        advanced (the step happened, alike on every rank). Only right after a step that
        succeeded; call it on every rank alike. Do not apply the taken-back update: its
        entries are in the residual again.

        Raises:
            RuntimeError: no step to take back (none since the last reset, restore or
            take-back).
        """
        self._wait_pending()
        if not self._can_take_back:
            raise RuntimeError(
                "no step to take back (none since the last reset, restore or take-back)"
            )
        self._can_take_back = False
        self._residual, self._spare = self._spare, self._residual
        if self._velocity is not None:
            self._velocity, self._spare_velocity = self._spare_velocity, self._velocity

    def agree_on(self, name: str, value: Any) -> None:
        """Agree on ``name`` = ``value`` at every later step too, beside the constructor's
        arguments: a rank whose value differs makes that step raise CollectiveInputError on
        every rank, naming ``name``. For a framework adapter's own options that change what
        the ranks do with the reducer (the DDP hook's ``nonfinite``); call it between
        steps, alike on every rank."""
        self._agree_on({**self._agreed_options, name: canonical(value)})

    @property
    def signature_names(self) -> tuple[str, str, str, str]:
        """How a mismatch's message names the four values every step agrees on first: the
        gradient's length, its dtype (an index into :data:`sparsecoll.sparse.VALUE_DTYPES`),
        a CRC (>= 0) of the agreed options, the step count. A framework adapter that agrees
        on its own calls with the same layout (e.g. a dense warm-up holding -1 third) sets
        its own names, so that a rank in one while another steps is named alike."""
        return self._signature_names

    @signature_names.setter
    def signature_names(self, names: tuple[str, str, str, str]) -> None:
        names = tuple(names)
        if len(names) != 4 or not all(isinstance(s, str) for s in names):
            raise TypeError(f"signature_names must be 4 strings, got {names!r}")
        self._signature_names = names  # type: ignore[assignment]

    def stats(self) -> dict[str, Any]:
        """Requested and achieved density, and bytes per rank (last step and in total).

        ``achieved_density`` is the nonzero count of the last update over n (the union over
        ranks for exact algorithms: their build-up shows here); ``selected_density`` is this
        rank's own selection over n; ``mean_achieved_density`` averages the steps after the
        warm-up (1.0 for ``dense``; None before the first of them).
        ``dense_bytes`` is what one dense allreduce step moves per rank, for comparison.
        ``time_collective_s``: seconds the last step spent in collective calls (the input
        agreement and the algorithm's reduction, its own local merging included); the rest
        of the step is local work (the pass, selection, fix-ups). ``full_topk_steps``: how
        many steps (since this reducer was built) took the exact local top-k over the whole
        accumulated vector, one more read of it: the first sparse step, and any whose
        candidates, collected in the pass above a cut predicted from the last step, held
        fewer than k entries (or more than the pass had room for).
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
                self._density_sum / self._sparse_steps if self._sparse_steps else None
            ),
            "bytes_sent": st.bytes_sent,
            "bytes_recv": st.bytes_recv,
            "meta_bytes_sent": st.meta_bytes_sent,
            "bytes_sent_total": tot.bytes_sent,
            "bytes_recv_total": tot.bytes_recv,
            "meta_bytes_sent_total": tot.meta_bytes_sent,
            "dense_bytes": 2 * (p - 1) * self.n * itemsize // p,
            "time_collective_s": self._last.comm_s,
            "full_topk_steps": self._full_topk,
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's state as plain Python objects and numpy arrays (picklable).

        Everything but the communicator: the residual (copied to the host), the step
        counter, the algorithm instance's state and the statistics. Pending
        :meth:`step_async` calls are waited for first.
        """
        self._wait_pending()
        res = self.residual
        return {
            "version": STATE_VERSION,
            **self._identity(),
            "steps": self.steps,
            "residual": None if res is None else np.array(to_host(res), copy=True),
            "velocity": None if self._velocity is None else np.array(to_host(self._velocity)),
            "algorithm_state": host_copy(vars(self.algorithm)),
            "algorithm_version": type(self.algorithm).state_version,
            "selection_state": host_copy(slot_values(self._selector)),
            "selection_version": selection_version(self.selection),
            "topk_state": self._prediction.values(),
            "totals": self._totals.as_dict(),
            "density_sum": self._density_sum,
            "sparse_steps": self._sparse_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved by a reducer built with the same arguments, on
        as many ranks.

        A state from another n, algorithm, density, number of ranks, rank, selection,
        momentum, ``error_feedback``, ``average``, algorithm options (``**options``) or
        ``selection_options`` is refused (CollectiveInputError, a ValueError, naming the
        argument and both values). ``warmup``, ``reuse_update`` and ``check`` may differ:
        the saved step counter decides whether the warm-up is over. A state that is not a
        whole state_dict() (a key missing, an entry of the wrong kind, a residual or
        velocity that is not n finite float values, an algorithm's, selection's or format
        version this sparsecoll does not read) is refused too (CollectiveTypeError for the
        wrong kind); the residual and velocity may be numpy, torch or CuPy arrays. The
        state's dtype is its gradients': a step with gradients of another dtype raises,
        saying so (cast the residual and velocity before loading, or reset()).

        Collective: call it on every rank. A state one rank cannot take, or saved at another
        step than the others', raises the same error on every rank, naming the rank, and
        no reducer changes."""
        self._wait_pending()
        # (watched as a step is: a rank that skipped the call leaves the others waiting)
        label = f"load_state_dict({self.algorithm_name!r})"
        with (
            self.comm.serial(),
            watch(self.comm, label),
            agreement(self.comm, ("saved step",), call=label) as agree,
        ):
            new = self._read_state(state)  # (everything checked before anything changes)
            agree.signature = [new["steps"]]
        self._load(new)

    def load_state_local(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` on this rank alone: checked as
        :meth:`load_state_dict` checks it (ValueError, TypeError, nothing changed), but
        with no agreement between the ranks and no wait for pending :meth:`step_async`
        calls. For a caller that agrees on the state across the ranks itself (the DDP
        hook's load_state_dict) and loads it into a reducer with no step pending."""
        self._load(self._read_state(state))

    def __repr__(self) -> str:
        return (
            f"GradientReducer(n={self.n}, algorithm={self.algorithm_name!r}, "
            f"density={self.density}, steps={self.steps})"
        )

    # -- internals --------------------------------------------------------------------------
    @property
    def _full_topk(self) -> int:
        return self._prediction.full_topk

    def _identity(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be loaded (saved with it)."""
        return {
            "n": self.n,
            "algorithm": self.algorithm_name,
            "density": self.density,
            "ranks": self.comm.size,
            "rank": self.comm.rank,
            "selection": self.selection,
            "momentum": self.momentum,
            "error_feedback": self.error_feedback,
            "average": self.average,
            "options": dict(self._options),
            "selection_options": dict(self._selection_options),
        }

    def _read_state(self, state: Any) -> dict[str, Any]:
        return read_state(
            state,
            identity=self._identity(),
            algorithm=self.algorithm,
            selector=self._selector,
            prediction=self._prediction.values(),
            size=self.comm.size,
        )

    def _load(self, new: dict[str, Any]) -> None:
        """Take a state :meth:`_read_state` checked."""
        self.steps = new["steps"]
        self._can_take_back = False
        self._residual = None
        self._pending_residual = new["residual"]
        self._velocity = new["velocity"]
        vars(self.algorithm).update(new["algorithm_state"])
        for name, value in new["selection_state"].items():
            setattr(self._selector, name, value)
        self._prediction.load(new["topk_state"])
        self._totals = new["totals"]
        self._density_sum = new["density_sum"]
        self._sparse_steps = new["sparse_steps"]
