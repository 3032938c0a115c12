"""Reading a stuck program's objects without running a line of its code.

The reporter runs while the program is hung, often because some thread holds a
lock. ``getattr`` can run a property, ``__getattr__`` or ``__getattribute__``;
``isinstance`` can run a ``__class__`` property (proxies define one); ``repr``
and ``str`` run whatever the class says. Any of those may take the very lock the
program is stuck on, and the reporter would hang with it. So attributes are
looked up the way ``inspect.getattr_static`` does, by hand: the instance's own
``__dict__`` (through the C descriptor every class gets), slots, and C getters of
the standard library's own types; a property or anything else is "unknown".
Types are compared by identity along the MRO, never with ``isinstance``.
"""

from __future__ import annotations

import math
import types

MISSING = object()

_mro_of = type.__dict__["__mro__"].__get__
_dict_of_type = type.__dict__["__dict__"].__get__
_module_of_type = type.__dict__["__module__"].__get__
_GETSET = types.GetSetDescriptorType
_MEMBER = types.MemberDescriptorType
# C getters of these modules' types run no user code (a Cython property is a getset too: not trusted).
_TRUSTED_MODULES = frozenset({"builtins", "_thread", "_asyncio", "_queue", "_socket", "socket", "_io", "io",
                              "_collections", "collections", "_multiprocessing", "select", "_ssl", "posix",
                              "_weakref", "weakref", "_functools", "functools", "_contextvars"})


def mro(obj: object) -> tuple[type, ...]:
    try:
        return _mro_of(type(obj))
    except Exception:  # noqa: BLE001 - never raise into the reporter
        return ()


def is_a(obj: object, cls: object) -> bool:
    """isinstance, without asking the object (no ``__class__``, no ``__instancecheck__``)."""
    if cls is None:
        return False
    for k in mro(obj):
        if k is cls:
            return True
    return False


def type_name(obj: object) -> str:
    tp = type(obj)
    try:
        return f"{_module_of_type(tp)}.{type.__dict__['__qualname__'].__get__(tp)}"
    except Exception:  # noqa: BLE001 - never raise into the reporter
        return "?"


def _class_attr(klasses: tuple[type, ...], name: str) -> object:
    for k in klasses:
        try:
            d = _dict_of_type(k)
        except Exception:  # noqa: BLE001 - never raise into the reporter: a class we cannot read has no attribute for us
            continue
        v = d.get(name, MISSING)
        if v is not MISSING:
            return v
    return MISSING


def _is_data_descriptor(v: object) -> bool:
    k = mro(v)
    return _class_attr(k, "__set__") is not MISSING or _class_attr(k, "__delete__") is not MISSING


def _trusted_getter(v: object) -> types.MemberDescriptorType | types.GetSetDescriptorType | None:
    """``v`` itself where reading through it runs no code of the program's; None otherwise."""
    if type(v) is _MEMBER:
        return v  # a slot: a read of memory
    if type(v) is _GETSET:
        try:
            return v if _module_of_type(v.__objclass__) in _TRUSTED_MODULES else None
        except Exception:  # noqa: BLE001 - never raise into the reporter
            return None
    return None


def instance_dict(obj: object) -> dict[str, object] | None:
    """The instance's ``__dict__`` through the getter the class machinery made, or None."""
    d = _class_attr(mro(obj), "__dict__")
    if type(d) is _GETSET or type(d) is _MEMBER:  # modules keep theirs in a member
        try:
            got = d.__get__(obj, type(obj))
        except Exception:  # noqa: BLE001 - never raise into the reporter
            return None
        return got if type(got) is dict else None
    return None


def attr(obj: object, name: str, default: object = None) -> object:
    """``obj.name`` where that runs no code of the program's; ``default`` otherwise (or when absent)."""
    klasses = mro(obj)
    found = _class_attr(klasses, name)
    if found is not MISSING and _is_data_descriptor(found):
        getter = _trusted_getter(found)
        if getter is not None:
            try:
                return getter.__get__(obj, type(obj))
            except Exception:  # noqa: BLE001 - never raise into the reporter: what a getter cannot read is the default
                return default
        return default  # a property, or someone's descriptor: not ours to run
    d = instance_dict(obj)
    if d is not None:
        try:
            v = d.get(name, MISSING)
        except Exception:  # noqa: BLE001 - never raise into the reporter
            v = MISSING
        if v is not MISSING:
            return v
    if found is MISSING:
        return default
    getter = _trusted_getter(found)
    if getter is not None:
        try:
            return getter.__get__(obj, type(obj))
        except Exception:  # noqa: BLE001 - never raise into the reporter: what a getter cannot read is the default
            return default
    if _class_attr(mro(found), "__get__") is not MISSING:
        return default  # a method or other descriptor: never bound, never called
    return found  # a plain class attribute (a lock shared by every instance)


def text(value: object, limit: int = 200) -> str | None:
    """A string the program made, cut; None for anything that is not exactly a str."""
    if type(value) is not str:
        return None
    return value if len(value) <= limit else value[:limit] + "..."


def number(value: object) -> int | float | None:
    """An int or a finite float (JSON has no inf), else None."""
    if type(value) is int or (type(value) is float and math.isfinite(value)):
        return value
    return None


def hex_id(obj: object) -> str:
    return hex(id(obj))


def code_of(fn: object) -> types.CodeType | None:
    """The code a callable runs: a function, a bound method, a functools.partial, a class's __call__."""
    for _ in range(4):
        if type(fn) is types.FunctionType:
            return fn.__code__
        if type(fn) is types.MethodType:
            fn = fn.__func__
            continue
        part = _class_attr(mro(fn), "func")
        if part is not MISSING and _trusted_getter(part) is not None:  # functools.partial (C)
            fn = attr(fn, "func")
            continue
        call = _class_attr(mro(fn), "__call__")
        if type(call) is types.FunctionType:
            return call.__code__
        return None
    return None


def qualname(code: types.CodeType | None, fn: object = None) -> str | None:
    name = getattr(code, "co_qualname", None)  # 3.11+
    if name is None and type(fn) is types.FunctionType:
        name = fn.__qualname__
    if name is None and code is not None:
        name = code.co_name
    return text(name)


def callable_name(fn: object) -> str | None:
    """The qualified name of a callable: of its code, or of a C function (``Task.task_wakeup``)."""
    code = code_of(fn)
    if code is not None:
        return qualname(code, fn.__func__ if type(fn) is types.MethodType else fn)
    if (type(fn) is types.BuiltinFunctionType or type(fn) is types.MethodWrapperType
            or type(fn) is types.WrapperDescriptorType or type(fn) is types.MethodDescriptorType):
        return text(fn.__qualname__)
    return type_name(fn) if fn is not None else None


def closure_values(fn: object) -> list[object]:
    """What a Python function's closure cells hold (reading a cell runs nothing)."""
    if type(fn) is types.MethodType:
        fn = fn.__func__
    if type(fn) is not types.FunctionType or fn.__closure__ is None:
        return []
    out = []
    for cell in fn.__closure__:
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return out


def callable_info(fn: object) -> dict[str, object] | None:
    """{qualname, file, line, names} of the code a callable runs (names: the globals and attributes it uses)."""
    code = code_of(fn)
    if code is None:
        return {"qualname": type_name(fn), "file": None, "line": None, "names": []} if fn is not None else None
    if type(fn) is types.MethodType:
        fn = fn.__func__
    return {"qualname": qualname(code, fn), "file": text(code.co_filename, 400), "line": code.co_firstlineno,
            "names": names_of(code)}


def names_of(code: types.CodeType, limit: int = 200) -> list[str]:
    """The global and attribute names a code object and the functions nested in it use."""
    out: list[str] = []
    todo = [code]
    seen = 0
    while todo and len(out) < limit and seen < 64:
        c = todo.pop()
        seen += 1
        for n in c.co_names:
            if n not in out:
                out.append(n)
        todo.extend(k for k in c.co_consts if type(k) is types.CodeType)
    return out[:limit]
