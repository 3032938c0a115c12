"""One rank of a two-rank NCCL job for run_jobs.py; started by `hangwatchd run`, not torchrun.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python3 tests/gpu/jobs_rank.py --scenario uneven --steps 25

uneven: rank 1's shard is shorter: it finishes after all_reduce #STEPS and exits 0;
        rank 0 goes on into all_reduce #STEPS+1 and waits there for good.
killed: both train on; run_jobs.py SIGKILLs rank 1 from outside; rank 0 waits in all_reduce.
--fake: no torch, no GPU: all_reduce is a barrier of files in $JOBS_FAKE_DIR, the same
        beats, exits and waits (for checking run_jobs.py itself on a CPU machine).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import hangwatchd  # noqa: E402


def train(steps: int, fake: bool) -> None:
    rank = int(os.environ["RANK"])
    if fake:
        shared = os.environ["JOBS_FAKE_DIR"]  # the runner's: one file per rank and step, a barrier made of files

        def all_reduce(_t: object) -> None:
            open(os.path.join(shared, f"rank{rank}.step{step}"), "w").close()
            peer = os.path.join(shared, f"rank{1 - rank}.step{step}")
            while not os.path.exists(peer):  # a peer that is gone never comes
                time.sleep(0.01)
        x = None
    else:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("nccl")
        x = torch.ones(1 << 20, device="cuda")

        def all_reduce(t: object) -> None:
            dist.all_reduce(t)
            torch.cuda.synchronize()  # the host waits here for the collective rank 1 never joins
    mine = steps if rank == 1 and os.environ.get("JOBS_SCENARIO") == "uneven" else 10**9
    step = 0
    while step < mine:
        step += 1
        all_reduce(x)
        hangwatchd.beat()
        time.sleep(0.05)
        if step == 20:
            print(f"rank {rank} at step {step}", flush=True)
    print(f"rank {rank} finished its {mine} batches at {time.time():.3f}: exiting 0", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", choices=["uneven", "killed"], required=True)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--fake", action="store_true")
    a = p.parse_args()
    os.environ["JOBS_SCENARIO"] = a.scenario
    train(a.steps, a.fake)
    return 0


if __name__ == "__main__":
    sys.exit(main())
