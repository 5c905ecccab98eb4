"""A GradientReducer's arguments: the local selection policies, and the checks of its options
that are not the algorithm's (the algorithm's own options are checked by the registry)."""

from __future__ import annotations

import inspect
from typing import Any

from .. import select
from .._options import real
from ..registry import refuse_unknown

__all__ = [
    "AGREED",
    "RANK_LOCAL_SELECTION_OPTIONS",
    "REDUCER_KEYWORDS",
    "REDUCER_SETS",
    "SELECTIONS",
    "check_momentum",
    "check_selection_options",
    "selection_version",
]

# what each step's signature holds first, named in a mismatch's message (the third: a CRC of
# the algorithm's name and the options that change what the ranks do together; it comes
# before the step count, so that a dense warm-up step holding -1 there differs from a
# reducer's step there first)
AGREED = ("n", "grad dtype", "algorithm, warmup or average", "step")
# selection options each rank may set its own way (not agreed at each step)
RANK_LOCAL_SELECTION_OPTIONS = ("seed",)
# local selection policies for the algorithms that take a local top-k (not dense, not exdyna)
SELECTIONS = {
    "exact": None,  # select.topk every step
    "reuse": select.ReuseThreshold,  # Ok-Topk: exact every `interval` steps, nudged between
    "sampling": select.SamplingThreshold,  # DGC: threshold from a random sample
    "gaussian": select.GaussianThreshold,  # Gaussian-k: normal quantile, refined
}
# the options the reducer's density sets: not compared as options, nor saved with them
REDUCER_SETS = ("k", "density")
# GradientReducer's own keywords after n and algorithm: named in a misspelled option's hint
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
    """The options ``selection``'s estimator takes in selection_options (not k nor density:
    the reducer's density sets k)."""
    est = SELECTIONS[selection]
    if est is None:
        return []
    return [p for p in inspect.signature(est).parameters if p not in ("k", "density")]


def check_selection_options(selection: str, given: dict[str, Any]) -> None:
    """Refuse ``given`` (selection_options) that ``selection`` does not take: a ValueError
    for options given to the exact selection (they would go unused), naming the selections
    that take them; a TypeError for a name the estimator does not take, with a did-you-mean."""
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


def check_momentum(name: str, value: Any) -> float:
    """A momentum factor: a real number in [0, 1)."""
    value = real(name, value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return value


def selection_version(selection: str) -> int:
    """The version of the selection estimator's state (1 for the exact selection)."""
    cls = SELECTIONS[selection]
    return 1 if cls is None else cls.state_version
