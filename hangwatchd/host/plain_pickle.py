"""The one reader of pickles that users' processes wrote: plain data, in linear time, within caps.

PyTorch's flight recorder hands its trace over as a pickle, and the trace comes
from the watched workload: whoever runs the job chooses its bytes. Python's own
unpickler, even with every class refused, is not safe to run on them as root:
its memo is an array sized by the largest index a file names (9 bytes asked
for gigabytes), and what it builds may share itself (a list holding the same
list twice, 30 times over, is a few hundred bytes and 2**30 leaves to anyone
who walks it: ``str()`` of it held the daemon's GIL for minutes).

This reader runs the pickle machine for plain data alone (None, bools, ints,
floats, strings, bytes, lists, tuples, dicts, sets as lists) and refuses every
other opcode (classes, reductions, persistent ids, extensions). Each opcode
makes at most one new object, so the time and memory it takes are linear in
the input; the memo is a dict (an index costs its entry, never the span up to
it); dict keys are atoms only (hashing a shared tuple is itself exponential).
It never recurses. What it returns may still share sub-objects: a caller walks
it only with a budget (``bounded``).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

MAX_INPUT = 16 << 20  # bytes of pickle read at most (a flight-recorder trace is a few MB)
MAX_INT_BYTES = 64  # a LONG wider than this is refused (a trace holds sequence numbers and sizes)
_ATOM = (str, int, float, bool, bytes, type(None))


class NotPlainData(ValueError):
    """The bytes are not a plain-data pickle this reader accepts; the message says why, in one line."""


class _Mark:
    __slots__ = ()


_MARK = _Mark()


def loads(raw: bytes, max_input: int = MAX_INPUT) -> Any:
    """The plain data pickled in ``raw``; NotPlainData for anything else (never runs code, never recurses)."""
    if len(raw) > max_input:
        raise NotPlainData(f"{len(raw)} bytes, more than the {max_input} read")
    return _Machine(memoryview(raw)).run()


class _Machine:
    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0
        self.stack: list[Any] = []
        self.memo: dict[int, Any] = {}

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise NotPlainData(f"truncated at byte {self.pos} (wanted {n} more)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def line(self, longest: int = 64) -> bytes:
        end = bytes(self.data[self.pos:self.pos + longest]).find(b"\n")
        if end < 0:
            raise NotPlainData(f"a text argument at byte {self.pos} longer than {longest} bytes")
        out = bytes(self.data[self.pos:self.pos + end])
        self.pos += end + 1
        return out

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "little")

    def pop_mark(self) -> list[Any]:
        stack = self.stack
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is _MARK:
                items = stack[i + 1:]
                del stack[i:]
                return items
        raise NotPlainData("no MARK on the stack")

    def top(self, kind: type) -> Any:
        if not self.stack or not isinstance(self.stack[-1], kind):
            raise NotPlainData(f"expected a {kind.__name__} at byte {self.pos}")
        return self.stack[-1]

    def pop(self) -> Any:
        if not self.stack or self.stack[-1] is _MARK:
            raise NotPlainData(f"stack underflow at byte {self.pos}")
        return self.stack.pop()

    def run(self) -> Any:
        ops = _OPS
        while True:
            if self.pos >= len(self.data):
                raise NotPlainData("no STOP: truncated")
            code = self.data[self.pos]
            self.pos += 1
            if code == 0x2E:  # STOP
                return self.pop()
            op = ops.get(code)
            if op is None:
                raise NotPlainData(f"opcode {bytes([code])!r} at byte {self.pos - 1} is not plain data")
            op(self)


def _key(k: Any) -> Any:
    if not isinstance(k, _ATOM):
        raise NotPlainData(f"a dict key of type {type(k).__name__}: only atoms are accepted")
    return k


def _setitems(m: _Machine, items: list[Any]) -> None:
    if len(items) % 2:
        raise NotPlainData("SETITEMS with an odd number of items")
    d = m.top(dict)
    for i in range(0, len(items), 2):
        d[_key(items[i])] = items[i + 1]


def _put(m: _Machine, index: int) -> None:
    if not m.stack or m.stack[-1] is _MARK:
        raise NotPlainData("PUT with nothing to keep")
    m.memo[index] = m.stack[-1]


def _get(m: _Machine, index: int) -> None:
    try:
        m.stack.append(m.memo[index])
    except KeyError:
        raise NotPlainData(f"memo index {index} was never set") from None


def _long(raw: memoryview) -> int:
    if len(raw) > MAX_INT_BYTES:
        raise NotPlainData(f"an integer of {len(raw)} bytes")
    return int.from_bytes(raw, "little", signed=True)


def _text_int(m: _Machine) -> int:
    text = m.line().rstrip(b"L")
    if text in (b"00", b"01"):
        return int(text == b"01")  # protocol 0's booleans (a bool is the int 0 or 1)
    try:
        return int(text)
    except ValueError:
        raise NotPlainData(f"not an integer: {text[:20]!r}") from None


def _text_float(m: _Machine) -> float:
    try:
        return float(m.line())
    except ValueError:
        raise NotPlainData("not a float") from None


def _str(raw: memoryview) -> str:
    try:
        return str(raw, "utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise NotPlainData("a string that is not UTF-8") from None


def _ops() -> dict[int, Any]:
    S = struct.Struct

    def push(value_of: Any) -> Any:
        return lambda m: m.stack.append(value_of(m))

    def tuple_n(n: int) -> Any:
        def op(m: _Machine) -> None:
            if len(m.stack) < n or any(x is _MARK for x in m.stack[len(m.stack) - n:]):
                raise NotPlainData(f"TUPLE{n} with fewer than {n} items")
            items = tuple(m.stack[len(m.stack) - n:]) if n else ()
            del m.stack[len(m.stack) - n:]
            m.stack.append(items)
        return op

    def appends(m: _Machine) -> None:
        items = m.pop_mark()
        m.top(list).extend(items)

    def append(m: _Machine) -> None:
        item = m.pop()
        m.top(list).append(item)

    def setitem(m: _Machine) -> None:
        value = m.pop()
        key = m.pop()
        _setitems(m, [key, value])

    table: dict[bytes, Any] = {
        b"\x80": lambda m: m.take(1),  # PROTO
        b"\x95": lambda m: m.take(8),  # FRAME: a hint only
        b"(": lambda m: m.stack.append(_MARK),  # MARK
        b"0": lambda m: m.pop(),  # POP
        b"1": lambda m: m.pop_mark(),  # POP_MARK
        b"2": lambda m: m.stack.append(m.stack[-1] if m.stack and m.stack[-1] is not _MARK else m.pop()),  # DUP
        b"N": push(lambda m: None),
        b"\x88": push(lambda m: True),
        b"\x89": push(lambda m: False),
        b"J": push(lambda m: S("<i").unpack(m.take(4))[0]),  # BININT
        b"K": push(lambda m: m.uint(1)),  # BININT1
        b"M": push(lambda m: m.uint(2)),  # BININT2
        b"\x8a": push(lambda m: _long(m.take(m.uint(1)))),  # LONG1
        b"\x8b": push(lambda m: _long(m.take(m.uint(4)))),  # LONG4
        b"I": push(_text_int),  # INT (protocol 0)
        b"L": push(_text_int),  # LONG (protocol 0)
        b"G": push(lambda m: S(">d").unpack(m.take(8))[0]),  # BINFLOAT
        b"F": push(_text_float),  # FLOAT (protocol 0)
        b"V": push(lambda m: str(m.line(len(m.data)), "raw-unicode-escape")),  # UNICODE (protocol 0)
        b"\x8c": push(lambda m: _str(m.take(m.uint(1)))),  # SHORT_BINUNICODE
        b"X": push(lambda m: _str(m.take(m.uint(4)))),  # BINUNICODE
        b"\x8d": push(lambda m: _str(m.take(m.uint(8)))),  # BINUNICODE8
        b"U": push(lambda m: str(m.take(m.uint(1)), "latin-1")),  # SHORT_BINSTRING
        b"T": push(lambda m: str(m.take(S("<i").unpack(m.take(4))[0]), "latin-1")),  # BINSTRING
        b"C": push(lambda m: bytes(m.take(m.uint(1)))),  # SHORT_BINBYTES
        b"B": push(lambda m: bytes(m.take(m.uint(4)))),  # BINBYTES
        b"\x8e": push(lambda m: bytes(m.take(m.uint(8)))),  # BINBYTES8
        b"]": push(lambda m: []),  # EMPTY_LIST
        b"}": push(lambda m: {}),  # EMPTY_DICT
        b")": push(lambda m: ()),  # EMPTY_TUPLE
        b"\x8f": push(lambda m: []),  # EMPTY_SET, kept as a list (its items may not hash)
        b"l": lambda m: m.stack.append(m.pop_mark()),  # LIST
        b"t": lambda m: m.stack.append(tuple(m.pop_mark())),  # TUPLE
        b"\x91": lambda m: m.stack.append(m.pop_mark()),  # FROZENSET, as a list
        b"\x85": tuple_n(1),
        b"\x86": tuple_n(2),
        b"\x87": tuple_n(3),
        b"a": append,
        b"e": appends,
        b"\x90": appends,  # ADDITEMS: a set is a list here
        b"s": setitem,
        b"u": lambda m: _setitems(m, m.pop_mark()),  # SETITEMS
        b"d": lambda m: m.stack.append(_dict(m.pop_mark())),  # DICT
        b"q": lambda m: _put(m, m.uint(1)),  # BINPUT
        b"r": lambda m: _put(m, m.uint(4)),  # LONG_BINPUT
        b"\x94": lambda m: _put(m, len(m.memo)),  # MEMOIZE
        b"p": lambda m: _put(m, _text_int(m)),  # PUT
        b"h": lambda m: _get(m, m.uint(1)),  # BINGET
        b"j": lambda m: _get(m, m.uint(4)),  # LONG_BINGET
        b"g": lambda m: _get(m, _text_int(m)),  # GET
    }
    return {code[0]: op for code, op in table.items()}


def _dict(items: list[Any]) -> dict[Any, Any]:
    if len(items) % 2:
        raise NotPlainData("DICT with an odd number of items")
    return {_key(items[i]): items[i + 1] for i in range(0, len(items), 2)}


_OPS = _ops()


def bounded(value: Any, max_nodes: int = 10_000, max_depth: int = 8, max_str: int = 1000) -> Any:
    """A copy of decoded data that is a tree again: at most ``max_nodes`` values, ``max_depth``
    deep, strings cut at ``max_str``; what is past a bound is left out (lists end early, a
    container too deep becomes None). Iterative, so neither sharing nor depth costs more."""
    budget = [max_nodes]

    def atom(v: Any) -> Any:
        if isinstance(v, str):
            return v[:max_str]
        if isinstance(v, bytes):
            return v[:max_str].hex()
        return v if isinstance(v, (int, float, bool, type(None))) else None

    root: list[Any] = [None]
    work: list[tuple[Any, Any, Any, int]] = [(value, root, 0, 0)]  # (source, parent, key in parent, depth)
    while work:
        src, parent, key, depth = work.pop()
        if budget[0] <= 0:
            continue
        budget[0] -= 1
        if isinstance(src, (list, tuple)):
            if depth >= max_depth:
                parent[key] = None
                continue
            copy: list[Any] = [None] * min(len(src), budget[0])
            parent[key] = copy
            for i in range(len(copy) - 1, -1, -1):
                work.append((src[i], copy, i, depth + 1))
        elif isinstance(src, dict):
            if depth >= max_depth:
                parent[key] = None
                continue
            out: dict[Any, Any] = {}
            parent[key] = out
            for n, (k, v) in enumerate(src.items()):
                if n >= budget[0]:
                    break
                k = atom(k)
                out[k] = None
                work.append((v, out, k, depth + 1))
        else:
            parent[key] = atom(src)
    return root[0]


def iter_list(value: Any, limit: int) -> Iterator[Any]:
    """The first ``limit`` items of a list or tuple (nothing for anything else)."""
    if isinstance(value, (list, tuple)):
        yield from value[:limit]
