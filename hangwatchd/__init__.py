"""hangwatchd: notice hung GPU jobs, capture the evidence, explain it.

A workload needs only::

    import hangwatchd
    hangwatchd.beat()        # once per training step or served request
"""

from .client import beat, register

__all__ = ["beat", "register"]
__version__ = "0.1.0"
