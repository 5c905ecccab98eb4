"""The algorithm registry: names to Algorithm classes, plus third-party entry points.

Third-party packages can register algorithms through the entry-point group
``sparsecoll.algorithms`` (``name = "package.module:AlgorithmClass"``). One that fails to
load (its module missing or raising on import, or no Algorithm subclass) is not available:
asking for its name raises ImportError with the cause; the others load as usual. One named
like an algorithm registered before it (a built-in, or an earlier plugin) is not loaded: the
name stays the first one's. :func:`describe_algorithms` (``python -m sparsecoll algorithms``)
lists both kinds, with why.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
import textwrap
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from .errors import AlgorithmExistsError, UnknownAlgorithmError

if TYPE_CHECKING:
    from .algorithms.base import Algorithm

__all__ = [
    "algorithm_options",
    "available_algorithms",
    "describe_algorithms",
    "get_algorithm",
    "register_algorithm",
]

_REGISTRY: dict[str, type[Algorithm]] = {}
# entry points that failed to load: name -> why (what asking for the name raises)
_BROKEN: dict[str, str] = {}
# entry points left out because their name was taken: why, for the listing
_SHADOWED: list[str] = []
_loaded = False


def register_algorithm(cls: type[Algorithm], name: str | None = None) -> type[Algorithm]:
    """Register an Algorithm subclass under ``name`` (default ``cls.name``).

    Usable as a class decorator. Registering a name twice raises AlgorithmExistsError.
    """
    from .algorithms.base import Algorithm

    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise TypeError(f"expecting an Algorithm subclass, got {cls!r}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"algorithm name must be a str, got {type(name).__name__}")
    key = name or cls.name
    if not key or not isinstance(key, str):
        raise ValueError(f"algorithm {cls.__name__} has no name")
    if key in _REGISTRY:
        raise AlgorithmExistsError(
            f"algorithm {key!r} is already registered (by {_REGISTRY[key].__qualname__})"
        )
    _REGISTRY[key] = cls
    get_algorithm.__doc__ = _GET_ALGORITHM_DOC + _options_doc()  # help() lists every one
    return cls


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from . import algorithms  # noqa: F401  (registers the built-in algorithms)

    seen: dict[str, str] = {}  # name -> the entry point tried for it first
    for ep in entry_points(group="sparsecoll.algorithms"):
        if seen.get(ep.name) == ep.value:
            continue  # (one plugin listed twice)
        taken = _REGISTRY.get(ep.name)
        if taken is not None and (ep.module, ep.attr) == (taken.__module__, taken.__qualname__):
            continue  # (the plugin's class itself, registered already, by its own module)
        if taken is not None or ep.name in _BROKEN:
            # (it was skipped without a word: the name gave the other class, and nothing
            # said that the plugin was never loaded)
            _SHADOWED.append(_taken(ep.name, ep.value, seen.get(ep.name)))
            continue
        seen[ep.name] = ep.value
        # (one plugin failing must not stop the others loading, nor fail the first call for
        # every name and then leave its name unknown: the first lookup raised its error,
        # and the plugins after it were never loaded)
        try:
            register_algorithm(ep.load(), ep.name)
        except Exception as exc:
            _BROKEN[ep.name] = (
                f"algorithm {ep.name!r} could not be loaded from its entry point "
                f"{ep.value!r} (group sparsecoll.algorithms): {type(exc).__name__}: {exc}"
            )


def _taken(name: str, value: str, first: str | None) -> str:
    """Why the entry point ``value`` was not loaded: ``name`` is taken (by a built-in or an
    algorithm registered before the plugins load; by the entry point ``first``)."""
    if first is None and name in _REGISTRY:
        cls = _REGISTRY[name]
        kind = "built-in" if cls.__module__.startswith("sparsecoll.") else "registered"
        owner = f"the {kind} algorithm {cls.__module__}.{cls.__qualname__}"
    else:
        owner = f"the entry point {first!r}, listed before it"
    return (
        f"algorithm {name!r} was not loaded from its entry point {value!r} (group "
        f"sparsecoll.algorithms): the name is taken by {owner}; give the plugin another name"
    )


def available_algorithms() -> list[str]:
    """Names of every registered algorithm, sorted."""
    _load()
    return sorted(_REGISTRY)


def algorithm_class(name: str) -> type[Algorithm]:
    _load()
    if not isinstance(name, str):
        raise TypeError(f"algorithm must be a name (str), got {type(name).__name__}")
    try:
        return _REGISTRY[name]
    except KeyError:
        if name in _BROKEN:
            raise ImportError(_BROKEN[name]) from None
        raise UnknownAlgorithmError(unknown_name("algorithm", name, sorted(_REGISTRY))) from None


def unknown_name(what: str, name: str, known: list[str]) -> str:
    """The message for an unknown ``name`` of a ``what`` (an algorithm, a bench method): a
    did-you-mean and the ``known`` ones."""
    return f"unknown {what} {name!r}{did_you_mean(name, known)}; known: {', '.join(known)}"


def did_you_mean(word: object, choices: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to a misspelled ``word`` (case,
    ``-`` for ``_`` and small typos forgiven), or ``""`` when none is close."""
    if not isinstance(word, str):
        return ""
    plain = word.strip().lower().replace("-", "_").replace(" ", "_")
    by_plain = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(plain, list(by_plain), n=1, cutoff=0.6)
    return f" (did you mean {by_plain[close[0]]!r}?)" if close else ""


def algorithm_options(name: str) -> dict[str, tuple[Any, str]]:
    """The options the algorithm registered as ``name`` takes: ``{option: (default, help)}``.

    Read from its constructor's signature (``inspect.Parameter.empty`` for an option with
    no default) and the ``Args:`` section of its class docstring, so it cannot go stale.
    """
    return _options(algorithm_class(name))


def describe_algorithms() -> str:
    """Every registered algorithm, exact or selecting, with its options and their defaults."""
    _load()
    left_out = [why for _, why in sorted(_BROKEN.items())] + _SHADOWED
    return textwrap.dedent(_options_doc()) + "".join(f"\n    {why}\n" for why in left_out)


def _accepts_any(cls: type[Algorithm]) -> bool:
    return _takes(cls)[0]


@functools.cache
def _takes(cls: type[Algorithm]) -> tuple[bool, tuple[str, ...]]:
    """Whether ``cls``'s constructor takes any keyword (``**options``), and the options it
    names. Read once per class: get_algorithm checks a named algorithm's options at every
    call, and inspect.signature cost up to ~1 ms there (oktopk's, with _options' docstring
    parse)."""
    params = inspect.signature(cls).parameters.values()
    return (
        any(p.kind is p.VAR_KEYWORD for p in params),
        tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)),
    )


def _options(cls: type[Algorithm]) -> dict[str, tuple[Any, str]]:
    helps = _args_section(inspect.getdoc(cls) or "")
    need = getattr(cls, "required", ())
    return {
        p.name: (p.empty if p.name in need else p.default, helps.get(p.name, ""))
        for p in inspect.signature(cls).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def _args_section(doc: str) -> dict[str, str]:
    """``{name: text}`` from a Google-style ``Args:`` section (continuation lines joined)."""
    out: dict[str, str] = {}
    lines = doc.split("Args:", 1)[1].splitlines()[1:] if "Args:" in doc else []
    name = None
    for line in lines:
        m = re.match(r"    (\w+)(?: \([^)]*\))?: (.*)", line)
        if m:
            name = m.group(1)
            out[name] = m.group(2).strip()
        elif name and line.startswith("     "):
            out[name] += " " + line.strip()
        else:
            break
    return out


def _options_doc() -> str:
    """The listing, indented as the body of a docstring (4 spaces)."""
    lines = ["    Algorithms and their options (option=default):", ""]
    for key in sorted(_REGISTRY):
        cls = _REGISTRY[key]
        kind = "exact" if cls.exact else "selecting"
        opts = _options(cls)
        if not opts and not _accepts_any(cls):
            lines.append(f"        {key} ({kind}): no options")
            continue
        lines.append(f"        {key} ({kind}):")
        for opt, (default, text) in opts.items():
            shown = "required" if default is inspect.Parameter.empty else repr(default)
            entry = f"{opt}={shown}" + (f": {text}" if text else "")
            lines.append(textwrap.fill(entry, 96, initial_indent=_IND3, subsequent_indent=_IND4))
        if _accepts_any(cls):
            lines.append(f"{_IND3}**options: passed to the class as they are")
    return "\n".join(lines) + "\n"


_IND3, _IND4 = " " * 12, " " * 16
_GET_ALGORITHM_DOC = """A new instance of the algorithm ``name``, built with ``options``.

    Every registered algorithm's options, with their defaults, are listed below.
    Stateful algorithms (oktopk, exdyna) keep their state in the instance: pass the same
    instance to every call of :func:`sparsecoll.allreduce` to reuse it.

    Raises:
        UnknownAlgorithmError: no algorithm is registered as ``name``.
        TypeError: an option the algorithm does not take.

"""


def get_algorithm(name: str, **options: Any) -> Algorithm:
    cls = algorithm_class(name)
    if options and not _accepts_any(cls):
        takes = list(_takes(cls)[1])
        hint = ""
        if "density" in options and "density" not in takes and "k" in takes:
            hint = " (k is a count of entries: k = round(density·n))"
        refuse_unknown(f"algorithm {name!r}", options, takes, hint=hint)
    return cls(**options)


def refuse_unknown(
    what: str, given: Any, takes: list[str], also: tuple[str, ...] = (), hint: str = ""
) -> None:
    """Raise TypeError (as Python does for an unexpected keyword) when ``given`` (names) holds
    one that ``what`` does not take: the message lists ``takes`` and the closest of
    ``takes`` and ``also`` (other keywords of the caller) to the first unknown name, else
    ``hint``."""
    unknown = sorted(set(given) - set(takes))
    if unknown:
        hint = did_you_mean(unknown[0], [*takes, *also]) or hint
        listed = ", ".join(takes) or "no options"
        raise TypeError(f"{what} takes {listed}, got {', '.join(unknown)}{hint}")


get_algorithm.__doc__ = _GET_ALGORITHM_DOC
