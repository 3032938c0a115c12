"""What listening for process exits costs the daemon under a fork storm: the CPU of a process that
runs the listener (``host/proc_exits.py``) while another starts and ends about 1,000 processes a
second (``posix_spawn`` of /bin/true: a fork, an exec and an exit each), against the same process
with the listener off under the same storm, both measured over the same seconds.

Target: under 5 % of one core per 1,000 process starts and exits a second (the figure is scaled
to that rate from the rate reached). Needs root (the kernel's process events).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _figures import Figure, Spread, judged, report

RATE = 1000  # processes started (and ended) a second
SECONDS = 5.0
REPEATS = 3
TARGET = 5.0  # % of one core per 1,000 starts+exits a second


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def listener(on: bool) -> None:
    """One side: subscribe (or not), say ready, and at 'go' measure this process's CPU for SECONDS."""
    from hangwatchd.host.proc_exits import ProcExits

    pe = ProcExits(listen=on)
    started = pe.start()
    print("ready", started, flush=True)
    sys.stdin.readline()
    c0, t0, e0 = cpu(), time.monotonic(), pe.events
    time.sleep(SECONDS)
    c1, t1, e1 = cpu(), time.monotonic(), pe.events
    print(json.dumps({"cpu": c1 - c0, "wall": t1 - t0, "events": e1 - e0, "lost": pe.lost, "exits": len(pe)}), flush=True)
    pe.stop()


def storm(rate: int) -> None:
    """Start ``rate`` processes a second (each /bin/true) until stdin closes; print how many."""
    os.set_blocking(0, False)
    true = "/bin/true"
    n, t0 = 0, time.monotonic()
    alive = 0
    while True:
        try:
            if os.read(0, 1) == b"":
                break
        except BlockingIOError:
            pass
        due = t0 + n / rate
        now = time.monotonic()
        if now < due:
            time.sleep(min(due - now, 0.002))
            continue
        os.posix_spawn(true, [true], {})
        n += 1
        alive += 1
        while alive:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                alive = 0
                break
            if pid == 0:
                break
            alive -= 1
    elapsed = time.monotonic() - t0
    while alive:
        os.waitpid(-1, 0)
        alive -= 1
    print(json.dumps({"started": n, "seconds": elapsed}), flush=True)


def side(on: bool) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, __file__, "--listener", "on" if on else "off"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline().split()
    assert line[:1] == ["ready"], line
    if on and line[1] != "True":
        raise SystemExit("proc_exits bench: the listener is off here (needs root on the host)")
    return p


def once() -> tuple[float, float, float, dict[str, int]]:
    """(listener % of a core, baseline % of a core, starts+exits a second reached, the listener's counts)."""
    on, off = side(True), side(False)
    gen = subprocess.Popen([sys.executable, __file__, "--storm", str(RATE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)  # the storm at its pace
    for p in (on, off):
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in (on, off):
        assert p.stdout is not None
        results.append(json.loads(p.stdout.readline()))
        p.wait()
    out, _ = gen.communicate("")  # stdin closed: the storm ends
    made = json.loads(out)
    rate = made["started"] / made["seconds"]
    a, b = results
    return 100 * a["cpu"] / a["wall"], 100 * b["cpu"] / b["wall"], rate, {"events": a["events"], "lost": a["lost"]}


def main() -> None:
    if os.geteuid() != 0:
        raise SystemExit("proc_exits bench: needs root (the kernel's process events)")
    runs = [once() for _ in range(REPEATS)]
    scaled = Spread(tuple(on * 1000 / rate for on, _, rate, _ in runs))
    raw = Spread(tuple(on for on, _, _, _ in runs))
    base = Spread(tuple(off for _, off, _, _ in runs))
    rates = Spread(tuple(rate for _, _, rate, _ in runs))
    events = sum(c["events"] for _, _, _, c in runs)
    lost = sum(c["lost"] for _, _, _, c in runs)
    ok, noisy = judged(scaled.median, scaled.spread, TARGET)
    report("proc_exits", [
        Figure("listener CPU per 1,000 process starts+exits a second",
               f"{scaled.median:.2f} % of a core (median of {len(runs)}; {scaled.text('%', 2)})",
               f"the same process without the listener, same storm: {base.median:.2f} % of a core",
               f"under {TARGET:g} % of a core", ok, noisy),
        Figure("listener CPU at the rate reached", f"{raw.median:.2f} % of a core at {rates.median:.0f} starts+exits/s "
               f"({events} events read, {lost} overflows)", f"{base.median:.2f} % of a core", "", None),
    ], note=f"{REPEATS} runs of {SECONDS:g} s; the storm: posix_spawn of /bin/true at up to {RATE}/s; "
            "each side a process of its own, measured over the same seconds")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--listener"]:
        listener(sys.argv[2] == "on")
    elif sys.argv[1:2] == ["--storm"]:
        storm(int(sys.argv[2]))
    else:
        main()
