"""A workload whose worker process (never registered: it does not beat) meets the fault."""
import subprocess
import sys
import time
from pathlib import Path

import hangwatchd

worker = subprocess.Popen([sys.executable, str(Path(__file__).with_name("worker.py"))])
while worker.poll() is None:
    hangwatchd.beat()
    time.sleep(0.05)
sys.exit(worker.returncode)
