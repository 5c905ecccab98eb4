"""Built-in algorithms: every module in this package registers its own on import."""

from __future__ import annotations

import importlib
import pkgutil

from .base import Algorithm

__all__ = ["Algorithm"]

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name != "base" and not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
