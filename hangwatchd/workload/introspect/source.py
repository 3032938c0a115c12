"""The source of a frame's function, as a syntax tree, and what its expressions name right now.

A thread stuck in ``with journal_lock:`` shows, from outside, only a line number.
Here the function around that line is parsed (only that function: a 5,000-line
module is not parsed for one frame), its ``with`` blocks and ``acquire()`` calls
are found, and their expressions are evaluated against the frame's locals and
globals as a chain of names and attributes only (``self._lock``), through
``objects.attr``: nothing the program defines is called.

Files are read once per request, without blocking (a FIFO named as a source file
is passed over) and capped; each function is parsed once per request.
"""

from __future__ import annotations

import ast
import os
import stat
import sys
import types
from collections.abc import Mapping
from typing import cast

from . import objects

MAX_FILE = 4 << 20  # bytes: a source file bigger than this is not read
MISSING = objects.MISSING
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_HAS_POSITIONS = sys.version_info >= (3, 11)


class Function:
    """One function's syntax tree, with its line numbers as in the file."""

    def __init__(self, node: ast.AST) -> None:
        self.node = node
        self.withs: list[ast.With | ast.AsyncWith] = []
        self.calls: list[ast.Call] = []
        self.awaits: list[ast.Await] = []
        self.guards: dict[int, ast.If | ast.While] = {}  # id of a call -> the if/while it is the test of
        self.finals: list[ast.Try] = []  # try statements with a finally
        for n in own_nodes(node):
            if isinstance(n, (ast.With, ast.AsyncWith)):
                self.withs.append(n)
            elif isinstance(n, ast.Call):
                self.calls.append(n)
            elif isinstance(n, ast.Await):
                self.awaits.append(n)
            elif isinstance(n, ast.Try) and n.finalbody:
                self.finals.append(n)
            if isinstance(n, (ast.If, ast.While)) and isinstance(n.test, ast.Call):
                self.guards[id(n.test)] = n
        # acquire() and release() calls, in source order: most functions have none
        self.locking = [c for c in self.calls if isinstance(c.func, ast.Attribute) and c.func.attr in ("acquire", "release")]


def own_nodes(root: ast.AST) -> list[ast.AST]:
    """Every node of a function's body, without the bodies of functions and classes nested in it."""
    out: list[ast.AST] = []
    todo = list(ast.iter_child_nodes(root))
    while todo:
        n = todo.pop()
        if isinstance(n, _SCOPES):
            continue
        out.append(n)
        todo.extend(ast.iter_child_nodes(n))
    out.sort(key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))
    return out


class Sources:
    """Source lines and parsed functions, each read or parsed once for one request."""

    def __init__(self) -> None:
        self._files: dict[str, list[str] | None] = {}
        self._functions: dict[types.CodeType, Function | None] = {}

    def lines(self, filename: str) -> list[str] | None:
        if filename in self._files:
            return self._files[filename]
        self._files[filename] = found = _read_lines(filename)
        return found

    def line(self, filename: str, lineno: int) -> str | None:
        lines = self.lines(filename)
        if lines is None or not 0 < lineno <= len(lines):
            return None
        return lines[lineno - 1]

    def function(self, code: types.CodeType) -> Function | None:
        if code in self._functions:
            return self._functions[code]
        try:
            found = self._parse(code)
        except Exception:  # noqa: BLE001 - source that does not parse is source we do not read
            found = None
        self._functions[code] = found
        return found

    def _parse(self, code: types.CodeType) -> Function | None:
        lines = self.lines(code.co_filename)
        if lines is None:
            return None
        if code.co_name == "<module>":
            return Function(ast.parse("".join(lines)))
        if code.co_name.startswith("<"):
            return None  # a lambda or a comprehension: no block of its own to hold anything in
        first = code.co_firstlineno
        last = max(first, _last_line(code))
        for extra in (0, 1, 2, 4, 8, 16, 32):
            end = min(len(lines), last + extra)
            chunk = lines[first - 1:end]
            if not chunk:
                return None
            indented = chunk[0][:1] in (" ", "\t")
            src = ("if 1:\n" if indented else "") + "".join(chunk)
            try:
                tree = ast.parse(src)
            except SyntaxError:
                if end >= len(lines):
                    return None
                continue
            ast.increment_lineno(tree, first - 1 - (1 if indented else 0))
            body = tree.body[0].body if indented and tree.body and isinstance(tree.body[0], ast.If) else tree.body
            for stmt in body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == code.co_name:
                    starts = [stmt.lineno] + [d.lineno for d in stmt.decorator_list]
                    if first in starts:
                        return Function(stmt)
            return None
        return None


def _read_lines(filename: str) -> list[str] | None:
    if not filename or filename.startswith("<"):
        return None
    try:
        fd = os.open(filename, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE:
            return None
        chunks = []
        total = 0
        while total <= MAX_FILE:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
            total += len(b)
        if total > MAX_FILE:
            return None
        return b"".join(chunks).decode("utf-8", "replace").splitlines(True)
    except OSError:
        return None
    finally:
        os.close(fd)


def _last_line(code: types.CodeType) -> int:
    """The last line a code object (and what is nested in it) was compiled from."""
    last = code.co_firstlineno
    todo = [code]
    seen = 0
    while todo and seen < 256:
        c = todo.pop()
        seen += 1
        positions = getattr(c, "co_positions", None)
        if positions is not None:
            for _, end, _, _ in positions():
                if end is not None and end > last:
                    last = end
        elif hasattr(c, "co_lines"):
            for _, _, line in c.co_lines():
                if line is not None and line > last:
                    last = line
        else:  # 3.9: the line number table as (byte, line) increments
            line = c.co_firstlineno
            tab = c.co_lnotab
            for i in range(1, len(tab), 2):
                d = tab[i]
                line += d - 256 if d >= 128 else d
                if line > last:
                    last = line
        todo.extend(k for k in c.co_consts if type(k) is types.CodeType)
    return last


def position(frame: types.FrameType) -> tuple[int, int, int, int] | None:
    """(line, end line, column, end column) of the expression a frame is in (3.11+), else None."""
    if not _HAS_POSITIONS:
        return None
    try:
        k = frame.f_lasti // 2
        for i, (line, end_line, col, end_col) in enumerate(frame.f_code.co_positions()):
            if i == k:
                if line is None or end_line is None or col is None or end_col is None:
                    return None
                return line, end_line, col, end_col
    except Exception:  # noqa: BLE001 - no position is known: the caller reads the whole line
        return None
    return None


def expr_text(node: ast.AST, limit: int = 200) -> str:
    try:
        s = ast.unparse(node)
    except Exception:  # noqa: BLE001 - an expression that does not unparse is shown as ?
        return "?"
    return s if len(s) <= limit else s[:limit] + "..."


def body_holds(node: ast.With | ast.AsyncWith | ast.If | ast.While, line: int) -> bool:
    """Whether ``line`` is inside the body of a with statement (not its header)."""
    body = node.body
    return bool(body) and body[0].lineno <= line <= (node.end_lineno or 0)


def in_header(node: ast.With | ast.AsyncWith, line: int) -> bool:
    body = node.body
    return bool(body) and node.lineno <= line < body[0].lineno


def open_acquires(fn: Function, line: int, unwound: bool = False) -> list[tuple[ast.AST, int]]:
    """``EXPR.acquire()`` calls before ``line`` with no ``EXPR.release()`` between them and it:
    (the expression, its line). An acquire tested by an ``if`` counts only inside that if's body.
    ``unwound``: an exception left the frame at ``line``, running the ``finally`` blocks around
    it: an acquire released in one of those is not held."""
    if not fn.locking:
        return []
    taken: dict[str, tuple[ast.AST, int]] = {}
    released: set[str] = set()
    if unwound:
        for n in fn.finals:
            if n.body[0].lineno <= line <= (n.body[-1].end_lineno or 0):
                for stmt in n.finalbody:
                    for c in ast.walk(stmt):
                        if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "release":
                            released.add(expr_text(c.func.value))
    for call in fn.locking:
        f = cast(ast.Attribute, call.func)  # locking holds only EXPR.acquire() and EXPR.release() calls
        if call.lineno > line:
            continue
        key = expr_text(f.value)
        if f.attr == "release":
            if call.lineno < line:
                taken.pop(key, None)
            continue
        if call.lineno >= line:
            continue
        guard = fn.guards.get(id(call))
        if guard is not None and not body_holds(guard, line):
            continue
        if key not in released:
            taken[key] = (f.value, call.lineno)
    return list(taken.values())


def calls_at(fn: Function, line: int, pos: tuple[int, int, int, int] | None) -> list[ast.Call]:
    """The calls on ``line``: the one at the frame's exact position first where it is known, then
    the rest, innermost (shortest) first."""
    here = [c for c in fn.calls if c.lineno <= line <= (c.end_lineno or c.lineno)]
    exact = [c for c in here if pos is not None and (c.lineno, c.end_lineno, c.col_offset, c.end_col_offset) == pos]
    rest = sorted((c for c in here if c not in exact),
                  key=lambda c: ((c.end_lineno or c.lineno) - c.lineno, (c.end_col_offset or 0) - c.col_offset))
    return exact + rest


class Scope:
    """A frame's names, looked up as Python would: locals, globals, builtins. Reading f_locals of
    a frame of another thread copies its fast locals into a dict; nothing runs."""

    def __init__(self, frame: types.FrameType | None, bound: dict[str, object] | None = None,
                 globals_: dict[str, object] | None = None) -> None:
        self.frame = frame
        self.bound = bound  # names given outright (a method's self)
        self.globals = globals_  # a function's globals, for code that has no frame (a thread that ended)
        self._locals: Mapping[str, object] | None = None

    def lookup(self, name: str) -> object:
        for space in (self.bound, self.globals):
            if type(space) is dict:
                v = space.get(name, MISSING)
                if v is not MISSING:
                    return v
        f = self.frame
        if f is None:
            return MISSING
        if self._locals is None:
            try:
                self._locals = f.f_locals
            except Exception:  # noqa: BLE001 - locals we cannot read: the globals and builtins still answer
                self._locals = {}
        for names in (self._locals, f.f_globals, f.f_builtins):
            try:
                v = names.get(name, MISSING)
            except Exception:  # noqa: BLE001 - a namespace we cannot read names nothing
                v = MISSING
            if v is not MISSING:
                return v
        return MISSING


def evaluate(node: ast.AST, scope: Scope, depth: int = 0) -> object:
    """The object an expression of names, attributes and plain subscripts (``self._lock``,
    ``mod.LOCK``, ``locks[i]``) names now, or MISSING. A subscript is read only from exactly a
    list, tuple or dict, with an int or str key: C lookups that run nothing of the program's."""
    if depth > 16:
        return MISSING
    if isinstance(node, ast.Name):
        return scope.lookup(node.id)
    if isinstance(node, ast.Attribute):
        base = evaluate(node.value, scope, depth + 1)
        return MISSING if base is MISSING else objects.attr(base, node.attr, MISSING)
    if isinstance(node, ast.Subscript):
        base = evaluate(node.value, scope, depth + 1)
        key = constant(node.slice, scope, depth + 1)
        if not (type(key) is int or type(key) is str):
            return MISSING
        try:
            if type(base) is dict:
                return base.get(key, MISSING)
            if type(base) is list or type(base) is tuple:
                return base[key] if type(key) is int else MISSING  # a str index: a TypeError
        except (IndexError, TypeError):
            return MISSING
        return MISSING
    return MISSING


def constant(node: ast.AST, scope: Scope, depth: int = 0) -> object:
    """A literal, what an expression of names and attributes names, or small arithmetic on numbers
    (``FIRST_DELAY_S * 2 ** attempt``): the seconds of a sleep, the descriptor of a read."""
    if depth > 16:
        return MISSING
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _small(constant(node.operand, scope, depth + 1))
        return -v if v is not None else MISSING
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        a, b = _small(constant(node.left, scope, depth + 1)), _small(constant(node.right, scope, depth + 1))
        if a is None or b is None:
            return MISSING
        if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 2 ** 32):
            return MISSING
        try:
            return _ARITHMETIC[type(node.op)](a, b)
        except (ArithmeticError, ValueError):
            return MISSING
    return evaluate(node, scope, depth + 1)


def _small(v: object) -> int | float | None:
    """``v`` where it is an int of at most 64 bits or a float (arithmetic on it costs nothing); else None."""
    if (type(v) is int and v.bit_length() <= 64) or type(v) is float:
        return v
    return None


_ARITHMETIC = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
               ast.Pow: lambda a, b: a ** b}
