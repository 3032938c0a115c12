"""Wrap a module's code once the program imports it, never importing it ourselves.

``when_imported(name, wrap)`` calls ``wrap(module)`` now if the module is loaded,
else right after the program's own import of it has run: a finder first on
``sys.meta_path`` finds nothing itself, asks the path finder for the real spec,
and wraps that spec's loader so that ``wrap`` follows the module's execution.
The finder leaves ``sys.meta_path`` once it has done its one module.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec


def when_imported(name: str, wrap: Callable[[types.ModuleType], None]) -> None:
    if name in sys.modules:
        wrap(sys.modules[name])
    elif not any(isinstance(f, _Finder) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(name, wrap))


class _Finder:
    def __init__(self, name: str, wrap: Callable[[types.ModuleType], None]) -> None:
        self.name = name
        self.wrap = wrap

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None) -> ModuleSpec | None:
        if name != self.name:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real = spec.loader.exec_module
        wrap = self.wrap

        def exec_module(module: types.ModuleType) -> None:
            real(module)
            try:
                wrap(module)
            except Exception:  # noqa: BLE001 - what we wrap is only less explained; the program's import goes on
                pass

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # wrapped on purpose, on this loader only
        return spec
