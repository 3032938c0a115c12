"""A lost wake-up: ``announce_ready`` (thread announcer) calls ``notify()`` on a Condition
before the main thread has started to wait on it, then exits. A notify with no waiter does
nothing; ``wait_until_ready`` then waits with no predicate and no timeout, for a notify that
has already happened and will never come again.

Reports: chenshuo/muduo#412 (notify can run before wait: "wait() would never return");
open-education-hub/operating-systems#150 (a notification sent while no thread waits is lost,
in Python's Condition too).
"""

import threading
import time

CASE = {
    "title": "Condition.wait after the only notify (lost wake-up)",
    "source": "chenshuo/muduo#412; open-education-hub/operating-systems#150 (notify before wait is lost)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["announce_ready", "announcer", "wait_until_ready"],
    "cause": r"nobody|never (be )?notif|lost|already (notified|exited)|exited",
    "hangs_after": 1,
}

ready = threading.Condition()


def announce_ready() -> None:
    with ready:
        ready.notify_all()  # nobody waits yet: this wake-up is lost


def wait_until_ready() -> None:
    with ready:
        ready.wait()  # no predicate, no timeout


def main() -> None:
    threading.Thread(target=announce_ready, name="announcer").start()
    time.sleep(0.5)  # set-up work; by now the announcer has notified and exited
    wait_until_ready()


if __name__ == "__main__":
    main()
