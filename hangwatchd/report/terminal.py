"""Text from users, dumps and the network made safe to print on a terminal.

Job names, ``STATUS=`` lines, cmdlines, kernel and symbol names, RAS replies
and store records are written by someone else. Printed raw, an escape sequence
in one of them (ESC ``[2J``, an OSC 8 link, a title change, ``\\r`` over a line)
acts on the reader's terminal, and a newline forges a row. Every control
character (C0, DEL, C1) and every bidirectional override is shown as ``\\xNN``
(``\\uNNNN`` above 0xFF); other text is left as it is. HTML pages escape for
HTML instead (``report/html.py``); ``--json`` output is JSON-escaped already.
"""

from __future__ import annotations

import re
from typing import Any

# C0 controls, DEL, C1 controls, and the bidi embeddings, overrides and isolates.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c]")


def _show(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c <= 0xFF else f"\\u{c:04x}"


def escape(text: str) -> str:
    """``text`` with every control character shown as an escape; a newline too (it would forge a line)."""
    return _CONTROL.sub(_show, text)


def escape_lines(text: str) -> str:
    """A rendered text whose line breaks are its own: each line escaped, the breaks kept."""
    return "\n".join(escape(line) for line in text.split("\n"))


def clean(value: Any) -> Any:
    """A copy of ``value`` (JSON-like: dicts, lists, strings, numbers) with every string escaped,
    keys too: what a text renderer formats from it cannot reach the terminal raw."""
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {clean(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value
