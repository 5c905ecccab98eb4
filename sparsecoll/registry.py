"""The algorithm registry: names to Algorithm classes, plus third-party entry points.

A leaf module: it never imports the algorithms. The built-ins are named in ``BUILTINS``
(``name: "module:Class"``) and imported on first lookup; each registers itself with
:func:`register_algorithm`. Third-party packages register algorithms through the
entry-point group ``sparsecoll.algorithms`` (``name = "package.module:AlgorithmClass"``).
One that fails to load (its module missing or raising on import, or no Algorithm subclass)
is not available: asking for its name raises ImportError with the cause; the others load as
usual. One named like an algorithm registered before it (a built-in, or an earlier plugin)
is not loaded: the name stays the first one's. :func:`describe_algorithms` (``python -m
sparsecoll algorithms``) lists both kinds, with why.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import re
import sys
import textwrap
from importlib.metadata import entry_points
from typing import Any

from .errors import AlgorithmExistsError, UnknownAlgorithmError

__all__ = [
    "BUILTINS",
    "algorithm_class",
    "algorithm_options",
    "available_algorithms",
    "describe_algorithms",
    "get_algorithm",
    "register_algorithm",
]

# The built-in algorithms: name -> "module:Class" (tests/test_registry.py checks it against
# every Algorithm subclass in sparsecoll.algorithms).
BUILTINS: dict[str, str] = {
    "allgather": "sparsecoll.algorithms.allgather:Allgather",
    "auto": "sparsecoll.algorithms.auto:Auto",
    "dense": "sparsecoll.algorithms.dense:Dense",
    "dsa": "sparsecoll.algorithms.dsa:DSA",
    "exdyna": "sparsecoll.algorithms.exdyna:ExDyna",
    "gtopk": "sparsecoll.algorithms.gtopk:GTopk",
    "hashed": "sparsecoll.algorithms.hashed:Hashed",
    "oktopk": "sparsecoll.algorithms.oktopk:OkTopk",
    "rabenseifner": "sparsecoll.algorithms.rabenseifner:Rabenseifner",
    "recursive_doubling": "sparsecoll.algorithms.recursive_doubling:RecursiveDoubling",
    "ring": "sparsecoll.algorithms.ring:Ring",
}
_BASE = "sparsecoll.algorithms.base"  # where the Algorithm class lives (never imported here)

# name -> an Algorithm subclass (``type``: the class is not imported here)
_REGISTRY: dict[str, type] = {}
# entry points that failed to load: name -> why (what asking for the name raises)
_BROKEN: dict[str, str] = {}
# entry points left out because their name was taken: why, for the listing
_SHADOWED: list[str] = []
_loaded = False


def _is_algorithm(cls: Any) -> bool:
    # an Algorithm subclass has imported its base module: no import needed to check
    base = sys.modules.get(_BASE)
    return base is not None and isinstance(cls, type) and issubclass(cls, base.Algorithm)


def _spelled(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def register_algorithm(cls: type, name: str | None = None) -> type:
    """Register an Algorithm subclass under ``name`` (default ``cls.name``).

    Usable as a class decorator. Registering a name twice (a built-in's included) raises
    AlgorithmExistsError.
    """
    if not _is_algorithm(cls):
        raise TypeError(f"expecting an Algorithm subclass, got {cls!r}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"algorithm name must be a str, got {type(name).__name__}")
    key = name or cls.name
    if not key or not isinstance(key, str):
        raise ValueError(f"algorithm {cls.__name__} has no name")
    owner = _REGISTRY[key].__qualname__ if key in _REGISTRY else None
    if owner is None and key in BUILTINS and BUILTINS[key] != _spelled(cls):
        owner = BUILTINS[key].rsplit(":", 1)[1]
    if owner is not None:
        raise AlgorithmExistsError(f"algorithm {key!r} is already registered (by {owner})")
    _REGISTRY[key] = cls
    return cls


def _builtin(name: str) -> type:
    """The built-in ``name``, its module imported (which registers it) when not yet."""
    cls = _REGISTRY.get(name)
    if cls is None:
        importlib.import_module(BUILTINS[name].split(":", 1)[0])
        cls = _REGISTRY[name]
    assert _spelled(cls) == BUILTINS[name], (name, cls)
    return cls


def _load(builtins: bool = False) -> None:
    """Load the entry points once (and, with ``builtins``, every built-in)."""
    global _loaded
    if builtins:
        for name in BUILTINS:
            _builtin(name)
    if _loaded:
        return
    _loaded = True
    seen: dict[str, str] = {}  # name -> the entry point tried for it first
    for ep in entry_points(group="sparsecoll.algorithms"):
        if seen.get(ep.name) == ep.value:
            continue  # (one plugin listed twice)
        taken = _taker(ep.name)
        if taken == f"{ep.module}:{ep.attr}":
            continue  # (the plugin's class itself, registered already, by its own module)
        if taken is not None or ep.name in _BROKEN:
            _SHADOWED.append(_taken(ep.name, ep.value, seen.get(ep.name)))
            continue
        seen[ep.name] = ep.value
        # one plugin failing leaves the others loading and its name an ImportError
        try:
            register_algorithm(ep.load(), ep.name)
        except Exception as exc:
            _BROKEN[ep.name] = (
                f"algorithm {ep.name!r} could not be loaded from its entry point "
                f"{ep.value!r} (group sparsecoll.algorithms): {type(exc).__name__}: {exc}"
            )


def _taker(name: str) -> str | None:
    """``"module:Class"`` of the algorithm holding ``name``, if any."""
    if name in BUILTINS:
        return BUILTINS[name]
    return _spelled(_REGISTRY[name]) if name in _REGISTRY else None


def _taken(name: str, value: str, first: str | None) -> str:
    """Why the entry point ``value`` was not loaded: ``name`` is taken (by a built-in or an
    algorithm registered before the plugins load; by the entry point ``first``)."""
    if first is None and _taker(name) is not None:
        kind = "built-in" if name in BUILTINS else "registered"
        owner = f"the {kind} algorithm {_taker(name).replace(':', '.')}"
    else:
        owner = f"the entry point {first!r}, listed before it"
    return (
        f"algorithm {name!r} was not loaded from its entry point {value!r} (group "
        f"sparsecoll.algorithms): the name is taken by {owner}; give the plugin another name"
    )


def available_algorithms() -> list[str]:
    """Names of every registered algorithm, sorted."""
    _load()
    return sorted(set(_REGISTRY) | set(BUILTINS))


def algorithm_class(name: str) -> type:
    """The class registered as ``name`` (a built-in's module is imported on first use)."""
    if not isinstance(name, str):
        raise TypeError(f"algorithm must be a name (str), got {type(name).__name__}")
    if name in BUILTINS:
        return _builtin(name)
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        if name in _BROKEN:
            raise ImportError(_BROKEN[name]) from None
        known = available_algorithms()
        raise UnknownAlgorithmError(unknown_name("algorithm", name, known)) from None


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
    _load(builtins=True)
    left_out = [why for _, why in sorted(_BROKEN.items())] + _SHADOWED
    return textwrap.dedent(_options_doc()) + "".join(f"\n    {why}\n" for why in left_out)


def _accepts_any(cls: type) -> bool:
    return _takes(cls)[0]


@functools.cache
def _takes(cls: type) -> tuple[bool, tuple[str, ...]]:
    """Whether ``cls``'s constructor takes any keyword (``**options``), and the options it
    names (read once per class: get_algorithm checks a named algorithm's options on every
    call)."""
    params = inspect.signature(cls).parameters.values()
    return (
        any(p.kind is p.VAR_KEYWORD for p in params),
        tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)),
    )


def _options(cls: type) -> dict[str, tuple[Any, str]]:
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


def get_algorithm(name: str, **options: Any) -> Any:
    """A new instance of the algorithm ``name``, built with ``options``.

    :func:`describe_algorithms` (``python -m sparsecoll algorithms``) lists every
    algorithm's options with their defaults. Stateful algorithms (oktopk, exdyna) keep their
    state in the instance: pass the same instance to every call of
    :func:`sparsecoll.allreduce` to reuse it.

    Raises:
        UnknownAlgorithmError: no algorithm is registered as ``name``.
        TypeError: an option the algorithm does not take.
    """
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
