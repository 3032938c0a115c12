"""Scoring a verdict against a case's expectation.

The first sentence of a verdict is what a person reads first, so it must carry the root
cause. The rule that cuts it, chosen to survive the shapes verdicts take in this project
("pid 5314: deadlock between ...", "Rank 1 never entered all_gather #3 ...: rank 1 is at
...", "Rank 1 exited with status 0 at 10:53:20 UTC, 4.5 s before ...", file names like
"train.py:15" and numbers like "3.9 s"):

1. Whitespace runs (newlines included) count as one space.
2. A leading label, ``pid N:``, ``rank N:`` or ``rank N (pid M):`` (optionally ``on NODE``),
   belongs to the first sentence: its colon ends nothing.
3. After it, the first sentence ends at the first ``.``, ``!`` or ``?`` followed by whitespace
   and then an upper-case letter, an opening bracket or a quote (a new sentence), or at
   the first ``: `` followed by an upper-case letter (a new account, as in ``Here: Rank 0: ...``);
   a colon or period followed by lower case continues the sentence ("...ncclGroupEnd: look at that
   rank first", "e.g. a dead peer"). Otherwise the whole verdict is one sentence.

A culprit is named when it occurs as a whole word (not inside a longer name: ``t1`` is not in
``t10``), case-insensitively, so "rank 1" matches "Rank 1".

File names and paths are masked before either is looked for: a verdict that only points at
``.../rank_sleeps_before_collective.py:32`` has not said "sleep", and one that names
``queue_producer_died.py`` has not said "died".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RIGHT, HALF, WRONG, MISSED, FALSE_ALARM, SKIPPED = "RIGHT", "HALF", "WRONG", "MISSED", "FALSE ALARM", "SKIPPED"

_LABEL = re.compile(r"^(?:pid \d+|rank \d+(?: \(pid \d+\))?)(?: on \S+)?: ", re.I)
_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(\[])|:\s+(?=[A-Z])")


def first_sentence(verdict: str) -> str:
    text = " ".join(verdict.split())
    label = _LABEL.match(text)
    start = label.end() if label else 0
    end = _END.search(text, start)
    return text[: end.start()].rstrip(":").strip() if end else text


_PATH = re.compile(r"(?:/[^\s():,;]+|[\w.-]+\.(?:py|so|c|cu|cc|cpp|h))(?::\d+)?")


def masked(text: str) -> str:
    """The text with every path and file name (and its line number) replaced by ``<file>``."""
    return _PATH.sub("<file>", text)


def names(text: str, name: str) -> bool:
    """Whether ``name`` occurs in ``text`` as a whole word, ignoring case."""
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text, re.I) is not None


@dataclass(frozen=True)
class Score:
    result: str
    first: str  # the verdict's first sentence ("" without a verdict)
    culprit_first: bool  # a culprit is named in the first sentence
    cause_first: bool  # the cause regex matches the first sentence


def score(verdict: str | None, culprit: tuple[str, ...], cause: str, healthy: bool) -> Score:
    """RIGHT, HALF, WRONG or MISSED for a hang (FALSE ALARM or RIGHT for a healthy case)."""
    if healthy:
        return Score(RIGHT if verdict is None else FALSE_ALARM, first_sentence(verdict or ""), False, False)
    if verdict is None:
        return Score(MISSED, "", False, False)
    first = first_sentence(verdict)
    c = any(names(masked(first), n) for n in culprit)
    k = re.search(cause, masked(first), re.I) is not None
    if c and k:
        result = RIGHT
    elif c or k or any(names(masked(verdict), n) for n in culprit):
        result = HALF  # half the story up front, or the root named only further on
    else:
        result = WRONG
    return Score(result, first, c, k)
