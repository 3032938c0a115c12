"""Healthy look-alike: a long compile phase, as when a framework compiles or imports a large
graph before the first step: ``compile_graph`` compiles generated Python source for 40 s in one
long C call after another. The Python stack hardly changes; the CPU is busy all along.

Report: pytorch/pytorch#165832 (a long first phase before training, mistaken for a stuck
worker; "DataLoader timeout for child Process").
"""

import time

CASE = {
    "title": "long compile / import-like CPU phase (40 s)",
    "source": "pytorch/pytorch#165832 (a long CPU phase before the first step)",
    "healthy": True,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": [],
    "cause": r"",
    "hangs_after": 0.5,
    "observe": 25,
}

COMPILE_S = 40.0


def generated_source(n: int) -> str:
    return "\n".join(f"def f{i}(x):\n    return (x * {i} + {n}) % 97" for i in range(3000))


def compile_graph() -> int:
    compiled = 0
    end = time.monotonic() + COMPILE_S
    while time.monotonic() < end:
        compile(generated_source(compiled), f"<graph {compiled}>", "exec")
        compiled += 1
    return compiled


if __name__ == "__main__":
    compile_graph()
