"""The algorithm registry: names to Algorithm classes, plus third-party entry points.

Third-party packages can register algorithms through the entry-point group
``sparsecoll.algorithms`` (``name = "package.module:AlgorithmClass"``).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from .errors import AlgorithmExistsError, UnknownAlgorithmError

if TYPE_CHECKING:
    from .algorithms.base import Algorithm

__all__ = ["available_algorithms", "get_algorithm", "register_algorithm"]

_REGISTRY: dict[str, type[Algorithm]] = {}
_loaded = False


def register_algorithm(cls: type[Algorithm], name: str | None = None) -> type[Algorithm]:
    """Register an Algorithm subclass under ``name`` (default ``cls.name``).

    Usable as a class decorator. Registering a name twice raises AlgorithmExistsError.
    """
    from .algorithms.base import Algorithm

    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise TypeError(f"expecting an Algorithm subclass, got {cls!r}")
    key = name or cls.name
    if not key or not isinstance(key, str):
        raise ValueError(f"algorithm {cls.__name__} has no name")
    if key in _REGISTRY:
        raise AlgorithmExistsError(
            f"algorithm {key!r} is already registered (by {_REGISTRY[key].__qualname__})"
        )
    _REGISTRY[key] = cls
    return cls


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from . import algorithms  # noqa: F401  (registers the built-in algorithms)

    for ep in entry_points(group="sparsecoll.algorithms"):
        if ep.name not in _REGISTRY:
            register_algorithm(ep.load(), ep.name)


def available_algorithms() -> list[str]:
    """Names of every registered algorithm, sorted."""
    _load()
    return sorted(_REGISTRY)


def algorithm_class(name: str) -> type[Algorithm]:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise UnknownAlgorithmError(f"unknown algorithm {name!r}; known: {known}") from None


def get_algorithm(name: str, **options: Any) -> Algorithm:
    """A new instance of the algorithm registered as ``name``, built with ``options``.

    Stateful algorithms (oktopk, exdyna) keep their state in the instance: pass the same
    instance to every call of :func:`sparsecoll.allreduce` to reuse it.
    """
    return algorithm_class(name)(**options)
