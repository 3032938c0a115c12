"""hangwatchd: notice hung GPU jobs, capture the evidence, explain it.

A workload needs only::

    import hangwatchd
    hangwatchd.beat()        # once per training step or served request
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .workload.client import beat, register

__all__ = ["beat", "register"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The client is imported on first use, not by every ``python -m hangwatchd``:
    # `hangwatchd symbolize` must start fast. Bound into the module after, so
    # ``hangwatchd.beat()`` costs no more than a plain attribute afterwards.
    if name in __all__:
        from .workload import client

        value = getattr(client, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hangwatchd' has no attribute {name!r}")
