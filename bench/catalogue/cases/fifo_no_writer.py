"""Opening a FIFO for reading blocks until a writer opens it: ``open_feature_stream`` opens
the named pipe the feature extractor was supposed to create and write to, but the extractor
was never started. The process waits in ``open()``, forever.

Reports: beave/sagan#16 ("FIFO opened before fork hangs init scripts": opening a FIFO is
blocking if no writer is connected); odeke-em/drive#208 (reading a named pipe with no writer
hangs forever).
"""

import os
import tempfile

CASE = {
    "title": "open() of a FIFO that nobody opens for writing",
    "source": "beave/sagan#16; odeke-em/drive#208 (open/read of a FIFO with no writer)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["open_feature_stream"],
    "cause": r"FIFO|no writer|nobody (opens|writes)|never opened",
    "hangs_after": 0.5,
}


def open_feature_stream(path: str) -> bytes:
    with open(path, "rb") as f:  # blocks here: no writer has the FIFO open
        return f.read()


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "features.fifo")
        os.mkfifo(path)
        open_feature_stream(path)


if __name__ == "__main__":
    main()
