"""Installs hangwatchd's in-process reporter in every Python process of a job, then hands on.

``hangwatchd run`` puts this file's directory first on the job's PYTHONPATH, so
Python's ``site`` imports it at start-up (as ``ddtrace-run`` does). It loads the
reporter package from beside itself (a directory, or a path inside
hangwatchd-job.pyz), by its location, not through ``import hangwatchd``: the
job's environment may have another hangwatchd or none. Then it takes itself off
``sys.path`` and imports the ``sitecustomize`` that would have run without it
(the user's, the distribution's), so that one still runs, and its errors are
reported as Python would report them. Nothing here may stop the program from
starting: a reporter that cannot install is left out.
"""

import os
import sys

_NAME = "hangwatchd.workload.introspect"


def _load(package_dir):
    """The reporter package, loaded from ``package_dir`` under its own name, without its parents."""
    module = sys.modules.get(_NAME)
    if module is not None:
        return module
    from importlib.machinery import ModuleSpec, PathFinder

    found = PathFinder.find_spec("introspect", [os.path.dirname(package_dir)])
    if found is None or found.loader is None or not hasattr(found.loader, "get_code"):
        return None  # a loader with no get_code (neither a SourceFileLoader nor a zipimporter) loads nothing here
    code = found.loader.get_code("introspect")
    spec = ModuleSpec(_NAME, None, origin=found.origin, is_package=True)
    spec.submodule_search_locations = list(found.submodule_search_locations or [package_dir])
    module = type(sys)(_NAME)
    module.__spec__ = spec
    module.__file__ = found.origin
    module.__path__ = spec.submodule_search_locations
    module.__package__ = _NAME
    # ``from . import x`` returns the top-level package: a stand-in for it while the reporter's
    # modules load, never left behind (the program's own ``import hangwatchd`` finds its own).
    top = _NAME.partition(".")[0]
    stand_in = None if top in sys.modules else type(sys)(top)
    if stand_in is not None:
        sys.modules[top] = stand_in
    sys.modules[_NAME] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(_NAME, None)
        raise
    finally:
        if stand_in is not None and sys.modules.get(top) is stand_in:
            del sys.modules[top]
    return module


def _install(here):
    if os.environ.get("HANGWATCHD_INTROSPECT", "1").strip() in ("0", "no", "false", "off"):
        return
    try:
        module = _load(os.path.dirname(here))
        if module is not None:
            module.install()
    except Exception:  # noqa: BLE001 - a reporter that cannot be installed must never stop the program from starting
        pass


def _chain(here):
    """Import the next sitecustomize on the path, the one Python would have imported without us."""
    mine = [i for i, p in enumerate(sys.path) if os.path.abspath(p or ".") == here]
    if not mine:
        return
    for i in reversed(mine):
        del sys.path[i]
    ours = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401 - the next one on the path, if any
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours


_here = os.path.dirname(os.path.abspath(__file__))
_install(_here)
_chain(_here)
