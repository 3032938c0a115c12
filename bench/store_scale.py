"""Many nodes polling one store: the request rate each node puts on it, the time from one
node's request to the last node noticing it, and a real daemon's memory with a store.

A bounded simulation on loopback against moto's S3 server: NODES pollers (the real
``fleet.Agent``, sharing one HTTP client to stay light) watch one job and poll at the
daemon's default interval; one of them declares the job hung. The figures for 1,000
nodes on a real store are in the README ("Many nodes", scale), worked out from these.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hangwatchd import log  # noqa: E402 - after sys.path is set
from hangwatchd.fleet import s3 as s3client  # noqa: E402 - after sys.path is set
from hangwatchd.fleet.agent import Agent  # noqa: E402 - after sys.path is set
from hangwatchd.testing import ScratchDaemon  # noqa: E402 - after sys.path is set
from tests.s3server import S3Server  # noqa: E402 - after sys.path is set

sys.path.insert(0, str(ROOT / "bench"))
from _figures import Figure, report  # noqa: E402 - after sys.path is set

TARGET_RATE = 1.0  # requests per second per node while nothing happens
TARGET_SPREAD = 5.0  # seconds from the request to the last node noticing it (interval 2 s)


def _seen_by(seen: dict[str, float], name: str, _request: object) -> None:
    """An agent's first capture request, by its node's name (what the bench times)."""
    seen.setdefault(name, time.monotonic())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=200)
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=20.0)
    args = p.parse_args()
    log.configure("console", "warning")
    with tempfile.TemporaryDirectory() as t, S3Server() as s3:
        import os

        os.environ.update(s3.env)
        shared = s3client.client()
        shared.meta.config.max_pool_connections = 64
        # The baseline: one node alone, polling the same way, before the crowd.
        alone = Agent(s3.url(), "node-alone", Path(t) / "node-alone", args.interval, 300.0, 100)
        alone._s3 = shared
        alone.jobs = frozenset({(1000, "big-job")})
        alone.start()
        time.sleep(args.seconds / 4)
        alone_rate = alone.polls / (args.seconds / 4)
        alone.stop()
        seen: dict[str, float] = {}
        agents = []
        for i in range(args.nodes):
            name = f"node-{i:04d}"
            a = Agent(s3.url(), name, Path(t) / name, args.interval, 300.0, 100,
                      post=functools.partial(_seen_by, seen, name))
            a._s3 = shared
            a.jobs = frozenset({(1000, "big-job")})
            agents.append(a)
        for a in agents:
            a.start()
        time.sleep(args.seconds / 2)
        idle_polls = sum(a.polls for a in agents)
        idle_rate = idle_polls / (args.seconds / 2) / args.nodes
        declared = time.monotonic()
        agents[0].declare("big-job", "heartbeat", "no beat for 300 s", uid=1000)
        end = declared + args.seconds / 2
        while time.monotonic() < end and len(seen) < args.nodes - 1:
            time.sleep(0.05)
        spread = max(seen.values()) - declared if seen else float("inf")
        median = statistics.median(v - declared for v in seen.values()) if seen else float("inf")
        noticed = len(seen)
        for a in agents:
            threading.Thread(target=a.stop, daemon=True).start()
        # A real daemon with a store configured, watching nothing: its memory; and one without a store.
        with ScratchDaemon(Path(t) / "one", "--store", s3.url(), env=s3.env, config={"store_poll_interval": args.interval}) as d:
            time.sleep(3)
            rss = psutil.Process(d.proc.pid).memory_info().rss / 2**20
        with ScratchDaemon(Path(t) / "plain") as d:
            time.sleep(3)
            plain_rss = psutil.Process(d.proc.pid).memory_info().rss / 2**20
    report("store_scale", [
        Figure(f"request rate per node, {args.nodes} nodes polling one job every {args.interval:g} s, nothing happening",
               f"{idle_rate:.2f} requests/s (the store saw {idle_rate * args.nodes:.0f}/s)",
               f"one node polling alone: {alone_rate:.2f} requests/s", f"<= {TARGET_RATE:g}/s",
               idle_rate <= TARGET_RATE),
        Figure("one node declares the job hung, to the last other node noticing its request",
               f"{spread:.2f} s ({noticed}/{args.nodes - 1} nodes)", f"the median node: {median:.2f} s",
               f"within {TARGET_SPREAD:g} s", spread <= TARGET_SPREAD and noticed == args.nodes - 1),
        Figure("memory of a daemon with a store configured, watching nothing", f"{rss:.0f} MB RSS",
               f"a daemon without a store: {plain_rss:.0f} MB RSS", "< 80 MB",
               rss < 80),
    ], note="moto's S3 server on loopback; the pollers are the real fleet.Agent sharing one HTTP client")

if __name__ == "__main__":
    main()
