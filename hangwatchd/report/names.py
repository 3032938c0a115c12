"""Long C++ names (templated PyTorch kernels run past 1,000 characters) made readable in text.

A name's long template arguments and parameter lists are folded to ``<…>`` and
``(…)``; what stays (``void at::native::index_elementwise_kernel<…>(…)``) is
enough to tell kernels apart on a terminal. JSON output keeps every name whole.
"""

from __future__ import annotations

FOLD_OVER = 60  # characters inside one <...> or (...) before it is folded
_CLOSE = {"<": ">", "(": ")"}


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``start``, or -1 when they do not balance."""
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in _CLOSE:
            stack.append(_CLOSE[c])
        elif c in ">)":
            if c == ">" and i > 0 and text[i - 1] == "-":  # '->' is no bracket
                continue
            if not stack or stack.pop() != c:
                return -1
            if not stack:
                return i
    return -1


def fold(text: str) -> str:
    """``text`` with every long C++ template or parameter list folded; prose is left alone."""
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c in _CLOSE:
            end = _matching(text, i)
            inner = text[i + 1:end] if end > 0 else ""
            if len(inner) > FOLD_OVER and ("::" in inner or "<" in inner):
                out.append(f"{c}…{text[end]}")
                i = end + 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


class Folder:
    """Folds names for one rendering and remembers each one it folded, to print once in full."""

    def __init__(self) -> None:
        self.folded: dict[str, str] = {}

    def name(self, full: str | None) -> str | None:
        if full is None:
            return None
        short = fold(full)
        if short != full:
            self.folded.setdefault(full, short)
        return short

    def in_full(self) -> list[str]:
        """The names folded above, each once (for the end of the text)."""
        if not self.folded:
            return []
        return ["", "Names shortened above, in full:"] + [f"  {full}" for full in self.folded]
