"""The wait-for graph of the processes of an incident, built from what was captured of them.

Each captured process contributes its threads (py-spy's stacks, ``/proc``'s
wait channels and blocking descriptors); a process that waits for its
children points at them (those captured, and those that exited: ``exits.json``);
a read points at whoever holds the other end of the pipe or socket. Where the
process answered the daemon's introspection (``introspect.json``: the
reporter that ``hangwatchd run`` installs) the edges are exact: which lock,
held by which thread, which thread a join waits for, which threads exited and
how. Without it an edge is inferred, and says so: a lock is taken to be held
by the one other thread that is not itself waiting, and where several could
be, each is followed.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from . import introspected
from . import thread_waits as tw
from .evidence import Evidence, as_int, dicts
from .waitfor import GONE, IDLE, LIVE, WAITS, Edge, Graph, Party

Thread = dict[str, Any]


@dataclass(frozen=True)
class Proc:
    """One captured process as the graph needs it."""

    pid: int
    ev: Evidence
    parent: int | None
    role: str | None  # "multiprocessing worker 1", "subprocess python", ... (a captured child)
    exits: tuple[dict[str, Any], ...] = ()  # its descendants that exited before the capture (exits.json)
    report: dict[str, Any] | None = None  # its own answer to the introspection (introspect.json)


def key(pid: int, tid: int | None = None) -> str:
    return f"p{pid}" if tid is None else f"p{pid}/t{tid}"


def process_label(p: Proc) -> str:
    return f"{p.role} (pid {p.pid})" if p.role else f"pid {p.pid}"


def _tid(t: Thread) -> int | None:
    return as_int(t.get("os_thread_id")) or as_int(t.get("thread_id"))


def _thread_name(t: Thread) -> str:
    name = t.get("thread_name")
    return str(name) if isinstance(name, str) and name else f"thread {_tid(t)}"


def _is_main(t: Thread, pid: int) -> bool:
    return t.get("thread_name") == "MainThread" or _tid(t) == pid


def build(procs: list[Proc]) -> Graph:
    """The graph of every thread and process in ``procs``, and of the children that exited."""
    g = Graph()
    by_pid = {p.pid: p for p in procs}
    for p in procs:
        _add_process(g, p, by_pid)
    return g


def _proc_threads(p: Proc) -> dict[int, dict[str, Any]]:
    """/proc's record of each thread: wait channel, state, and (where captured) what it is blocked on."""
    out = {}
    for t in dicts(p.ev.proc.get("threads")):
        tid = as_int(t.get("tid"))
        if tid is not None:
            out[tid] = t
    top = p.ev.proc.get("blocked_on")
    if isinstance(top, dict) and not isinstance(out.get(p.pid, {}).get("blocked_on"), dict):
        out[p.pid] = dict(out.get(p.pid, {}), blocked_on=top)  # the main thread's, as proc.json's top level says
    return out


def _add_process(g: Graph, p: Proc, by_pid: dict[int, Proc]) -> None:
    threads = [t for t in p.ev.threads if isinstance(t, dict)]
    kernel = _proc_threads(p)
    main = next((t for t in threads if _is_main(t, p.pid)), threads[0] if len(threads) == 1 else None)
    waits: dict[str, tuple[Thread, tw.Wait]] = {}
    for i, t in enumerate(threads):
        tid = _tid(t)
        k = key(p.pid) if t is main else key(p.pid, tid) if tid is not None else f"{key(p.pid)}/i{i}"
        info = kernel.get(tid if tid is not None else (p.pid if t is main else -1), {})
        w = tw.classify(t, info.get("wchan") if isinstance(info.get("wchan"), str) else None, info.get("blocked_on"))
        waits[k] = (t, w)
        # A process is named by its main thread where it has only that (or is a captured child);
        # threads are named as threads: "thread fetcher".
        label = (process_label(p) if p.role else "the main thread") if t is main and (len(threads) == 1 or p.role) \
            else f"thread {_thread_name(t)}"
        g.add(Party(k, label, WAITS, tw.where(w.frame), culprit=tw.function(w.frame), location=tw.where(w.frame, full=True),
                    pid=p.pid, main=t is main))
    if main is None:  # no Python stack (another program, or py-spy could not read it): /proc says what it waits for
        t = {"thread_name": "main", "frames": []}
        w = tw.classify(t, None, p.ev.proc.get("blocked_on"))
        waits[key(p.pid)] = (t, w)
        g.add(Party(key(p.pid), process_label(p), WAITS, None, pid=p.pid, main=True))
    told: set[str] = set()
    if p.report is not None:  # the process's own answer: exact where it speaks
        keys = {tid: k for k, (t, _) in waits.items() if (tid := _tid(t)) is not None}
        reader = introspected.Reader(g, p.pid, key(p.pid), p.report, keys, key)
        told = {k for k, (t, _) in waits.items() if _tid(t) is not None and reader.edges(_tid(t) or 0, k)}
    held = _gil_held_blocked(waits)
    for k, (t, w) in waits.items():
        if k in told:
            continue
        if held is not None and k != held and tw.may_want_gil(t, w):
            g.wait(Edge(k, "the GIL", held, how="py-spy's owns_gil: its holder is blocked in a call and never lets it "
                                                  "go, so no other thread can run Python"))
        else:
            _edges_of(g, p, k, t, w, waits, by_pid)
    _children_edges(g, p, waits, by_pid)
    for k, (_t, w) in waits.items():  # where each wait is, said once for all its edges
        g.edges[k] = [dataclasses.replace(e, call=e.call or tw.call_of(w)) for e in g.out(k)]


def _gil_held_blocked(waits: dict[str, tuple[Thread, tw.Wait]]) -> str | None:
    """The thread that holds the GIL while blocked off the CPU (a read or a sleep in C that keeps it:
    ``ctypes.PyDLL``, an extension), where there is one: no other thread can run a line of Python."""
    return next((k for k, (t, w) in waits.items() if t.get("owns_gil") and not t.get("active")
                 and w.kind in (tw.IO, tw.SLEEP)), None)


def _others(waits: dict[str, tuple[Thread, tw.Wait]], k: str) -> dict[str, tuple[Thread, tw.Wait]]:
    return {x: v for x, v in waits.items() if x != k}


def _idle_worker(t: Thread, w: tw.Wait) -> bool:
    """A thread of the machinery waiting for work (a pool's worker in its queue, a handler thread)."""
    if tw.is_helper_thread(t):
        return True
    return w.kind in (tw.QUEUE, tw.SELECT) and w.frame is not None and not tw.user_frame(t)


def _set(g: Graph, k: str, state: str, doing: str) -> None:
    g.parties[k] = dataclasses.replace(g.parties[k], state=state, doing=doing)


def _edges_of(g: Graph, p: Proc, k: str, t: Thread, w: tw.Wait, waits: dict[str, tuple[Thread, tw.Wait]],
              by_pid: dict[int, Proc]) -> None:
    loop = " inside the asyncio event loop, which runs nothing else meanwhile" if w.in_event_loop else ""
    if w.kind == tw.RUNNING:
        if w.holds_gil and w.c_function:
            _set(g, k, LIVE, f"holding the GIL while spinning in C in {w.c_function}")
        else:
            _set(g, k, LIVE, f"busy on the CPU{loop}")
        return
    if w.kind == tw.SLEEP:
        if w.holds_gil and w.c_function:
            _set(g, k, LIVE, f"holding the GIL while sleeping in C in {w.c_function}")
        else:
            long = tw.sleep_seconds(tw.user_frame(t))
            _set(g, k, LIVE, f"sleeping{' (' + long + ')' if long else ''}{loop}")
        return
    if w.kind == tw.IO:
        _io_edges(g, p, k, w, waits, by_pid, loop)
        return
    if w.kind == tw.GIL:
        holder = next((x for x, (tt, _) in _others(waits, k).items() if tt.get("owns_gil")), None)
        g.wait(Edge(k, "the GIL", holder, unknown=None if holder else "py-spy names no thread that holds it",
                    how="native frames: take_gil, py-spy's owns_gil"))
        return
    if w.kind == tw.SELECT:
        what = "the asyncio event loop to wake it" if w.call == "the asyncio event loop" else f"I/O in {w.call}"
        _set(g, k, IDLE, f"waiting for {what}")
        return
    forked = forked_from(p, by_pid)
    if forked is not None and _lost_at_fork(g, p, k, t, w, waits, forked):
        return
    if _waits_for_children(w):
        if not p.exits and not any(c.parent == p.pid and c.pid != p.pid for c in by_pid.values()):
            if p.role:  # a worker at its queue, with no children of its own: waiting for work
                _set(g, k, IDLE, f"waiting for work in {w.call}")
                return
        return  # its children: _children_edges
    if w.kind == tw.FUTURE and w.in_event_loop:
        g.wait(Edge(k, "a result that only the asyncio event loop it runs in can produce: the loop's own thread "
                       "now waits instead of running it", k, how="library frames: a blocking Future.result inside "
                                                              "the event loop's callback", sure=False))
        return
    if w.kind == tw.UNKNOWN:
        if p.role and w.frame is not None and tw.user_frame(t) is w.frame and tw.python_frames(t)[:1] == [w.frame]:
            _set(g, k, LIVE, "in code of its own")  # a child whose innermost frame is its own code: stuck there
        return
    _thread_edges(g, k, w, waits)


_WHAT = {tw.LOCK: "a lock", tw.JOIN: "a thread to end", tw.CONDITION: "a condition to be notified",
         tw.EVENT: "an event to be set", tw.QUEUE: "an item in a queue", tw.FUTURE: "a future's result",
         tw.SEMAPHORE: "a semaphore", tw.BARRIER: "the other parties of a barrier"}
# Who can end each kind of wait: a lock's holder, the thread joined, whoever sets or puts.
_BY = {tw.LOCK: "held by", tw.JOIN: "", tw.CONDITION: "to be notified by", tw.EVENT: "to be set by",
       tw.QUEUE: "to be filled by", tw.FUTURE: "to be completed by", tw.SEMAPHORE: "held by", tw.BARRIER: ""}


def forked_from(p: Proc, by_pid: dict[int, Proc]) -> Proc | None:
    """The captured parent ``p`` was forked from (without an exec: the same command line), if any."""
    parent = by_pid.get(p.parent) if p.parent is not None else None
    if parent is None:
        return None
    mine, theirs = p.ev.proc.get("cmdline"), parent.ev.proc.get("cmdline")
    return parent if isinstance(mine, list) and mine and mine == theirs else None


def _lost_at_fork(g: Graph, p: Proc, k: str, t: Thread, w: tw.Wait, waits: dict[str, tuple[Thread, tw.Wait]],
                  parent: Proc) -> bool:
    """A wait in a fork child on what only a thread of the parent could end: a lock some thread of the
    parent held at the fork (the child's copy stays locked: its holder was not copied), a pool or
    executor whose threads were not copied. Adds the dead end and says True; False otherwise."""
    others = [x for x, (tt, ww) in _others(waits, k).items() if not _idle_worker(tt, ww)]
    threads = [tt for tt in parent.ev.threads if isinstance(tt, dict) and tt.get("thread_name") not in (None, "MainThread")
               and not tw.is_helper_thread(tt)]
    named = ", ".join(f"thread {tt.get('thread_name')}" + (f" ({tw.where(tw.user_frame(tt))})" if tw.user_frame(tt) else "")
                      for tt in threads[:3])
    if w.kind == tw.LOCK and not others:
        why = (f"it was forked from pid {parent.pid} while another thread there held the lock, and that thread does not "
               f"exist in this process (a fork copies only the thread that forks); the threads of pid {parent.pid} "
               f"that could have held it: {named or 'none named'}")
        g.wait(Edge(k, "a lock inherited locked at its fork", None, why, how="the process tree: a child with its parent's "
                    "command line, forked; no thread of it could hold the lock", sure=False))
        return True
    if w.kind in (tw.FUTURE, tw.POOL) and not any(_pool_of(tt) or _pool_handler(tt) for tt, _ in _others(waits, k).values()):
        kind = "thread pool" if w.kind == tw.FUTURE else "process pool"
        why = (f"the {kind} it uses was started in pid {parent.pid} before the fork, and its threads do not exist in "
               "this process (a fork copies only the thread that forks): nothing will ever run the work")
        g.wait(Edge(k, f"the {kind}'s work", None, why, how="the process tree and its threads", sure=False))
        return True
    return False


def _pool_handler(t: Thread) -> bool:
    """A multiprocessing pool's handler thread (results, tasks, workers)."""
    return any(str(f.get("name") or "").rsplit(".", 1)[-1] in ("_handle_workers", "_handle_tasks", "_handle_results")
               for f in tw.python_frames(t))


def _thread_edges(g: Graph, k: str, w: tw.Wait, waits: dict[str, tuple[Thread, tw.Wait]]) -> None:
    """A wait on something another thread of the process ends; without introspection the
    candidates are the threads that could: for a lock, those not idle; for a join or something to be
    set, those alive and not waiting for work. Each is followed; none at all is a dead end."""
    what = _WHAT.get(w.kind, w.kind)
    pool = _pool_of(waits[k][0])
    others = _others(waits, k)
    if w.kind == tw.FUTURE and pool is not None:
        mates = [x for x, (tt, ww) in others.items() if _pool_of(tt) == pool]
        if all(others[x][1].kind == tw.FUTURE for x in mates):
            n = len(mates) + 1
            g.wait(Edge(k, "a future's result", None,
                        f"its work is queued behind it in the same pool, {pool}, whose {'every one of its ' + str(n) + ' workers' if n > 1 else 'only worker'} "
                        "waits like this: pool starvation, no worker is left to run what they wait for",
                        how="the pool's thread names and frames", sure=False))
            return
    if w.kind == tw.LOCK:
        interrupted = _finalizer_interrupting(waits[k][0])
        if interrupted is not None and not any(not _idle_worker(tt, ww) for tt, ww in others.values()):
            fin, outer = interrupted
            g.wait(Edge(k, f"a lock that {tw.where(outer)}, which the finalizer {tw.where(fin)} interrupted on the "
                           "same thread, most likely holds (a finalizer runs on whatever thread frees the object)",
                        k, how="a __del__ frame in the waiting thread's stack, and no other thread that could hold the lock",
                        sure=False))
            return
        up = _same_object_further_up(waits[k][0], w)
        if up is not None:
            g.wait(Edge(k, f"a lock of the object that its own frame {tw.where(up)}, further up its stack, works on and holds",
                        k, how="py-spy's locals: the same self in an outer frame of the same thread", sure=False))
            return
    if w.kind == tw.JOIN and w.obj is not None:
        joined = next((x for x, (tt, _) in others.items() if tw.thread_object(tt) == w.obj), None)
        if joined is not None:
            g.wait(Edge(k, "a thread to end", joined, how="py-spy's locals: the Thread object joined"))
            return
    candidates = [x for x, (tt, ww) in others.items() if not _idle_worker(tt, ww) and ww.kind != tw.UNKNOWN]
    if w.obj is not None and w.kind != tw.JOIN:
        # Who else holds the very object waited on (py-spy's locals), and does not wait on it too:
        # the threads that can set, put or notify it.
        holding = [x for x, (tt, ww) in others.items() if w.obj in tw.local_addrs(tt) and ww.obj != w.obj]
        if holding:
            for x in holding:
                g.wait(Edge(k, _WHAT.get(w.kind, w.kind), x, how="py-spy's locals: a thread that holds the object waited on",
                            sure=False))
            return
    if w.kind == tw.FUTURE:
        workers = [x for x, (tt, ww) in others.items() if _pool_of(tt) is not None]
        candidates = workers or candidates
    if not candidates:
        nobody = ("no other live thread could hold it: it is held by a thread that is gone, or by this thread "
                  "further up its own stack" if w.kind == tw.LOCK else
                  "no other live thread can end it" if w.kind != tw.JOIN else None)
        g.wait(Edge(k, what, None, nobody, None if nobody else "the thread it joins is not among the threads captured",
                    w.how))
        return
    for x in candidates:
        g.wait(Edge(k, what, x, how=f"{w.how}; {'the only other live thread' if len(candidates) == 1 else 'one of the live threads'}"
                                  " (which one cannot be read from outside the process)", sure=False))


def _finalizer_interrupting(t: Thread) -> tuple[tw.Frame, tw.Frame] | None:
    """A ``__del__`` on the thread's stack (innermost first) and the program's frame it interrupted."""
    pys = tw.python_frames(t)
    for i, f in enumerate(pys):
        if str(f.get("name") or "").endswith("__del__"):
            outer = next((o for o in pys[i + 1:] if tw.is_user_frame(o)), None)
            return (f, outer) if outer is not None else None
    return None


def _same_object_further_up(t: Thread, w: tw.Wait) -> tw.Frame | None:
    """An outer frame of the same thread working on the object whose lock it waits for (the same
    ``self``): a non-reentrant lock taken a second time by the thread that holds it."""
    pys = tw.python_frames(t)
    if not pys or w.frame is None:
        return None
    inner = tw.local_addr(pys[0], "self") or tw.local_addr(w.frame, "self")
    if inner is None:
        return None
    start = next((i for i, f in enumerate(pys) if f is w.frame), 0)
    return next((f for f in pys[start + 1:] if tw.local_addr(f, "self") == inner), None)


def _pool_of(t: Thread) -> str | None:
    """Which ThreadPoolExecutor a thread is a worker of: its work queue (``_worker``'s local, from
    py-spy's locals), else its name's prefix; None for a thread that is not a pool's worker."""
    for f in tw.python_frames(t):
        if str(f.get("filename") or "").endswith("concurrent/futures/thread.py") and str(f.get("name") or "").endswith("_worker"):
            queue = tw.local_addr(f, "work_queue")
            name = str(t.get("thread_name") or "")
            prefix = name.rsplit("_", 1)[0] if "_" in name else name
            return f"{prefix} (its work queue at {hex(queue)})" if queue is not None else prefix or "a thread pool"
    return None


def _io_edges(g: Graph, p: Proc, k: str, w: tw.Wait, waits: dict[str, tuple[Thread, tw.Wait]],
              by_pid: dict[int, Proc], loop: str) -> None:
    b = w.blocked
    verb = _VERBS.get(str(w.call or ""), f"blocked in {w.call}")
    obj = _object_text(b)
    if w.holds_gil:
        c = f" in {w.c_function}" if w.c_function else ""
        _set(g, k, LIVE, f"holding the GIL while blocked {verb + ' ' + obj if obj else 'in ' + str(w.call) + '()'}{c}")
        return
    peers = [x for x in dicts(b.get("peers"))]
    kind = b.get("kind")
    reading = str(w.call or "").startswith(("read", "recv", "pread", "openat", "accept"))
    if kind in ("pipe", "FIFO") and "peers" in b:
        want = "w" if reading else "r"
        others = [x for x in peers if want in str(x.get("mode") or "")]
        outside = [x for x in others if as_int(x.get("pid")) != p.pid]
        if not others:
            _set(g, k, LIVE, f"{verb} {obj} that no process holds open for {'writing' if reading else 'reading'}{loop}")
            return
        if not outside:
            writers = [x for x, (_, ww) in _others(waits, k).items() if ww.kind == tw.IO and ww.call != w.call]
            if not writers and _to_the_dead(g, p, k, obj, reading):
                return
            if not writers:
                _set(g, k, LIVE, f"{verb} {obj} whose other end only its own process holds, and no thread of it "
                                 f"{'writes' if reading else 'reads'} it: nobody will{loop}")
                return
        captured = [x for x in outside if as_int(x.get("pid")) in by_pid]
        if not captured:  # its other end is only in processes not captured: the reader is where the story stops
            who = ", ".join(f"pid {x.get('pid')} ({x.get('comm') or '?'})" for x in outside[:3])
            _set(g, k, LIVE, f"{verb} {obj}, whose other end only {who} holds{' (not captured)'}{loop}")
            return
        for x in captured[:8]:
            g.wait(Edge(k, f"{'data from' if reading else 'room in'} {obj}", key(as_int(x.get("pid")) or 0),
                        how="the pipe's ends in /proc/*/fd"))
        return
    sock = b.get("socket") if isinstance(b.get("socket"), dict) else None
    if kind == "socket" and sock is not None and peers and _in_process_server(g, p, k, w, waits, sock, peers, obj):
        return
    if kind == "socket" and sock is not None and peers:
        for x in peers[:8]:
            pid = as_int(x.get("pid"))
            if pid is None or pid == p.pid or pid not in by_pid:
                continue  # a peer inside this very process is found by its own thread's wait; an uncaptured one is named below
            g.wait(Edge(k, f"{'data from' if reading else 'room in'} {obj}", key(pid), how="the socket's peer (sock_diag, /proc/net)"))
        if g.out(k):
            return
    if kind == "socket" and reading and _to_the_dead(g, p, k, obj, reading):
        return
    if not obj:  # no descriptor in the evidence: the call is all there is
        _set(g, k, LIVE, f"blocked in {w.call}(){loop}")
        return
    text = b.get("text") if isinstance(b.get("text"), str) and not b.get("peers") and not b.get("socket") else None
    _set(g, k, LIVE, f"{text or verb + ' ' + obj}{_never(b, reading)}{loop}")


def _in_process_server(g: Graph, p: Proc, k: str, w: tw.Wait, waits: dict[str, tuple[Thread, tw.Wait]],
                       sock: dict[str, Any], peers: list[dict[str, Any]], obj: str) -> bool:
    """A socket whose other end is in this very process: a server of its own. The thread that
    serves it is found by its frames (socketserver, http.server, asyncio's serve_forever); a
    connection still waiting in the listener's backlog waits for that thread to accept it, and
    where that thread is the waiter itself, it waits for itself. Adds the edge; True when it did."""
    if not all(as_int(x.get("pid")) == p.pid for x in peers):
        return False
    servers = [x for x, (tt, _) in waits.items() if _serves(tt)]
    if not servers:
        return False
    where = sock.get("remote") or obj
    if sock.get("peer_accepted") is False:
        for x in servers:
            what = (f"its own server at {where} to accept the connection it made, which waits in that server's backlog: "
                    "it serves that server itself, one request at a time" if x == k else
                    f"the server at {where} to accept its connection (it waits in the backlog)")
            g.wait(Edge(k, what, x, how="the socket's peer is in the listener's backlog; the thread whose frames serve it",
                        sure=False))
        return True
    for x in servers:
        if x != k:
            g.wait(Edge(k, f"a reply from its own server at {where}", x,
                        how="the socket's peer is this process's; the thread whose frames serve connections", sure=False))
    return bool(g.out(k))


def _serves(t: Thread) -> bool:
    """A thread that serves connections: its frames run a server's loop or a request's handler."""
    return any(str(f.get("filename") or "").endswith(("socketserver.py", "http/server.py"))
               or str(f.get("name") or "").endswith("serve_forever") for f in tw.python_frames(t))


def _to_the_dead(g: Graph, p: Proc, k: str, obj: str, reading: bool) -> bool:
    """A read nobody alive will answer, in a process whose child died badly: the child that would
    have sent is the likelier end (a worker that crashed before it wrote; its end kept open by a
    descriptor the parent leaked). Adds an inferred edge to each such child and says True."""
    dead = _exited_children(g, p)
    for x in dead:
        g.wait(Edge(k, f"data on {obj}" if reading else f"room on {obj}", x,
                    how="no live process holds the other end; a child of it died (the kernel's record of exits)", sure=False))
    return bool(dead)


def _obj(d: dict[str, Any], key: str) -> dict[str, Any]:
    v = d.get(key)
    return v if isinstance(v, dict) else {}


def _never(b: dict[str, Any], reading: bool) -> str:
    sock = _obj(b, "socket")
    if reading and sock.get("rx_queue") == 0 and sock.get("state") == "ESTABLISHED":
        return ", with no unread bytes: its peer never sends"
    return ""


_VERBS = {"read": "reading", "pread64": "reading", "readv": "reading", "recvfrom": "receiving on", "recvmsg": "receiving on",
          "recv": "receiving on", "accept": "accepting on", "accept4": "accepting on", "write": "writing",
          "writev": "writing", "sendto": "sending on", "sendmsg": "sending on", "connect": "connecting",
          "openat": "opening", "flock": "locking"}


def _object_text(b: dict[str, Any]) -> str:
    kind, path = b.get("kind"), b.get("path")
    if kind == "FIFO":
        return f"FIFO {path}"
    if kind == "pipe":
        return "a pipe"
    if kind == "socket":
        sock = _obj(b, "socket")
        where = b.get("socket_path") or sock.get("remote") or sock.get("local")
        return f"a {sock.get('family') or ''} socket{' ' + str(where) if where else ''}".replace("a  ", "a ")
    if kind in ("file", "device"):
        return f"{kind} {path}"
    return "" if kind is None else str(kind)


def _children_edges(g: Graph, p: Proc, waits: dict[str, tuple[Thread, tw.Wait]], by_pid: dict[int, Proc]) -> None:
    """A process waiting for its children (a pool's map, a DataLoader's batch, a subprocess's wait)
    points at each child captured and each that exited (exits.json)."""
    kids = [c for c in by_pid.values() if c.parent == p.pid and c.pid != p.pid]
    gone = _exited_children(g, p)
    for k, (_t, w) in waits.items():
        child_wait = _waits_for_children(w) and g.parties[k].state == WAITS
        io_from_kids = w.kind == tw.IO and any(as_int(x.get("pid")) in {c.pid for c in kids}
                                               for x in dicts(w.blocked.get("peers")))
        if not child_wait or io_from_kids:
            continue
        what = "its child processes"
        for x in gone:
            g.wait(Edge(k, what, x, how="the kernel's record of process exits"))
        for c in kids:
            g.wait(Edge(k, what, key(c.pid), how="the process tree", sure=len(kids) == 1 and not gone))
        if not kids and not gone:
            g.wait(Edge(k, what, None, None, "no child process was captured, and no exit of one was recorded", w.how))


def _waits_for_children(w: tw.Wait) -> bool:
    """A wait that a child process ends: a pool's map, a subprocess, a multiprocessing queue or pipe."""
    return w.kind in (tw.CHILD, tw.POOL, tw.MPQUEUE)


def _exited_children(g: Graph, p: Proc) -> list[str]:
    out = []
    for e in p.exits[:64]:
        pid = as_int(e.get("pid"))
        if pid is None:
            continue
        k = key(pid)
        how = _how_it_ended(e)
        if how is None:
            continue
        comm = e.get("comm") if isinstance(e.get("comm"), str) else None
        known = _child_named(p, pid)  # the parent's own name for it and the function it ran (introspection)
        name = known.get("name") if isinstance(known.get("name"), str) else None
        target = known.get("target") if isinstance(known.get("target"), str) else None
        label = f"{name} (pid {pid}{', running ' + target if target else ''})" if name else \
            f"child process {comm or ''} (pid {pid})".replace("  ", " ")
        g.add(Party(k, label, GONE, None, how, target.rsplit(".", 1)[-1] if target else None, pid=pid, main=True))
        out.append(k)
    return out


def _child_named(p: Proc, pid: int) -> dict[str, Any]:
    """What the process's own answer says of its child ``pid``: its multiprocessing name and target."""
    kids = p.report.get("children") if isinstance(p.report, dict) else None
    return next((c for c in dicts(kids) if as_int(c.get("pid")) == pid), {})


def _how_it_ended(e: dict[str, Any]) -> str | None:
    """How a child ended, or None for an end that explains nothing (a helper that finished well)."""
    sig = e.get("signal")
    code = as_int(e.get("exit_code"))
    when = e.get("time")
    at = f" at {time.strftime('%H:%M:%S', time.localtime(when))}" if isinstance(when, (int, float)) and 0 < when < 2**33 else ""
    if isinstance(sig, str) and sig:
        return f"was killed by {sig}{at}"
    if code:
        return f"exited with status {code}{at}"
    return None
