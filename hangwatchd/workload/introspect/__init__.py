"""The in-process reporter: what a hung Python process's threads and tasks wait for and hold, asked for by the daemon.

From outside (py-spy), a stuck thread is a line number. What it waits for (which
lock, who holds it, which thread it joins, whether that thread is still alive,
what an asyncio task awaits) can only be read from inside. ``hangwatchd run``
installs this reporter in every Python process of the job (a ``sitecustomize``
first on the job's ``PYTHONPATH``: ``bootstrap/``), and ``hangwatchd.register()``
and the first ``beat()`` install it too. It holds a FIFO, ``introspect-PID.pipe``,
and one thread blocked reading it; the daemon's ``introspect`` capture step
writes a byte into it and reads ``introspect-PID.json`` back (``report.py`` says
what is in it).

Standard library only, Python 3.9+, and no import of the rest of hangwatchd:
``bootstrap/sitecustomize.py`` loads this package by its directory, whatever
the job's environment has installed. Switched off by ``HANGWATCHD_INTROSPECT=0``
(``hangwatchd run --no-introspect``).
"""

from .reporter import DIR_ENV, ENABLE_ENV, install, installed

__all__ = ["DIR_ENV", "ENABLE_ENV", "install", "installed"]
