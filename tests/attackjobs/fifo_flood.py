"""An attacker's own job (``hangwatchd run -- python3 fifo_flood.py N R``): N programs started below
it (each a ``sleep``), which the daemon gives an exception FIFO each (MAX_BELOW_PER_UID of them), then R
more that it registers by hand as its own (a registration of one's own process is honoured): those get a
FIFO each past that cap. Each FIFO costs the daemon three descriptors (the read end, its own write end,
a pidfd). Beats meanwhile; prints "started N R" once all run."""
import json
import os
import subprocess
import sys
import time

import hangwatchd

n, r = int(sys.argv[1]), int(sys.argv[2])
below = [subprocess.Popen(["sleep", "600"]) for _ in range(n)]
time.sleep(3)  # their FIFOs made first: the cap on programs below is then reached
extra = [subprocess.Popen(["sleep", "600"]) for _ in range(r)]
regs = os.path.join(os.environ["HANGWATCHD_RUNTIME_DIR"], "registrations")
for p in extra:
    raw = open(f"/proc/{p.pid}/stat", "rb").read()
    start = int(raw[raw.rfind(b")") + 2:].split()[19])
    data = {"version": 1, "pid": p.pid, "start_time": start, "heartbeat_timeout": 600.0, "beat_file": None,
            "job": "flood", "cmdline": ["sleep"], "source": "run", "registered_at": time.time()}
    tmp = os.path.join(regs, f".flood-{p.pid}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(regs, f"{p.pid}-{start}.json"))
print(f"started {n} {r}", flush=True)
while True:
    hangwatchd.beat()
    time.sleep(0.2)
