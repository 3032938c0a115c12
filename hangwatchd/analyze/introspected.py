"""Exact edges of the wait-for graph from a process's own answer (``introspect.json``).

A process started by ``hangwatchd run`` carries a reporter (``workload/introspect``)
that the capture asks what each thread and asyncio task waits for, which lock it
holds, which threads ended and how. Where it answered, these facts replace what
``process_graph`` would infer from the stacks: the lock's holder by its ident, the
thread a join waits for, the pool worker that was killed, the task that awaits a
future nobody resolves, the thread that ended holding the lock.

Only what the report says is used, each fact checked for its type (the report is
the user's process's own words: data, never trusted further than its shape).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from .evidence import as_int, dicts
from .waitfor import GONE, IDLE, LIVE, WAITS, Edge, Graph, Party

HOW = "the process's own answer (introspection)"
_LOCKS = ("lock", "rlock", "semaphore", "mp-lock")
_SETTERS = ("event", "condition", "queue", "barrier")


def _obj(d: dict[str, Any] | None, key: str) -> dict[str, Any]:
    """``d[key]`` where it is an object, else an empty one (the report is read, never trusted for its shape)."""
    v = d.get(key) if isinstance(d, dict) else None
    return v if isinstance(v, dict) else {}


def _s(v: Any, limit: int = 200) -> str | None:
    return v[:limit] if isinstance(v, str) and v else None


def _where(frame: Any) -> tuple[str | None, str | None]:
    """(short, full) ``function (file:line)`` of a report's frame."""
    if not isinstance(frame, dict):
        return None, None
    fn, path, line = _s(frame.get("function")) or "?", _s(frame.get("file"), 1000) or "?", as_int(frame.get("line"))
    base = path.rsplit("/", 1)[-1]
    return f"{fn} ({base}:{line})", f"{fn} ({path}:{line})"


def _when(t: Any) -> str:
    return f" at {time.strftime('%H:%M:%S', time.localtime(t))}" if isinstance(t, (int, float)) and 0 < t < 2**33 else ""


def _named_by(o: dict[str, Any]) -> set[str]:
    """The names a thread's code uses (its target's, from the process's answer)."""
    return set(_obj(o, "target").get("names") or [])


def _short_names(expr: str | None) -> set[str]:
    """The names a source expression is made of (``self._lock`` -> {"_lock"}, ``ready`` -> {"ready"})."""
    if not expr:
        return set()
    return {expr.replace("[", ".").split(".")[-1].strip("]'\" ")} - {""}


class Reader:
    """The report of one process, read into the graph: ``keys`` maps its live threads' native ids to
    their parties (made by ``process_graph``); ``base`` is the process's own key."""

    def __init__(self, g: Graph, pid: int, base: str, report: dict[str, Any], keys: dict[int, str],
                 child_key: Callable[[int], str]) -> None:
        self.g, self.pid, self.base, self.r, self.keys, self.child_key = g, pid, base, report, keys, child_key
        self.threads = [t for t in dicts(report.get("threads"))]
        self.by_ident = {as_int(t.get("ident")): t for t in self.threads if as_int(t.get("ident")) is not None}
        self.locks = _obj(report, "locks")
        self.exited = [t for t in dicts(report.get("exited_threads"))]
        self.forked = isinstance(report.get("fork"), dict)

    def party_of(self, ident: Any) -> str | None:
        t = self.by_ident.get(as_int(ident))
        return self.keys.get(as_int(t.get("native_id")) or -1) if t else None

    def edges(self, native_id: int, k: str) -> bool:
        """The edges of the live thread ``native_id`` (party ``k``) from the report; False where the
        report says nothing of it (the stacks decide)."""
        t = next((t for t in self.threads if as_int(t.get("native_id")) == native_id), None)
        w = _obj(t, "waits")
        if t is None or not isinstance(w.get("kind"), str):
            return False
        kind, expr = w["kind"], _s(w.get("expr"), 100)
        detail = _obj(w, "detail")
        name = f"{kind.replace('mp-', 'multiprocessing ')} {expr}" if expr else f"a {kind.replace('mp-', 'multiprocessing ')}"
        if kind in _LOCKS:
            module = _s(detail.get("import"), 200)
            return self._lock(k, t, w, f"the import lock of module {module}" if module else name)
        if kind in _SETTERS:
            return self._setter(k, t, w, kind, expr, name, detail)
        if kind == "thread":
            other = self.party_of(detail.get("ident"))
            if other is None:
                return False
            self.g.wait(Edge(k, f"thread {_s(detail.get('name'), 80) or ''} to end".replace("  ", " "), other, how=HOW))
            return True
        if kind == "future":
            return self._future(k, detail, expr)
        if kind == "process":
            return self._process(k, w, detail)
        if kind == "sleep" and isinstance(detail.get("seconds"), (int, float)):
            old = self.g.parties[k]
            self.g.parties[k] = Party(old.key, old.label, LIVE, old.where, f"sleeping ({detail['seconds']:g} s asked)",
                                      old.culprit, old.location, old.pid, old.main)
            return True
        if kind == "asyncio-loop":
            return self._loop(k, t)
        return False

    # -- locks -----------------------------------------------------------------

    def _lock(self, k: str, t: dict[str, Any], w: dict[str, Any], name: str) -> bool:
        lid = _s(w.get("id"), 40)
        lock = _obj(self.locks, lid) if lid else {}
        holders = [h for h in (lock.get("holders") or []) if as_int(h) is not None]
        owner = as_int(_obj(w, "detail").get("owner"))
        if owner:
            holders.append(owner)
        mine = as_int(t.get("ident"))
        if mine in holders:
            held = next((h for h in dicts(t.get("holds")) if h.get("id") == lid), {})
            at = _where(held.get("where"))[0]
            through, full = self._reentered(t, held.get("where"))
            if through:  # the code that called back in while the lock was held is what to look at
                self.g.parties[k] = dataclasses.replace(self.g.parties[k], culprit=through.split(" (", 1)[0], location=full)
            self.g.wait(Edge(k, f"{name}, which it already holds" + (f" (taken in {at})" if at else "")
                             + (f", re-entered through {through} while it held it" if through else ""), k, how=HOW))
            return True
        live = [p for p in (self.party_of(h) for h in holders) if p and p != k]
        for p in dict.fromkeys(live):
            self.g.wait(Edge(k, name, p, how=HOW))
        if live:
            return True
        gone = self._exited_with(lid, w.get("expr"), acquires=True)
        for x in gone:
            self.g.wait(Edge(k, name, x, how=HOW + ": a thread that ended took it and never released it",
                             why=f"it took {name} and never released it"))
        if gone:
            return True
        if lock.get("locked") is False:
            return False  # free now: whatever holds the thread, it is not this lock
        why = ("it was inherited locked at the fork: the thread that held it in the parent does not exist in this "
               "process" if self.forked else "no live thread holds it, and no thread that ended is known to have taken it")
        self.g.wait(Edge(k, name, None, why, how=HOW))
        return True

    @staticmethod
    def _reentered(t: dict[str, Any], taken: Any) -> tuple[str | None, str | None]:
        """Where a thread that waits for a lock it holds came back in: the frame called from the one
        that took it (a signal handler, a callback, ``__del__``, a logging handler), where one is
        between that frame and the wait; (None, None) otherwise."""
        frames = dicts(t.get("frames"))
        if not isinstance(taken, dict):
            return None, None
        key = (taken.get("function"), taken.get("file"), taken.get("line"))
        i = next((i for i, f in enumerate(frames) if i and (f.get("function"), f.get("file"), f.get("line")) == key), None)
        return _where(frames[i - 1]) if i is not None and i > 1 else (None, None)

    def _exited_with(self, oid: str | None, expr: Any, acquires: bool) -> list[str]:
        """Parties for the threads that ended and that took ``oid`` (or, without ``acquires``, whose
        code names it): each made gone, with how and when it ended."""
        names = _short_names(_s(expr, 100))
        out = []
        for x in self.exited:
            target = _obj(x, "target")
            took = any(a.get("id") == oid for a in dicts(target.get("acquires"))) if oid else False
            exc = (_obj(x, "exception") or None)
            holding = exc is not None and any(h.get("id") == oid for h in dicts(exc.get("holds"))) if oid else False
            named = bool(names & {n for n in target.get("names") or [] if isinstance(n, str)})
            if not (took or holding or (not acquires and named)):
                continue
            out.append(self._gone_thread(x, target, exc))
        return out

    def _gone_thread(self, x: dict[str, Any], target: dict[str, Any], exc: dict[str, Any] | None) -> str:
        nid = as_int(x.get("native_id")) or as_int(x.get("ident")) or 0
        k = f"{self.base}/x{nid}"
        where, full = _where({"function": target.get("qualname"), "file": target.get("file"), "line": target.get("line")})
        how = _s(x.get("how"), 20)
        if exc is not None:
            msg = _s(exc.get("message"), 200)
            at = _where(next(iter(dicts(exc.get("frames"))), None))[0]
            doing = (f"raised {(_s(exc.get('type'), 80) or 'an exception').removeprefix('builtins.')}"
                     + (f": {msg}" if msg else "") + (f" in {at}" if at else "") + f" and ended{_when(x.get('ended'))}")
        elif how == "lost_at_fork":
            doing = "was not copied into this process by the fork (only the thread that forks is)"
        else:
            doing = f"returned{_when(x.get('ended'))}"
        label = f"thread {_s(x.get('name'), 80) or nid}"
        self.g.add(Party(k, label, GONE, where, doing, (_s(target.get("qualname")) or "").rsplit(".", 1)[-1] or None,
                         full, self.pid))
        return k

    # -- what another thread sets, puts or notifies ----------------------------

    def _setter(self, k: str, t: dict[str, Any], w: dict[str, Any], kind: str, expr: str | None, name: str,
                detail: dict[str, Any]) -> bool:
        if kind == "queue" and (detail.get("idle_pool_worker") or detail.get("pool_handler")):
            old = self.g.parties[k]
            self.g.parties[k] = Party(old.key, old.label, IDLE, old.where, "waiting for work", old.culprit, old.location,
                                      old.pid, old.main)
            return True
        if kind == "queue" and detail.get("op") == "join" and (as_int(detail.get("unfinished_tasks")) or 0) > 0 \
                and as_int(detail.get("qsize")) == 0:
            return self._join(k, t, w, expr, name, as_int(detail.get("unfinished_tasks")) or 0)
        if kind == "event" and detail.get("is_set") is True or kind == "queue" and (as_int(detail.get("qsize")) or 0) > 0:
            return False  # it will return: what it waits for is there
        names = _short_names(expr)
        setters = [x for x, o in self._other_threads(t) if names & _named_by(o)
                   and not (isinstance(o.get("waits"), dict) and o["waits"].get("id") == w.get("id"))]
        verb = {"event": "set", "condition": "notify", "queue": "put into", "barrier": "reach"}[kind]
        for s in dict.fromkeys(setters):
            self.g.wait(Edge(k, name, s, how=HOW + f": a live thread whose code names it ({verb})", sure=False))
        if setters:
            return True
        gone = self._exited_with(_s(w.get("id"), 40), expr, acquires=False)
        for x in gone:
            self.g.wait(Edge(k, name, x, how=HOW + f": the thread that would {verb} it has ended", sure=False,
                             why=f"it was the thread to {verb} {name}" + (" (a wake-up sent before anyone waited is lost)"
                                                                            if kind == "condition" else "")))
        if gone:
            return True
        self.g.wait(Edge(k, name, None, f"no live thread refers to it, so nobody will {verb} it", how=HOW))
        return True

    def _other_threads(self, t: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """(party, report) of every thread of the process's answer but ``t`` that the graph has."""
        mine = as_int(t.get("ident"))
        return [(x, o) for o in self.threads if as_int(o.get("ident")) != mine
                and (x := self.keys.get(as_int(o.get("native_id")) or -1)) is not None]

    def _join(self, k: str, t: dict[str, Any], w: dict[str, Any], expr: str | None, name: str, left: int) -> bool:
        """``Queue.join`` on an empty queue with items still unfinished. A thread that takes from it
        (its code names it) and waits on something else holds an item yet: the chain goes on through
        it. Where every such thread waits in the queue's ``get`` for more, one of them took an item
        and never marked it done (``task_done``): they are the root."""
        items = f"{left} item{'s' if left != 1 else ''}"
        names, qid = _short_names(expr), w.get("id")
        idle, busy = [], []
        for x, o in self._other_threads(t):
            waits = _obj(o, "waits")
            if qid is not None and waits.get("id") == qid and _obj(waits, "detail").get("op") == "get":
                idle.append(x)
            elif names & _named_by(o):
                busy.append(x)
        what = f"every item of {name} to be marked done"
        for x in busy:  # it holds an item it has not marked done: what it waits for is the story
            self.g.wait(Edge(k, what, x, how=HOW + ": a live thread whose code takes from it", sure=False))
        for x in [] if busy else idle:
            self.g.parties[x] = dataclasses.replace(
                self.g.parties[x], state=LIVE, doing=f"waiting for more of {name}, though it never marked done (task_done) "
                f"{items} it took (a path of its loop that skips task_done: an error, a continue)")
            self.g.wait(Edge(k, what, x, how=HOW + ": a live thread that takes from it", sure=False))
        if not busy and not idle:
            self.g.wait(Edge(k, what, None, f"{items} taken from it {'were' if left != 1 else 'was'} never marked done "
                             "(task_done), none is queued, and no live thread takes from it", how=HOW))
        return True

    # -- futures, processes, pools ---------------------------------------------

    def _future(self, k: str, detail: dict[str, Any], expr: str | None) -> bool:
        running = self.party_of(detail.get("running_in"))
        if running and running != k:
            self.g.wait(Edge(k, f"a future{' ' + expr if expr else ''} it runs", running, how=HOW))
            return True
        if detail.get("loop_thread") is not None and self.party_of(detail.get("loop_thread")) == k:
            self.g.wait(Edge(k, "a result only its own event loop can produce, and that loop runs on this very "
                                "thread, which now waits instead of running it", k, how=HOW))
            return True
        for ex in dicts(self.r.get("executors")):  # a process pool with work and no worker left
            procs, pending = ex.get("processes"), as_int(ex.get("pending"))
            if isinstance(procs, list) and not any(isinstance(x, dict) and x.get("exitcode") is None for x in procs) \
                    and pending:
                per = as_int(ex.get("max_tasks_per_child"))
                self.g.wait(Edge(k, "a future's result", None,
                                 f"its {_s(ex.get('type'), 80) or 'process pool'} holds {pending} pending task"
                                 f"{'s' if pending != 1 else ''} and no worker process is left"
                                 + (f": its workers exited after max_tasks_per_child = {per} tasks each and none was "
                                    "started again" if per else ""), how=HOW))
                return True
        return False

    def _process(self, k: str, w: dict[str, Any], detail: dict[str, Any]) -> bool:
        pools = [p for p in dicts(self.r.get("pools")) if p.get("id") == w.get("id")]
        ended = [x for p in pools for x in dicts(p.get("exited_workers"))]
        func = _obj(detail, "func")
        task = _s(func.get("qualname"), 100)
        made = False
        for x in ended[:8]:
            made = self._gone_process(k, x, task) or made
        pid, code = as_int(detail.get("pid")), detail.get("exitcode")
        if pid is not None and isinstance(code, int) and not isinstance(code, bool):
            made = self._gone_process(k, {"pid": pid, "exitcode": code, "name": detail.get("name")}, task) or made
        return made

    def _gone_process(self, k: str, x: dict[str, Any], task: str | None) -> bool:
        pid, code = as_int(x.get("pid")), x.get("exitcode")
        if pid is None or not isinstance(code, int) or isinstance(code, bool) or code == 0:
            return False
        pk = self.child_key(pid)
        how = f"was killed by signal {-code}{_signal_name(-code)}" if code < 0 else f"exited with status {code}"
        label = f"{_s(x.get('name'), 80) or 'child process'} (pid {pid})"
        doing = how + (f" while running {task}" if task else "")
        self.g.parties[pk] = Party(pk, label, GONE, None, doing, task, None, pid, True)
        self.g.wait(Edge(k, "its pool's workers" if task else "a child process", pk, how=HOW,
                         why="the pool does not run the task again: its result never comes" if task else None))
        return True

    # -- asyncio ---------------------------------------------------------------

    def _loop(self, k: str, t: dict[str, Any]) -> bool:
        loops = [a for a in dicts(self.r.get("asyncio")) if as_int(a.get("thread")) == as_int(t.get("ident"))]
        if not loops:
            return False
        loop = loops[0]
        blocker = (_obj(loop, "blocked_by_callback") or None)
        if blocker is not None:
            return False  # a callback that blocks the loop: the stacks say in what (a sleep, a read)
        tasks = [x for x in dicts(loop.get("tasks")) if not x.get("done")]
        made = False
        for task in tasks[:16]:
            tk = self._task(task)
            if tk is not None:
                self.g.wait(Edge(k, f"task {_s(task.get('name'), 80)}", tk, how=HOW))
                made = True
        return made

    def _task(self, task: dict[str, Any]) -> str | None:
        tid = _s(task.get("id"), 40)
        if tid is None:
            return None
        k = f"{self.base}/a{tid}"
        coro = _obj(task, "coro")
        frames = dicts(task.get("frames"))
        where, full = _where(frames[0] if frames else {"function": coro.get("qualname"), "file": coro.get("file"),
                                                         "line": coro.get("line")})
        culprit = (_s(coro.get("qualname")) or "").rsplit(".", 1)[-1] or None
        self.g.add(Party(k, f"task {_s(task.get('name'), 80)} ({culprit or '?'})", WAITS, where, None, culprit, full, self.pid))
        a = _obj(task, "awaits")
        kind, expr = _s(a.get("kind"), 20), _s(a.get("expr"), 100)
        detail = _obj(a, "detail")
        what = f"{kind} {expr}" if expr else f"a {kind}"
        if kind == "sleep":
            self.g.parties[k] = Party(k, self.g.parties[k].label, LIVE, where, "sleeping", culprit, full, self.pid)
        elif kind == "task":
            other = _s(a.get("id"), 40)
            if other:
                self.g.wait(Edge(k, what, f"{self.base}/a{other}", how=HOW))
        elif kind == "lock":
            lock = _obj(self.locks, _s(a.get("id"), 40) or "")
            holders = [f"{self.base}/a{h}" for h in (lock.get("holder_tasks") or []) if isinstance(h, str)]
            for h in holders:
                self.g.wait(Edge(k, what, h, how=HOW))
            if not holders:
                gone = self._ended_tasks(expr)
                for x, how in gone:
                    self.g.wait(Edge(k, what, x, how=HOW + ": a task that ended named it", sure=False,
                                     why=f"it took {what} and ended ({how}) without releasing it"))
                if not gone:
                    self.g.wait(Edge(k, what, None, "no live task holds it: the task that took it was cancelled or "
                                                    "finished without releasing it", how=HOW))
        elif kind == "event" and detail.get("is_set") is True:
            self._set_off_loop(k, what)
        elif kind in ("future", "queue", "event", "condition"):
            verb = {"future": "resolve", "queue": "put into", "event": "set", "condition": "notify"}[kind]
            if kind == "future" and detail.get("done"):
                return k
            gone = self._ended_tasks(expr) if kind != "future" else []
            for x, _how in gone:
                self.g.wait(Edge(k, what, x, how=HOW + ": a task that ended named it", sure=False,
                                 why=f"it was the task to {verb} {what}"))
            if not gone:
                self.g.wait(Edge(k, what, None, f"no live task or thread refers to it, so nobody will {verb} it",
                                 how=HOW, sure=False))
        elif kind in ("io", "other") or kind is None:
            self.g.parties[k] = Party(k, self.g.parties[k].label, IDLE, where, "waiting for I/O", culprit, full, self.pid)
        return k

    def _set_off_loop(self, k: str, what: str) -> None:
        """An asyncio event that is set while its task still waits: it was set from a thread that is
        not its loop's (``asyncio.Event.set`` is not thread-safe: the loop was never woken). The thread
        that did it, where one thread that ended calls ``set``; else the sentence says so of nobody."""
        fix = "asyncio.Event is not thread-safe; loop.call_soon_threadsafe(event.set) wakes the loop"
        setters = [x for x in self.exited if "set" in (_obj(x, "target").get("names") or [])]
        if len(setters) == 1:
            x = setters[0]
            gone = self._gone_thread(x, _obj(x, "target"), _obj(x, "exception") or None)
            self.g.wait(Edge(k, f"{what}, set but never woken", gone, how=HOW + ": the thread that ended calls set",
                             sure=False, why=f"it set {what} from its own thread, not the event loop's, so the loop "
                                             f"was never woken to resume the task ({fix})"))
            return
        self.g.wait(Edge(k, what, None, f"it is set, yet the task was never woken: it was set from a thread that is not "
                                        f"its event loop's ({fix})", how=HOW))

    def _ended_tasks(self, expr: str | None) -> list[tuple[str, str]]:
        """Parties for the asyncio tasks that ended and whose coroutine names ``expr``: (key, how it ended)."""
        names = _short_names(expr)
        out = []
        for i, x in enumerate(dicts(self.r.get("ended_tasks"))):
            coro = _obj(x, "coro")
            if not names or not names & {n for n in coro.get("names") or [] if isinstance(n, str)}:
                continue
            where, full = _where({"function": coro.get("qualname"), "file": coro.get("file"), "line": coro.get("line")})
            exc = (_obj(x, "exception") or None)
            how = _s(x.get("how"), 20) or "ended"
            if exc is not None:
                msg = _s(exc.get("message"), 200)
                doing = f"raised {(_s(exc.get('type'), 80) or 'an exception').removeprefix('builtins.')}" + (f": {msg}" if msg else "")
            else:
                doing = "was cancelled" if how == "cancelled" else "returned"
            k = f"{self.base}/e{i}"
            culprit = (_s(coro.get("qualname")) or "").rsplit(".", 1)[-1] or None
            self.g.add(Party(k, f"task {_s(x.get('name'), 80)} ({culprit or '?'})", GONE, where,
                             doing + _when(x.get("ended")), culprit, full, self.pid))
            out.append((k, how))
        return out


def _signal_name(n: int) -> str:
    import signal

    try:
        return f" ({signal.Signals(n).name})"
    except ValueError:
        return ""
