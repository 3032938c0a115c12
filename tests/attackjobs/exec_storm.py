"""An attacker's own job (``hangwatchd run -- python3 exec_storm.py N SECONDS [GAP]``): N programs below it
(each a ``sleep``), which use up the exception FIFOs the daemon gives one user's programs below, then
for SECONDS a new program every GAP seconds (5 ms), each living half a second. Prints "started N", then
"stormed COUNT" once the storm is over, then beats on."""
import os
import subprocess
import sys
import time

import hangwatchd

n, seconds = int(sys.argv[1]), float(sys.argv[2])
gap = float(sys.argv[3]) if len(sys.argv) > 3 else 0.005
below = [subprocess.Popen(["sleep", "600"]) for _ in range(n)]
time.sleep(3)  # their FIFOs made first: the cap is reached
print(f"started {n}", flush=True)
count, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "0.5"])
    count += 1
    time.sleep(gap)
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    if count % 50 == 0:
        hangwatchd.beat()
print(f"stormed {count}", flush=True)
while True:
    hangwatchd.beat()
    time.sleep(0.2)
