"""A program that waits for a subprocess (cat) reading a FIFO nobody writes.

    python waits_on_cat.py FIFO
"""

import subprocess
import sys


def export_shard(path: str) -> None:
    print("READY", flush=True)
    subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=False)


if __name__ == "__main__":
    export_shard(sys.argv[1])
