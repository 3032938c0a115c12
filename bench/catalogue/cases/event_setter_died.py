"""An Event nobody will set: the only thread that sets ``ready`` (thread warmup) dies of an
exception in ``compile_kernels`` before it gets there; the main thread waits on the event
without a timeout.

Report: nuls-io/nuls-v2#457 ("Prevents the notify thread from terminating unexpectedly,
causing the waiting thread to wait forever").
"""

import threading

CASE = {
    "title": "Event never set: its setter thread died",
    "source": "nuls-io/nuls-v2#457 (the notifying thread ends early; the waiter waits forever)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["warmup", "run_warmup", "compile_kernels"],
    "cause": r"exited|died|raised|exception|is gone|never set|nobody",
    "hangs_after": 0.5,
}

ready = threading.Event()


def compile_kernels() -> None:
    raise RuntimeError("no kernel for sm_100 in this build")


def run_warmup() -> None:
    compile_kernels()
    ready.set()  # never reached


def main() -> None:
    threading.Thread(target=run_warmup, name="warmup").start()
    ready.wait()


if __name__ == "__main__":
    main()
