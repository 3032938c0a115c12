"""A synchronous job for the pace tests: RANK of WORLD_SIZE ranks meet every step.

Each step: a batch from an input pipeline run by a worker process, some compute, some
"device" time (a sleep, where a GPU would work), the step's collective, a beat. The ranks meet
in gloo's all_reduce through PyTorch (``PACE_BACKEND=gloo``), or in a TCP barrier of our own
(``barrier``, no PyTorch needed). The input pipeline is PyTorch's DataLoader with one worker
(gloo), or a multiprocessing worker filling a queue (barrier).

``PACE_CONTROL`` names a JSON file, read when it changes, that makes ranks slower:
``{"compute": {"2": 0.025}}`` gives rank 2 that many seconds more compute a step (in
``extra_compute``); ``{"starve": {"1": 0.14}}`` makes rank 1's input worker take that long
for each batch (it sleeps: a slow source, the worker blocked); ``{"hang": {"3": 1}}`` makes
rank 3 stop for good before its collective (its mates then wait in it). ``PACE_NOISE`` makes
every step's device time noisy, on every rank alike (bench/slow_noise.py).
"""

import json
import os
import random
import socket
import sys
import threading
import time

import hangwatchd

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
BACKEND = os.environ.get("PACE_BACKEND", "barrier")
CONTROL = os.environ["PACE_CONTROL"]
COMPUTE_S = float(os.environ.get("PACE_COMPUTE_S", "0.02"))
DEVICE_S = float(os.environ.get("PACE_DEVICE_S", "0.08"))
NOISE = float(os.environ.get("PACE_NOISE", "0"))  # each step's device time drawn from DEVICE_S times [1 - NOISE, 1 + NOISE]


class Control:
    """The control file, read again only when its mtime changes (one stat a step)."""

    def __init__(self, path):
        self.path, self.mtime, self.data = path, None, {}

    def get(self, what, default=0.0):
        try:
            mtime = os.stat(self.path).st_mtime_ns
            if mtime != self.mtime:
                with open(self.path) as f:
                    self.data = json.load(f)
                self.mtime = mtime
        except (OSError, ValueError):
            pass
        return float((self.data.get(what) or {}).get(str(RANK), default))


def die_with_parent(*_):
    """A worker ends with the rank that started it, however the rank ends (SIGKILL too)."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(0)


# -- the input pipeline -------------------------------------------------------------------

def torch_loader():
    import torch.utils.data as data

    class Batches(data.IterableDataset):
        def __iter__(self):
            control = Control(CONTROL)
            i = 0
            while True:
                delay = control.get("starve")
                if delay:
                    time.sleep(delay)
                yield i
                i += 1

    return iter(data.DataLoader(Batches(), batch_size=None, num_workers=1, prefetch_factor=2,
                                worker_init_fn=die_with_parent))


def _feed(queue):
    die_with_parent()
    control = Control(CONTROL)
    i = 0
    while True:
        delay = control.get("starve")
        if delay:
            time.sleep(delay)
        queue.put(i)
        i += 1


def mp_loader():
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue(maxsize=2)
    worker = ctx.Process(target=_feed, args=(queue,), daemon=True)
    worker.start()

    def batches():
        while True:
            yield queue.get()

    return batches()


# -- meeting the other ranks ----------------------------------------------------------------

class Barrier:
    """Every rank sends one byte to rank 0 each step; rank 0 answers all once every one has come."""

    def __init__(self):
        addr = (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]))
        if RANK == 0:
            server = socket.create_server(addr, backlog=WORLD)
            self.peers = [server.accept()[0] for _ in range(WORLD - 1)]
            server.close()
        else:
            for _ in range(600):
                try:
                    self.peer = socket.create_connection(addr)
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                sys.exit(f"rank {RANK}: rank 0 never listened at {addr}")

    def barrier(self):
        if RANK == 0:
            for p in self.peers:
                if p.recv(1) != b"x":
                    sys.exit("a rank left")
            for p in self.peers:
                p.sendall(b"g")
        else:
            self.peer.sendall(b"x")
            if self.peer.recv(1) != b"g":
                sys.exit("rank 0 left")


def meeting():
    if BACKEND == "gloo":
        import datetime

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=1))
        one = torch.ones(1)

        def all_reduce():
            dist.all_reduce(one)

        return all_reduce
    return Barrier().barrier


# -- the step -------------------------------------------------------------------------------

def compute(seconds):
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += sum(range(200))
    return x


def extra_compute(seconds):
    """The slower rank's own work: more of it each step."""
    return compute(seconds)


def device_work(noise=random.Random()):
    time.sleep(DEVICE_S * (1 + noise.uniform(-NOISE, NOISE)))  # where a GPU would run the step's kernels


class Gpu:
    """``PACE_DEVICE=cuda``: the step's device work is real kernels on the rank's GPU (the ranks may
    share one), PACE_MATMULS matrix products and a synchronize; ``{"kernels": {"2": 8}}`` gives
    rank 2 that many more products each step (tests/gpu/run_slow.py)."""

    def __init__(self):
        import torch

        self.torch = torch
        self.device = torch.device("cuda", RANK % torch.cuda.device_count())
        self.x = torch.randn(int(os.environ.get("PACE_MATRIX", "4096")), int(os.environ.get("PACE_MATRIX", "4096")),
                             device=self.device)
        self.n = int(os.environ.get("PACE_MATMULS", "16"))

    def work(self, extra):
        y = self.x
        for _ in range(self.n + int(extra)):
            y = self.x @ self.x
        self.synchronize(y)

    def synchronize(self, y):
        self.torch.cuda.synchronize(self.device)
        return y


def main():
    meet = meeting()
    batches = torch_loader() if BACKEND == "gloo" else mp_loader()
    control = Control(CONTROL)
    gpu = Gpu() if os.environ.get("PACE_DEVICE") == "cuda" else None
    print(f"rank {RANK} stepping", flush=True)
    while True:
        next(batches)
        compute(COMPUTE_S)
        more = control.get("compute")
        if more:
            extra_compute(more)
        if gpu is not None:
            gpu.work(control.get("kernels"))
        else:
            device_work()
        if control.get("hang"):
            threading.Event().wait()
        meet()
        hangwatchd.beat()


if __name__ == "__main__":
    main()
