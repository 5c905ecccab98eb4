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

One pass over the gradient: :func:`sparsecoll.select.accumulate` reads the gradient and the
residual (and the velocity) once, writes the accumulated vector once and collects the
entries above a cut known before the pass: exdyna's window edge, the reuse estimator's
threshold, or, for an exact local top-k, a cut predicted from the last step's k-th largest
value, so the top-k runs over those candidates only (when the prediction misses, over the
accumulated vector: one more read). After the collective only O(k) work is left (the
contributed entries leave the residual) and the update is written: on the CPU in one
streaming pass, zeros and the result together, each line once; elsewhere the pass zeroes
the update's buffer and the result is scattered into it. The pass's candidates land in a
workspace the reducer keeps (fresh memory every step cost a page fault per 4 KiB).
The accumulated vector is written to a second buffer, not over the residual, so a step that
fails on any rank (NaN or Inf in ``grad + residual``, bad input) leaves every rank's residual
and velocity as they were.

``warmup`` steps of dense allreduce come first (all algorithms). The state (residual, step,
the algorithm's state, byte counters) can be saved with :meth:`state_dict` and restored with
:meth:`load_state_dict`; every rank saves and restores its own.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import time
import weakref
import zlib
from typing import Any

import numpy as np

from . import select
from ._agree import (
    ALGORITHM_SIGNATURE_LEN,
    algorithm_signature,
    class_name,
    collective_check,
    watch,
)
from ._array import (
    as_array,
    device_scope,
    get_array_module,
    identity,
    nonzero_mask,
    same_device,
    to_host,
    to_module,
    wait_for_foreign,
)
from ._options import (
    canonical,
    check_density,
    choice,
    effective_options,
    flag,
    integer,
    read_only,
    real,
)
from ._state import Kind, check_values, optional, positive, within
from .algorithms.base import Algorithm
from .api import reduce_checked
from .comm import CommStats, Communicator, widening_buffer
from .errors import NonFiniteError
from .registry import (
    _accepts_any,
    algorithm_class,
    algorithm_options,
    get_algorithm,
    refuse_unknown,
)
from .select._common import round_threshold, smallest_magnitude
from .sparse import VALUE_DTYPES, SparseVector

__all__ = ["GradientReducer"]

STATE_VERSION = 1
# what every state_dict() has held (the identity's other keys came later: see _identity)
STATE_KEYS = (
    "n", "algorithm", "steps", "residual", "algorithm_state", "selection_state", "totals",
    "density_sum", "sparse_steps",
)  # fmt: skip
CUT_TARGET = 1.6  # candidates the exact top-k's predicted cut aims at, in multiples of k
CAP_FACTOR = 4  # candidates kept at most, in multiples of k (more: the prediction missed)
# the cut after a step with fewer than k nonzeros (the smallest positive float64: rounded up
# to the data's dtype, |x| >= it holds exactly for the nonzeros), so that the pass collects
# every nonzero and the next step needs no exact top-k while that lasts (an embedding's
# gradient: a few rows per step)
EVERY_NONZERO = math.ulp(0.0)
# what each step's signature holds first, named in a mismatch's message (the third: a CRC of
# the algorithm's name and the options that change what the ranks do together; before the
# step count, so that the DDP hook's dense warm-up, which holds -1 there, differs from a
# step there first)
AGREED = ("n", "grad dtype", "algorithm, warmup or average", "step")
# the exact top-k's predicted cut (see _predict_cut), saved as "topk_state": each attribute's
# kind as a checkpoint must hold it (a restored run then predicts its first cut as the
# saved run would have, instead of one more full top-k read)
_PREDICTION: dict[str, Kind] = {
    "_cut": optional(positive),
    "_kth": within(0.0, math.inf),
    "_growth": within(-0.5, 0.5),
    "_slope": within(1.0, 30.0),
    "_zcut": within(0.0, math.inf),
}
# why a checkpoint saved with another value of these is refused (given the saved value)
_MISMATCH = {
    "error_feedback": lambda saved: (
        "its residual is the error-feedback memory, which this reducer would drop"
        if saved
        else "its residual is what its last step dropped, not a memory to add to the next"
    ),
    "average": lambda saved: "the updates would change scale by the number of ranks",
    "rank": lambda saved: (
        "each rank restores the state it saved: one rank's on every rank would count its "
        "residual on each and lose the others'"
    ),
}
# selection options each rank may set its own way (not agreed at each step)
RANK_LOCAL_SELECTION_OPTIONS = ("seed",)
# local selection policies for the algorithms that take a local top-k (not dense, not exdyna)
SELECTIONS = {
    "exact": None,  # select.topk every step
    "reuse": select.ReuseThreshold,  # Ok-Topk: exact every `interval` steps, nudged between
    "sampling": select.SamplingThreshold,  # DGC: threshold from a random sample
    "gaussian": select.GaussianThreshold,  # Gaussian-k: normal quantile, refined
}
# (the options the reducer's density sets: not compared as options, nor saved with them)
REDUCER_SETS = ("k", "density")
# (GradientReducer's own keywords after n and algorithm: named in a misspelled option's hint)
REDUCER_KEYWORDS = (
    "density",
    "warmup",
    "average",
    "error_feedback",
    "momentum",
    "selection",
    "selection_options",
    "reuse_update",
    "check",
)


def _selection_takes(selection: str) -> list[str]:
    """The options selection ``selection``'s estimator takes in selection_options (not k
    nor density: the reducer's density sets k)."""
    est = SELECTIONS[selection]
    if est is None:
        return []
    return [p for p in inspect.signature(est).parameters if p not in ("k", "density")]


def _check_selection_options(selection: str, given: dict[str, Any]) -> None:
    """Refuse ``given`` (selection_options) that ``selection`` does not take: a ValueError
    for options given to the exact selection (they went unused), naming the selections that
    take them; a TypeError for a name the estimator does not take, with a did-you-mean."""
    if given and SELECTIONS[selection] is None:
        fits = [s for s in SELECTIONS if given.keys() <= set(_selection_takes(s))]
        where = " or ".join(f"selection={s!r}" for s in fits) or "another selection"
        raise ValueError(
            f"selection_options={given!r} would go unused: selection={selection!r} takes no "
            f"options; they are for {where}"
        )
    refuse_unknown(
        f"selection {selection!r} (selection_options)", given, _selection_takes(selection)
    )


class GradientReducer:
    """Sparse allreduce of gradients with error feedback; one instance per gradient vector.

    Args:
        comm: an mpi4py Intracomm, a :class:`sparsecoll.Communicator`, or None (COMM_WORLD).
        n: the gradient length (every step's gradient must have n elements, any shape).
        algorithm: a registered algorithm name (``"dense"`` for the uncompressed baseline).
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
        algorithm: str = "allgather",
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
        self._momentum = _check_momentum("momentum", momentum)
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
        _check_selection_options(selection, selection_options or {})
        if SELECTIONS[selection] is not None:  # bad estimator options fail here, early
            SELECTIONS[selection](k=self.k, **(selection_options or {}))
        cls = algorithm_class(algorithm)
        if selection != "exact" and (algorithm == "dense" or hasattr(cls, "reduce_dense")):
            # (built, checkpointed and agreed on, but never consulted: the step took no
            # local top-k)
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
        self._options = effective_options(cls, options, leave_out=REDUCER_SETS)
        self._selection_options = effective_options(
            SELECTIONS[selection], self._selector_args, leave_out=REDUCER_SETS
        )
        # agreed at every step with the algorithm: a rank whose warm-up lasted longer made
        # a dense allreduce while the others ran the sparse algorithm (the job hung), and
        # average on some ranks only made their updates differ; the others change what a
        # rank selects and keeps (a rank with another density, error feedback, momentum or
        # selection went on without an error). Not reuse_update (where the update lands),
        # nor check (a rank without it takes no part in the agreement)
        # (in a canonical form: np.float64(0.1) and 0.1 are one density, and only plain
        # values, which any rank can pickle, go to the other ranks when a value differs;
        # not a selection's seed: each rank may sample its own way)
        agreed = {
            "algorithm": algorithm,
            # (which class the name stands for: each rank's registry, plugins included,
            # may hold another under it)
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
        self._agreed = AGREED  # (the DDP hook's reducers: its own names, as its warm-up's)
        self._is_dense = algorithm == "dense"
        self._has_dense_path = hasattr(self.algorithm, "reduce_dense")
        # (self._options, self._selection_options: what a checkpoint's options must be,
        # defaults filled in: an option given at its default is the same reducer; loading
        # writes the saved instance's attributes, options included, over this reducer's)
        self.reset()

    def _agree_on(self, agreed: dict[str, Any]) -> None:
        """Agree at every step on ``agreed`` (by name: the constructor's arguments, and the
        DDP hook's own options that its bucket reducers carry out, e.g. ``nonfinite``)."""
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
        self._cut: float | None = None  # predicted candidate cut of the exact local top-k
        self._kth = 0.0  # the last exact top-k's k-th largest |value|
        self._growth = 0.0  # its smoothed log growth per step
        self._slope = 5.0  # d log(count) / d log(1/cut) near it (a Gaussian tail at 1%: ~5)
        self._zcut = math.inf  # the next k-th largest |value|, predicted
        if hasattr(self.algorithm, "reset"):
            self.algorithm.reset()
        est = SELECTIONS[self.selection]
        self._selector = None if est is None else est(k=self.k, **self._selector_args)
        self._last = _StepInfo()
        self._totals = CommStats()
        self._sparse_steps = 0
        self._full_topk = 0  # exact top-k steps whose predicted cut missed (since built)
        self._density_sum = 0.0
        self._can_take_back = False  # the spare buffers hold the residual before the last step

    # -- public ---------------------------------------------------------------------------
    @property
    def density(self) -> float:
        """The requested density, fixed at construction (k, the algorithm's and the
        selection's state follow from it): a new density takes a new reducer, e.g. one
        that loads this one's state_dict() with the new density and the fresh reducer's
        algorithm and selection state (what the DDP hook's state does when its density is
        set)."""
        return self._density

    # n, k, the communicator, the algorithm and the selection are what the reducer's
    # buffers, its algorithm instance and its estimator were built for: read-only (before,
    # red.k = 50 on one rank changed that rank's local top-k alone, without an error)
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
        some ranks only, that step raises CollectiveInputError on every rank naming it
        (before, a warmup set on one rank made it reduce densely while the others ran the
        algorithm: the job hung; average or error_feedback made the ranks differ silently)."""
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
        every rank: set to 0, the velocity is dropped (a velocity kept without momentum
        made the state_dict one that no reducer loads); from 0, it starts at zero."""
        return self._momentum

    @momentum.setter
    def momentum(self, value: float) -> None:
        value = _check_momentum("momentum", value)
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

    def step(self, grad: Any, out: Any = None) -> Any:
        """Reduce this rank's gradient; return the dense update, the same on every rank.

        ``grad`` is a numpy/CuPy array (or a torch tensor, returned as torch) of n elements
        and float16/32/64 dtype; it is only read. The update has its shape and dtype; with
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

    def _update_free(self) -> bool:
        """Whether a step made now may write the reused update buffer: reuse_update is on,
        and no step_async's update in it is still to be handed over (by wait(); a request
        dropped unwaited hands over nothing). Never waits: a step whose request has not
        completed yet still holds the buffer (exception() would wait for it, and
        step_async, which asks this, then waited for the earlier step's other ranks)."""
        if not self.reuse_update:
            return False
        req = None if self._update_lent is None else self._update_lent()
        return req is None or req._taken or (req.test() and req._error is not None)

    def _fail_step(self, error: BaseException) -> None:
        """Take part in a step that failed on this rank before it could start (the DDP
        hook's widening of a bfloat16 bucket): enter the step's agreement with ``error``, so
        that every rank raises the same error naming this rank, as for a bad gradient."""
        self._run_step(None, None, error)

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
            # the selection (a ReuseThreshold's schedule, a sampler's generator) and the cut
            # prediction move in _prepare: given back below if the step fails on any rank
            saved = self._selection_snapshot()
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
                collective_check(self.comm, error, sig, self._agreed, self._detail, call=label)
            elif error is not None:
                raise error
            self._last.comm_s = time.perf_counter() - t0
            # (apart: the algorithm's messages on a duplicate of the communicator, where the
            # caller's own, pending across the step, cannot match them)
            with self.comm.measure() as st, self.comm.apart():
                # (an error the algorithm agrees on, e.g. auto's dense buffer, is raised on
                # every rank: the step then changes nothing, as one failing above)
                update = self._reduce(prepared)
        except BaseException:
            if saved is not None:
                self._restore_selection(saved)
            raise
        self._last.stats = st
        _add_totals(self._totals, st)
        self.steps += 1
        if out is not None:
            wait_for_foreign(out, dest)
            return out
        return wrap(update.reshape(arr.shape))  # (DLPack orders the caller's stream)

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
            "algorithm_state": _host_copy(vars(self.algorithm)),
            "algorithm_version": type(self.algorithm).state_version,
            "selection_state": _host_copy(_slot_values(self._selector)),
            "selection_version": _selection_version(self.selection),
            "topk_state": {name: getattr(self, name) for name in _PREDICTION},
            "totals": self._totals.as_dict(),
            "density_sum": self._density_sum,
            "sparse_steps": self._sparse_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved by a reducer built with the same arguments, on
        as many ranks. A state from another n, algorithm, density, number of ranks,
        selection, momentum, ``error_feedback``, ``average``, algorithm options
        (``**options``) or ``selection_options`` is refused (CollectiveInputError, a
        ValueError, naming the argument and both values; every reducer is left as it was):
        the algorithm's state holds its k and partitions (and its options, which loading
        would write over this reducer's), each rank's residual belongs to its rank of that
        run (a state saved by another rank is refused too), and is an error-feedback memory
        only with ``error_feedback``.
        ``warmup``, ``reuse_update`` and ``check`` may differ: the saved step counter
        decides whether the warm-up is over. A state saved before an argument was recorded
        is taken as saved with this reducer's. A state that is not a whole state_dict() (a
        key missing, an entry of the wrong kind, a residual or velocity that is not n finite
        float values) is refused before anything changes (CollectiveTypeError, a TypeError,
        for the wrong kind); the residual and velocity may be numpy, torch or CuPy arrays.
        The algorithm's state is checked by the algorithm (:meth:`Algorithm.check_state`:
        the same attribute names and options, each value of its kind, bounds of this n and
        number of ranks) and its version (``algorithm_version``); the selection's state alike
        (the estimator's ``state_kinds``, its options, ``selection_version``), and the exact
        top-k's predicted cut (``topk_state``) by kind; a state of another format
        ``version`` is refused. The state's dtype is its gradients': a step with gradients
        of another dtype raises, saying so (cast the residual and velocity before loading,
        or reset()).

        Collective: call it on every rank. A state one rank cannot take, or saved at another
        step than the others', raises the same error on every rank, naming the rank, and
        no reducer changes (the ranks went on from different states: some loaded, some
        fresh, where a program caught the error)."""
        self._wait_pending()
        error, new = None, None
        try:
            new = self._read_state(state)  # (everything checked before anything changes)
        except Exception as exc:  # (shared with every rank: none loads alone)
            error = exc
        # (watched as a step is: a rank that skipped the call left the others in its
        # agreement for ever under SPARSECOLL_TIMEOUT)
        label = f"load_state_dict({self.algorithm_name!r})"
        with self.comm.serial(), watch(self.comm, label):
            sig = None if new is None else [new["steps"]]
            collective_check(self.comm, error, sig, ("saved step",), call=label)
        self._load(new)

    def _load(self, new: dict[str, Any]) -> None:
        """Take a state :meth:`_read_state` checked, on this rank alone (the DDP hook's
        reducers: its load_state_dict agrees on the whole state)."""
        self.steps = new["steps"]
        self._can_take_back = False
        self._residual = None
        self._pending_residual = new["residual"]
        self._velocity = new["velocity"]
        vars(self.algorithm).update(new["algorithm_state"])
        for name, value in new["selection_state"].items():
            setattr(self._selector, name, value)
        for name, value in new["topk_state"].items():
            setattr(self, name, value)
        self._totals = new["totals"]
        self._density_sum = new["density_sum"]
        self._sparse_steps = new["sparse_steps"]

    def __repr__(self) -> str:
        return (
            f"GradientReducer(n={self.n}, algorithm={self.algorithm_name!r}, "
            f"density={self.density}, steps={self.steps})"
        )

    # -- internals --------------------------------------------------------------------------
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
        """What loading ``state`` assigns: checked against this reducer and copied; raises
        (ValueError, TypeError) on a state this reducer cannot take, having changed nothing."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        version = state.get("version")
        if version is None:
            raise ValueError("state holds no format version: not a GradientReducer state_dict()")
        if version != STATE_VERSION:
            raise ValueError(
                f"state is of format version {version!r}, this sparsecoll reads version "
                f"{STATE_VERSION} (saved by another sparsecoll)"
            )
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise ValueError(
                f"state lacks {', '.join(missing)}: not a whole GradientReducer state_dict()"
            )
        for key, value in self._identity().items():
            # (all but n and algorithm are absent from states saved before they were recorded)
            if key in state and state[key] != value:
                saved = state[key]
                if isinstance(value, dict) and isinstance(saved, dict):  # (options: those
                    # that differ, by name)
                    names = sorted(o for o in {*saved, *value} if saved.get(o) != value.get(o))
                    saved = {o: saved.get(o) for o in names}
                    value = {o: value.get(o) for o in names}
                why = _MISMATCH.get(key)
                why = "" if why is None else f" ({why(saved)})"
                raise ValueError(f"state is for {key}={saved!r}, this reducer has {value!r}{why}")
        steps = integer("the state's steps", state["steps"], 0)
        residual = self._saved_vector(state, "residual")
        velocity = self._saved_vector(state, "velocity")
        if residual is not None and velocity is not None and residual.dtype != velocity.dtype:
            raise ValueError(
                f"the state's residual is {residual.dtype}, its velocity {velocity.dtype}: a "
                f"state_dict() holds both in its gradients' dtype"
            )
        if velocity is not None and not self.momentum:
            raise ValueError("state holds a momentum-correction velocity, this reducer has none")
        if velocity is None and self.momentum and steps and "momentum" not in state:
            # (a state saved before momentum was recorded: with it, every step left a velocity)
            raise ValueError(
                f"state holds no momentum-correction velocity after {steps} steps (saved "
                f"without momentum), this reducer has momentum={self.momentum}"
            )
        for key in ("algorithm_state", "selection_state", "totals"):
            if not isinstance(state[key], dict):
                raise TypeError(
                    f"the state's {key} must be a dict, got {type(state[key]).__name__}"
                )
        algorithm_state = self._saved_algorithm(state)
        selection_state = self._saved_selection(state)
        topk_state = self._saved_prediction(state)
        try:
            totals = CommStats(**state["totals"])
        except TypeError as exc:  # (a field this sparsecoll does not count)
            raise ValueError(f"the state's totals: {exc}") from None
        return {
            "steps": steps,
            "residual": residual,
            "velocity": velocity,
            "algorithm_state": algorithm_state,
            "selection_state": selection_state,
            "topk_state": topk_state,
            "totals": totals,
            "density_sum": real("the state's density_sum", state["density_sum"]),
            "sparse_steps": integer("the state's sparse_steps", state["sparse_steps"], 0),
        }

    def _saved_algorithm(self, state: dict[str, Any]) -> dict[str, Any]:
        """The state's algorithm_state, checked by the algorithm (its version, attribute
        names, options and the kinds of its state): the attributes loading writes."""
        algo = self.algorithm
        _check_version(state, "algorithm", algo.name, algo.state_version)
        return algo.check_state(state["algorithm_state"], self.n, self.comm.size)

    def _saved_selection(self, state: dict[str, Any]) -> dict[str, Any]:
        """The state's selection_state, checked as an algorithm's is (its version, slot
        names, options equal to this reducer's estimator's, each state slot of its kind):
        the slots loading writes (none for the exact selection, which keeps no state)."""
        _check_version(state, "selection", self.selection, _selection_version(self.selection))
        est = self._selector
        kinds = {} if est is None else est.state_kinds
        own = _slot_values(est)
        saved = state["selection_state"]
        return check_values("selection", self.selection, own, kinds, saved, self.n, self.comm.size)

    def _saved_prediction(self, state: dict[str, Any]) -> dict[str, Any]:
        """The state's topk_state (the exact top-k's predicted cut), checked by kind; this
        reducer's fresh prediction for a state saved before it was kept."""
        saved = state.get("topk_state")
        own = {name: getattr(self, name) for name in _PREDICTION}
        if saved is None:
            return own
        if not isinstance(saved, dict):
            raise TypeError(f"the state's topk_state must be a dict, got {type(saved).__name__}")
        return check_values("topk", "exact top-k", own, _PREDICTION, saved, self.n, self.comm.size)

    def _saved_vector(self, state: dict[str, Any], key: str) -> np.ndarray | None:
        """The state's ``key`` (its residual or velocity) as a new host array of n finite
        float16/32/64 values, from any array library and device; None if the state holds
        none."""
        value = state.get(key)
        if value is None:
            return None
        arr, _ = as_array(value, f"the state's {key}")
        arr = np.array(to_host(arr), copy=True).reshape(-1)
        if arr.dtype not in VALUE_DTYPES or arr.size != self.n:
            raise ValueError(
                f"the state's {key} must hold n={self.n} float16, float32 or float64 values, "
                f"got {arr.size} of {arr.dtype}"
            )
        if not np.isfinite(arr).all():  # (no step leaves one: every later step would fail)
            raise ValueError(f"the state's {key} holds NaN or Inf")
        return arr

    def _wait_pending(self) -> None:
        """Wait for the step_async calls submitted so far: they use (and change) the state."""
        engine = self.comm._attached_engine()
        if engine is not None and not engine.is_worker_thread():
            engine.drain()

    _CUT_STATE = (*_PREDICTION, "_full_topk")

    def _selection_snapshot(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """What a step's selection changes before the step is known to succeed on every rank:
        the cut prediction and the estimator's slots (a generator's state, not the object)."""
        sel = {}
        for name, value in _slot_values(self._selector).items():
            if isinstance(value, np.random.Generator):
                value = (value, value.bit_generator.state)
            sel[name] = value
        return tuple(getattr(self, a) for a in self._CUT_STATE), sel

    def _restore_selection(self, saved: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
        cut, sel = saved
        for name, value in zip(self._CUT_STATE, cut):
            setattr(self, name, value)
        for name, value in sel.items():
            if isinstance(value, tuple) and isinstance(value[0], np.random.Generator):
                value[0].bit_generator.state = value[1]
                value = value[0]
            setattr(self._selector, name, value)

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

    def _buffers(self, g: Any, prep: _Prepared) -> None:
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

    def _prepare(self, g: Any, dest: Any, reuse: bool) -> _Prepared:
        """One pass over ``g``: the accumulated vector (in the spare buffer), the new
        velocity, the update buffer zeroed (or marked to be written whole after the
        collective), and this step's selection or its candidates.
        Nothing the reducer keeps is changed (the step may still fail on some rank)."""
        xp = get_array_module(g)
        prep = _Prepared()
        self._buffers(g, prep)
        acc = prep.acc
        dense = self._is_dense or self.steps < self.warmup
        numba = _numba_host(g)
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
            prep.late_zero = numba and not dense
        # the pass's cut, the range it selects from, and (Numba) the cut from which its
        # candidates leave acc (from the predicted k-th value up, for an exact top-k):
        # _finish gives back those not sent
        cut, lo, hi, zero_cut = math.inf, 0, self.n, math.inf
        nonzeros = False  # (exdyna, when its call needs them) count its range's nonzeros
        if dense:
            prep.mode = "dense"
            prep.work = widening_buffer(acc)  # (float16: made before the ranks agree too)
        elif self._has_dense_path:  # exdyna selects in its own partition
            prep.mode = "exdyna"
            self.algorithm.prepare(self.comm, self.n)
            lo, hi = self.algorithm.owned_range(self.comm.rank)
            cut = self.algorithm.candidate_cut(g.dtype)
            cut = math.inf if cut is None else cut
            nonzeros = self.algorithm.counts_nonzeros()
            if numba and cut < math.inf:
                zc = self.algorithm.zero_cut(g.dtype)  # it gives back what it does not take
                zero_cut = math.inf if zc is None else max(cut, zc)
        elif self._selector is None or (
            isinstance(self._selector, select.ReuseThreshold) and self._selector.due
        ):
            prep.mode = "topk"
            cut = math.inf if self._cut is None else self._cut
            zero_cut = max(cut, self._zcut) if numba else math.inf
        elif isinstance(self._selector, select.ReuseThreshold):
            prep.mode = "reuse"
            cut = self._selector.threshold
            zero_cut = cut if numba else math.inf
        else:
            prep.mode = "estimator"
        every_nonzero = prep.mode == "topk" and cut <= EVERY_NONZERO
        prep.found = select.accumulate(
            g,
            prep.res if self.error_feedback else None,
            out=acc,
            cut=cut if cut > 0 else math.inf,
            lo=lo,
            hi=hi,
            # exdyna reads every candidate anyway: room for all (only written pages are used)
            cap=None if prep.mode == "exdyna" else CAP_FACTOR * self.k + 1024,
            velocity=prep.old_velocity,
            velocity_out=prep.velocity,
            momentum=self.momentum,
            zero=None if dense or prep.reused or prep.late_zero else prep.update,
            zero_cut=zero_cut,
            buckets=prep.mode == "topk",
            workspace=self._workspace,
            nonzeros=nonzeros,
        )
        found = prep.found
        if found.nonfinite:
            raise NonFiniteError(
                f"grad holds NaN or Inf: {found.nonfinite} entries of grad + residual "
                f"are not finite (the step is skipped, the residual kept)"
            )
        if prep.mode == "reuse" and self._reuse_misses(found):
            prep.mode = "reuse-miss"  # below the reuse band: the exact top-k of acc instead
        if zero_cut < math.inf and found.complete:
            # the cut as the pass compared with it (rounded up to g's dtype): the fix-ups
            # compare in that dtype too, and a cut rounded to nearest there would take an
            # entry just below it, which the pass left in acc, for one it zeroed
            zc = round_threshold(zero_cut, g.dtype)
            prep.zeroed = (found.indices, found.values, zc)
            missed = prep.mode == "topk" and found.hits < self.k and not every_nonzero
            if missed or prep.mode == "reuse-miss":  # a top-k of all of acc: made whole again
                acc[found.indices] = found.values
                prep.zeroed = None
        if prep.mode in ("topk", "reuse", "reuse-miss", "estimator"):
            prep.selected = self._select(acc, found, prep.mode, every_nonzero)
            sel, sel_values, _ = prep.selected
            if prep.averaged:  # (float16: each value's share, so that the sum fits)
                sel_values = _shares(sel_values, self.comm.size)
            prep.x = SparseVector(sel, sel_values, self.n)
            # (its own O(n) buffers, before the ranks agree: running out of memory is then
            # an error on every rank, not this rank's alone)
            self.algorithm.preflight(prep.x)
        return prep

    def _reuse_misses(self, found: select.Accumulation) -> bool:
        """Whether a reuse step's pass (at the reused threshold) found too few entries, so
        that the selection holding its band takes the exact top-k instead."""
        est = self._selector
        return est.hold_band and found.complete and est.below(found.hits, self.k)

    def _select(
        self, acc: Any, found: select.Accumulation, mode: str, every_nonzero: bool = False
    ) -> tuple[Any, Any, Any]:
        """This rank's selected indices of ``acc``, their values (exact zeros dropped: they
        carry nothing), and which of the pass's hits they are (a mask; None: all of them,
        or the selection did not come from the hits). ``every_nonzero``: the pass's cut
        made every nonzero of ``acc`` a hit."""
        k = self.k
        taken = None  # which of the pass's hits were selected (None: all or none of them)
        if mode == "estimator":
            chosen = self._selector.select(acc)
            idx, vals = chosen.indices, chosen.values
        elif mode == "reuse":
            est = self._selector
            if found.complete:
                idx, vals = found.indices, found.values
            else:
                idx, vals = select.threshold(acc, est.threshold)
            count = int(idx.shape[0])
            est.observe(count, k)
            if est.hold_band and count > est.hi * k:  # above the band: the top k of them
                keep, vals = select.topk(vals, k)
                idx = idx[keep]
                if found.complete:
                    xp = get_array_module(vals)
                    taken = xp.zeros(count, dtype=bool)
                    taken[keep] = True
        elif mode == "reuse-miss":  # below the band: the exact top-k of acc, a recompute
            idx, vals = select.topk(acc, k)
            self._selector.observe(k, k, exact=_kth(vals, k))
        else:
            if found.complete and found.hits >= k:  # the top-k is among the candidates
                idx, vals, taken = select.topk_hits(found, k)
            elif found.complete and every_nonzero:  # fewer than k nonzeros: all of them
                idx, vals = found.indices, found.values
            else:  # the predicted cut missed: a top-k over all of acc (one more read)
                idx, vals = select.topk(acc, k)
                self._full_topk += 1
            kth = _kth(vals, k)
            self._predict_cut(found, kth)
            if self._selector is not None:  # a due ReuseThreshold: this was its exact step
                self._selector.observe(k, k, exact=kth)
        nonzero = nonzero_mask(vals)  # (on a GPU: float32 subnormals too)
        if bool(nonzero.all()):
            return idx, vals, taken
        if taken is not None:
            taken = taken.copy()
            taken[taken] = nonzero
        elif mode == "reuse" and found.complete:
            taken = nonzero
        return idx[nonzero], vals[nonzero], taken

    def _predict_cut(self, found: select.Accumulation, kth: float) -> None:
        """Next step's candidate cut, aiming at CUT_TARGET·k candidates: this step's k-th
        largest |value|, times its smoothed growth per step (accumulated gradients grow
        while the residual builds up, shrink as gradients decay), lowered by the tail's
        local slope (how fast the count rises below the k-th value, measured between this
        step's cut and its k-th value; a miss makes it more careful)."""
        k, cut = self.k, self._cut
        if cut is not None and 0 < cut < kth and found.hits > k:
            slope = math.log(found.hits / k) / math.log(kth / cut)
            self._slope = min(max(slope, 1.0), 30.0)
        elif cut is not None and found.hits < k:
            self._slope = max(1.0, self._slope / 2)
        if self._kth > 0 and kth > 0:
            step = min(max(math.log(kth / self._kth), -0.5), 0.5)
            self._growth = 0.5 * self._growth + 0.5 * step
        self._kth = kth
        self._zcut = kth * math.exp(self._growth)  # next step's k-th value, predicted
        pred = self._zcut * CUT_TARGET ** (-1.0 / self._slope)
        self._cut = pred if pred > 0 else EVERY_NONZERO if self.k else None

    def _reduce(self, prep: _Prepared) -> Any:
        update = self._reduce_dense(prep) if prep.mode == "dense" else self._reduce_sparse(prep)
        # the step succeeded on every rank: keep what it wrote, recycle what it read
        self._residual, self._spare, self._pending_residual = prep.acc, prep.res, None
        if prep.velocity is not None:
            self._velocity, self._spare_velocity = prep.velocity, prep.old_velocity
        self._can_take_back = True
        return update

    def _reduce_dense(self, prep: _Prepared) -> Any:
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

    def _reduce_sparse(self, prep: _Prepared) -> Any:
        """A sparse step: the collective on this rank's selection, then the O(k) end."""
        exdyna = prep.mode == "exdyna"
        if exdyna:
            result, sent, selected, zeroed = self._exchange_exdyna(prep)
        else:
            result, sent, selected, zeroed = self._exchange_selected(prep)
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
        # masking; exdyna dropped it from acc already); the update's old entries are
        # zeroed, the result scattered
        p = self.comm.size
        divisor = p if self.average and p > 1 and not prep.averaged else 1
        _finish(
            prep.acc, prep.velocity, sent, update, old, result.indices, result.values,
            divisor, zeroed, prep.late_zero, exdyna,
        )  # fmt: skip
        self._last.record(result.nnz, selected)
        self._sparse_steps += 1
        self._density_sum += result.nnz / self.n if self.n else 0.0
        return update

    def _exchange_exdyna(self, prep: _Prepared) -> tuple[Any, Any, int, None]:
        """exdyna's collective, selecting in this rank's partition of acc from the pass's
        candidates: (result, the indices sent, how many were selected, None)."""
        found = prep.found
        cand = (found.indices, found.values) if found.complete else None
        zc = None if prep.zeroed is None else prep.zeroed[2]
        t0 = time.perf_counter()
        # acc is the spare buffer: dropping the sent entries as they are read (or in the
        # pass: zc) is safe even if the call fails (the residual is untouched)
        result = self.algorithm.reduce_dense(
            self.comm,
            prep.acc,
            candidates=cand,
            drop=True,
            zeroed=zc,
            mean=prep.averaged,
            nonzeros=found.nonzeros,  # (counted in the pass when the call needs them)
        )
        self._last.comm_s += time.perf_counter() - t0
        return result, result.indices, int(result.info["selected"]), None

    def _exchange_selected(self, prep: _Prepared) -> tuple[Any, Any, int, Any]:
        """The algorithm's collective on this rank's selection: (result, the indices sent,
        how many were selected, the pass's zeroed candidates with a mask of those sent)."""
        sel, _, taken = prep.selected
        t0 = time.perf_counter()
        result = reduce_checked(self.algorithm, self.comm, prep.x)
        self._last.comm_s += time.perf_counter() - t0
        selected = int(sel.shape[0])
        sent = result.contributed  # a mask over sel, or None: all of it
        if sent is not None and bool(sent.all()):
            sent = None
        if sent is not None:
            sel = sel[sent]
        if prep.zeroed is None:
            return result, sel, selected, None
        cand = prep.zeroed[0]  # which of the pass's hits leave acc
        if taken is None:
            taken = get_array_module(cand).ones(cand.shape[0], dtype=bool)
        if sent is not None:
            taken = taken.copy()
            taken[taken] = sent
        return result, sel, selected, (*prep.zeroed, taken)

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


def _check_momentum(name: str, value: Any) -> float:
    """A momentum factor: a real number in [0, 1)."""
    value = real(name, value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return value


def _finish(
    acc: Any,
    velocity: Any,
    sent: Any,
    update: Any,
    old: Any,
    indices: Any,
    values: Any,
    divisor: int,
    zeroed: Any = None,
    late_zero: bool = False,
    dropped: bool = False,
) -> None:
    """The step's O(k) end: ``acc[sent] = 0`` (and ``velocity[sent]``), ``update[old] =
    0`` (old may be None), then ``update[indices] = values / divisor``. With ``zeroed``
    (the pass's candidates: indices, values, the cut ``zc`` from which it zeroed them in
    acc, and a mask of those sent, which ``sent`` lists) acc is fixed where that zeroing
    was wrong instead. ``late_zero``: the update was not zeroed; it is written whole.
    ``dropped``: ``acc[sent]`` is 0 already (exdyna zeroed it as it read the values).
    One Numba loop on the CPU (numpy's fancy indexing took several ms for k = 168K),
    numpy/CuPy otherwise."""
    if _numba_host(acc):
        from .select._numba_train import finish_step

        finish_step(
            acc, velocity, sent, update, old, indices, values, divisor, zeroed, late_zero,
            dropped,
        )  # fmt: skip
        return
    if zeroed is not None:
        xp = get_array_module(acc)
        cand, cval, zc, taken = zeroed
        back = ~taken & (xp.abs(cval) >= cval.dtype.type(zc))
        acc[cand[back]] = cval[back]
    if not dropped:
        acc[sent] = 0
    if velocity is not None:
        velocity[sent] = 0
    if old is not None:
        update[old] = 0
    if late_zero:
        update[...] = 0
    update[indices] = values / values.dtype.type(divisor) if divisor != 1 else values


def _shares(values: Any, p: int) -> Any:
    """float16 ``values / p``, each rounded once (divided in float32, exact for any p), so
    that the sum of P ranks' shares is their average: it fits in float16 where the average
    does, as DDP's own hook divides before it sums. No bytes more on the wire (widening the
    values to float32 instead costs a third more: docs/training.md); each share rounds
    where p is no power of two, and a share below float16's subnormals is 0."""
    xp = get_array_module(values)
    return (values.astype(xp.float32) / xp.float32(p)).astype(values.dtype)


def _kth(vals: Any, k: int) -> float:
    """The k-th largest |value| of a top-k selection's ``vals`` (0.0 when it holds fewer
    than k)."""
    return smallest_magnitude(vals) if k and vals.shape[0] == k else 0.0


def _add_totals(totals: CommStats, delta: CommStats) -> None:
    """Add a step's traffic to the running totals (the fields :meth:`GradientReducer.stats`
    and the DDP hook's warm-up count)."""
    for f in ("bytes_sent", "bytes_recv", "messages_sent", "meta_bytes_sent"):
        setattr(totals, f, getattr(totals, f) + getattr(delta, f))


def _numba_host(a: Any) -> bool:
    """Whether the Numba kernels serve this array (a host array they can do arithmetic on)."""
    return isinstance(a, np.ndarray) and a.dtype != np.float16 and select.backend() == "numba"


class _Prepared:
    """One step between its pass over the gradient and its collective."""

    __slots__ = (
        "acc", "averaged", "found", "late_zero", "mode", "old_velocity", "res", "reused",
        "selected", "update", "velocity", "work", "x", "zeroed",
    )  # fmt: skip

    def __init__(self) -> None:
        self.reused = False
        self.averaged = False  # (float16) the collective returns the average, not the sum
        self.late_zero = False
        self.acc: Any = None
        self.res: Any = None
        self.old_velocity: Any = None
        self.found: Any = None
        self.mode = ""
        self.selected: Any = None
        self.x: Any = None  # the selection as the algorithm's input
        self.update: Any = None
        self.work: Any = None  # (a dense float16 step) the float32 array it is summed in
        self.velocity: Any = None
        self.zeroed: Any = None


class _StepInfo:
    __slots__ = ("comm_s", "nnz", "selected", "stats")

    def __init__(self) -> None:
        self.nnz = 0
        self.selected = 0
        self.stats = CommStats()
        self.comm_s = 0.0

    def record(self, nnz: int, selected: int) -> None:
        self.nnz, self.selected = nnz, selected


def _selection_version(selection: str) -> int:
    """The version of the selection estimator's state (1 for the exact selection)."""
    cls = SELECTIONS[selection]
    return 1 if cls is None else cls.state_version


def _check_version(state: dict[str, Any], what: str, name: str, version: int) -> None:
    """Refuse a state whose ``{what}_state`` (``name``'s) is of another version than
    ``version`` (one saved before these states were versioned: the first)."""
    saved = state.get(f"{what}_version", 1)
    if saved != version:
        raise ValueError(
            f"the state's {what}_state is {name}'s state version {saved!r}, this sparsecoll's "
            f"{name} reads version {version} (saved by another sparsecoll: load it with a "
            f"fresh reducer's {what}_state and {what}_version to keep its residual)"
        )


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
