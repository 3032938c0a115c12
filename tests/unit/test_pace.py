"""A job's pace, in this process with a stub clock: real beat segments written here, the pace
machine's looks at them, its samples handed in as the sampler would post them, and the verdict
on records put together by hand, as the nodes write them."""

from __future__ import annotations

import json
import os
import random
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from hangwatchd.analyze import slow
from hangwatchd.analyze.verdict import analyze
from hangwatchd.config import Config
from hangwatchd.detect import pace
from hangwatchd.detect.pace_machine import DeclareSlow, PaceMachine
from hangwatchd.detect.sampler import PaceSampled
from hangwatchd.host import untrusted
from hangwatchd.metrics import create
from hangwatchd.model import GpuPace, JobPace, ProcessId, RankPace, Registration, State, pace_from_dict, pace_to_dict
from hangwatchd.watch.pace import SLOW, SLOWER, STEADY, Paces
from hangwatchd.watch.stack_history import Sample
from hangwatchd.watch.watched import Watched
from hangwatchd.workload import beat_segment

# -- what a rank's main thread is doing, from a plain py-spy dump ---------------------------------

SITE = "/venv/lib/python3.11/site-packages"


def thread(frames: list[tuple[str, str, int]], active: bool = False, name: str = "MainThread") -> dict[str, Any]:
    return {"thread_name": name, "active": active, "frames": [{"name": n, "filename": f, "short_filename": f.rsplit("/", 1)[-1],
                                                               "line": ln} for n, f, ln in frames]}


TRAIN = [("step", "/srv/train.py", 40), ("main", "/srv/train.py", 60)]


@pytest.mark.parametrize(("frames", "active", "kind"), [
    ([("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py", 2500),
      ("wrapper", f"{SITE}/torch/distributed/c10d_logger.py", 80)], False, pace.COLLECTIVE),
    ([("barrier", "/srv/train.py", 12)], False, pace.COLLECTIVE),
    ([("Barrier.wait", "/usr/lib/python3.11/threading.py", 668)], False, pace.COLLECTIVE),
    ([("Queue.get", "/usr/lib/python3.11/multiprocessing/queues.py", 103), ("_try_get_data", f"{SITE}/torch/utils/data/dataloader.py", 1120),
      ("_next_data", f"{SITE}/torch/utils/data/dataloader.py", 1300), ("__next__", f"{SITE}/torch/utils/data/dataloader.py", 630)], False, pace.INPUT),
    ([("Queue.get", "/usr/lib/python3.11/multiprocessing/queues.py", 103)], False, pace.INPUT),
    ([("synchronize", f"{SITE}/torch/cuda/__init__.py", 800)], False, pace.GPU),
    ([("compute", "/srv/train.py", 9)], True, pace.RUNNING),
    ([("device_work", "/srv/train.py", 20)], False, pace.WAITING),
])
def test_the_main_thread_is_read_as_waiting_for_the_others_its_input_its_gpu_or_running(
        frames: list[tuple[str, str, int]], active: bool, kind: str) -> None:
    helper = thread([("_worker_loop", f"{SITE}/torch/utils/data/_utils/worker.py", 3)], True, name="pt_main_helper")
    got = pace.main_thread([helper, thread(frames + TRAIN, active)])
    assert got is not None and got.kind == kind
    assert got.at == (f"{frames[0][0]} (train.py:{frames[0][2]})" if frames[0][1].startswith("/srv") else "step (train.py:40)")
    assert got.chain[-1] == "main (train.py:60)"


# -- who holds the others back ----------------------------------------------------------------

def rank(r: int, samples: int = 40, collective: int = 8, node: str = "n1", **kw: Any) -> RankPace:
    return RankPace(r, 100 + r, node, samples, collective, **kw)


def test_the_rank_that_waits_least_is_named_only_when_it_waits_clearly_less() -> None:
    found = pace.slowest([rank(0), rank(1), rank(2, collective=0), rank(3, collective=9)])
    assert found is not None and found.rank.rank == 2 and found.share == 0.0 and found.z >= pace.MIN_Z
    assert pace.slowest([rank(0), rank(1), rank(2, collective=6), rank(3, collective=9)]) is None  # within the noise
    assert pace.slowest([rank(0), rank(1), rank(2, samples=5, collective=0)]) is None  # too few samples to say
    assert pace.slowest([rank(0, collective=0)]) is None  # one rank: nobody to compare with


def test_ranks_waiting_alike_by_chance_are_never_taken_for_a_straggler() -> None:
    """A uniform job: each rank waits 20 % of the time; 2,000 windows of 40 samples each."""
    rng = random.Random(29)
    named = 0
    for _ in range(2000):
        ranks = [rank(r, 40, sum(rng.random() < 0.2 for _ in range(40))) for r in range(8)]
        named += pace.slowest(ranks) is not None
    assert named <= 4, f"{named} of 2000 uniform windows named a rank"


def test_a_rank_named_when_the_episode_began_is_confirmed_while_it_still_stands_apart() -> None:
    ranks = [rank(0, 73, 29), rank(1, 73, 30), rank(2, 73, 27), rank(3, 73, 15)]  # 21 % against 39 %: z about 2.9
    assert pace.slowest(ranks) is None
    named = JobPace("train", 1000, "n1", 1e9, 0.125, 0.1, "slow", None, 60.0, tuple(ranks), (), 3, "n1")
    a = slow.judge([named]).to_dict()
    assert (a["pace"]["rank"], a["pace"]["node"]) == (3, "n1")
    other = replace(named, named_rank=1)  # a rank that does not wait least is never confirmed
    assert slow.judge([other]).to_dict()["pace"]["cause"] == "alike"


# -- the verdict on the nodes' records -------------------------------------------------------------

def record(ranks: list[RankPace], node: str = "n1", gpus: tuple[GpuPace, ...] = (), step: float = 0.125) -> JobPace:
    return JobPace("train", 1000, node, 1.0e9, step, 0.1, "slow", 1.0e9 - 60, 60.0, tuple(ranks), gpus)


def judged(ranks: list[RankPace], *more: JobPace, **kw: Any) -> dict[str, Any]:
    return slow.judge([record(ranks, **kw), *more]).to_dict()


def test_a_rank_cpu_bound_in_its_own_code_is_named_at_the_function_only_it_runs() -> None:
    helper, own, main = "compute (train.py:9)", "augment (train.py:30)", "main (train.py:60)"
    others = [rank(r, cpu_s=0.02, delay_s=0.001, running=2, frames=(("compute (train.py:8)", 2), (main, 2))) for r in (0, 1, 3)]
    # Innermost first, as a rank's record keeps them: the helper every rank calls, the function only
    # this rank runs (from its own line of main), the loop they all run.
    slowest = rank(2, collective=0, cpu_s=0.045, delay_s=0.002, running=18,
                   frames=((helper, 18), (own, 10), ("main (train.py:61)", 10), (main, 18)), frame=helper)
    a = judged([*others[:2], slowest, others[2]])
    assert a["pace"]["cause"] == "cpu-bound" and a["culprits"][0]["location"] == own
    assert a["summary"] == ("Job train is 25% slower than its baseline (0.125 s a step against 0.1 s): rank 2 on n1 holds it "
                            "back (it waits in collectives 0% of the time, the other ranks 20%): it is CPU-bound in its own "
                            "code at augment (train.py:30): 45 ms of CPU a step against the other ranks' 20 ms.")
    assert [r["verdict"] for r in a["ranks"]] == ["waits-for-slow-rank", "waits-for-slow-rank", "slow-rank", "waits-for-slow-rank"]


def test_a_rank_starved_of_input_says_whether_its_workers_are_busy_or_blocked() -> None:
    others = [rank(r, input=0, cpu_s=0.02, kids_cpu_s=0.001, kids=1) for r in (0, 2, 3)]
    blocked = rank(1, collective=0, input=12, cpu_s=0.02, kids_cpu_s=0.001, kids=1)
    a = judged([others[0], blocked, *others[1:]])
    assert a["pace"]["cause"] == "input-starved" and "its worker process is blocked, not computing (1 ms of CPU a step): it waits on I/O" in a["summary"]
    busy = replace(blocked, kids_cpu_s=0.09, kids=2)
    a = judged([others[0], busy, *others[1:]])
    assert "its 2 worker processes are busy (90 ms of CPU a step)" in a["summary"], a["summary"]


def test_a_wait_for_input_the_other_ranks_never_show_is_named_from_a_few_samples() -> None:
    """A CI run: the starved rank was caught waiting for its input in 4 of its 29 samples (the input
    wait a step is a quarter of it; a window's thirty samples draw fewer by chance), the other ranks
    in none. That sets it apart; two samples, or others that wait for input too, do not."""
    others = [rank(r, 29, 8, running=4, input=0, cpu_s=0.008) for r in (0, 2, 3)]
    starved = rank(1, 29, 0, running=4, input=4, cpu_s=0.011, kids_cpu_s=0.001, kids=1)
    a = judged([others[0], starved, *others[1:]], step=0.145)
    assert (a["pace"]["rank"], a["pace"]["cause"]) == (1, "input-starved"), a["summary"]
    assert "it waits for its DataLoader or worker processes 14% of the time (the other ranks 0%)" in a["summary"]
    assert judged([others[0], replace(starved, input=2), *others[1:]], step=0.145)["pace"]["cause"] == "unexplained"
    waiting_too = [replace(x, input=2) for x in others]
    assert judged([waiting_too[0], starved, *waiting_too[1:]], step=0.145)["pace"]["cause"] == "unexplained"


def test_a_rank_waiting_for_a_cpu_more_than_the_others_is_starved_not_cpu_bound() -> None:
    others = [rank(r, cpu_s=0.02, delay_s=0.002) for r in (0, 1, 3)]
    a = judged([*others[:2], rank(2, collective=0, cpu_s=0.022, delay_s=0.03), others[2]])
    assert a["pace"]["cause"] == "cpu-starved"
    assert "run delay 30 ms a step, 58% of the time it wants to run (the other ranks 2 ms, 9%)" in a["summary"], a["summary"]


def test_on_a_busy_node_a_rank_that_wants_more_cpu_is_cpu_bound_and_one_that_waits_for_it_is_starved() -> None:
    """Every rank waits for a CPU most of the time it wants one (the node's CPUs are oversubscribed):
    the one that holds the job back wants more of it, though it gets little more."""
    others = [rank(r, collective=15, cpu_s=0.003, delay_s=0.075) for r in (0, 1, 3)]
    a = judged([*others[:2], rank(2, collective=3, cpu_s=0.01, delay_s=0.118), others[2]], step=0.216)
    assert a["pace"]["cause"] == "cpu-bound", a["summary"]
    assert "it runs or waits to run 128 ms a step against the other ranks' 78 ms (on a busy node: it got 10 ms of CPU a step, they 3 ms)" in a["summary"]
    contended = judged([rank(r, collective=15, cpu_s=0.003, delay_s=0.075) for r in range(4)], step=0.216)
    assert contended["pace"]["cause"] == "node-contended" and "every rank on n1 waits for a CPU (75 ms a step" in contended["summary"]


def test_the_gpu_of_the_slow_rank_throttled_or_shared_is_the_cause() -> None:
    others = [rank(r, gpu_index=r, cpu_s=0.02) for r in (0, 1, 3)]
    slowest = rank(2, collective=0, gpu_index=2, cpu_s=0.02)
    throttled = GpuPace(2, sm_clock_ratio=0.62, throttle=("thermal (hardware)",), power_ratio=0.7, temperature_c=91.0)
    a = judged([*others[:2], slowest, others[2]], gpus=(throttled,))
    assert a["pace"]["cause"] == "gpu-throttled"
    assert "its GPU 2 is throttled (thermal (hardware)): SM clock at 62% of its max, power at 70% of its limit, 91 °C" in a["summary"]
    assert a["culprits"][0]["gpu"] == 2
    shared = GpuPace(2, sm_clock_ratio=1.0, processes=((102, 40), (4321, 63), (101, 0)))
    a = judged([*others[:2], slowest, others[2]], gpus=(shared,))
    assert a["pace"]["cause"] == "gpu-shared" and "shared with another process (pid 4321 at 63% SM)" in a["summary"]
    sick = GpuPace(2, sm_clock_ratio=1.0, pcie_replays=120)
    assert judged([*others[:2], slowest, others[2]], gpus=(sick,))["pace"]["cause"] == "gpu-errors"


def test_a_rank_whose_sync_spins_on_more_gpu_work_is_gpu_bound_not_cpu_bound() -> None:
    """The H200 run (tests/gpu/run_slow.py): rank 2 launched more kernels on the GPU the four ranks
    share. CUDA's synchronise spins, so it also used more CPU; its samples are in the synchronise,
    not in its own Python: it waits for its GPU."""
    sync = "Gpu.synchronize (pace_job.py:203)"
    others = [rank(0, 49, 14, gpu=33, running=2, cpu_s=0.197, frames=((sync, 33),)),
              rank(1, 48, 11, gpu=36, running=1, cpu_s=0.199, frames=((sync, 36),)),
              rank(3, 49, 10, gpu=37, running=2, cpu_s=0.199, frames=((sync, 37),))]
    slowest = rank(2, 49, 0, gpu=47, running=2, cpu_s=0.262, frames=((sync, 47),), frame=sync)
    a = judged([*others[:2], slowest, others[2]], step=0.263)
    assert (a["pace"]["rank"], a["pace"]["cause"]) == (2, "gpu-bound"), a["summary"]
    assert ("it waits for its own GPU work 96% of the time (the other ranks 75%): it gives its GPU more to do a step; "
            "its CPU, 262 ms a step against the others' 199 ms, goes to waiting for the GPU (a synchronise that spins)"
            in a["summary"]), a["summary"]
    # The same CPU spent in its own Python (its samples there, not in the synchronise) is CPU-bound.
    computing = replace(slowest, gpu=10, running=37, frames=(("augment (train.py:30)", 37),), frame="augment (train.py:30)")
    assert judged([*others[:2], computing, others[2]], step=0.263)["pace"]["cause"] == "cpu-bound"


def test_a_rank_on_another_node_holds_the_job_back_and_every_rank_here_waits() -> None:
    here = [rank(r, collective=14) for r in (0, 1)]
    there = record([rank(2, node="n2", collective=14), rank(3, node="n2", collective=0, cpu_s=0.05, running=20)], node="n2")
    a = judged(here, there)
    assert (a["pace"]["rank"], a["pace"]["node"]) == (3, "n2") and "rank 3 on n2 holds it back" in a["summary"]
    alone = judged(here)  # without the store: this node's ranks only
    assert alone["pace"]["cause"] == "elsewhere" and [r["verdict"] for r in alone["ranks"]] == ["waits-elsewhere"] * 2
    assert alone["summary"].startswith("Job train is 25% slower than its baseline (0.125 s a step against 0.1 s): every rank on "
                                       "n1 waits in collectives (35% of the time) and none of them holds the others back: the "
                                       "network or another node holds the job back")
    alike = judged([rank(r, collective=2, running=30) for r in range(4)])
    assert alike["pace"]["cause"] == "alike" and {r["verdict"] for r in alike["ranks"]} == {"slow-alike"}


def test_an_incident_directory_with_a_slow_record_is_judged_from_it(tmp_path: Path) -> None:
    ranks = [rank(0), rank(1, collective=0, cpu_s=0.05, running=20), rank(2)]
    for r in ranks:  # the stacks the capture took beside it do not make it a hang
        (tmp_path / str(r.pid)).mkdir()
        (tmp_path / str(r.pid) / "pyspy.json").write_text(json.dumps([thread([("compute", "/srv/train.py", 9)], True)]))
    (tmp_path / slow.SLOW_FILE).write_text(json.dumps({"node": "n1", "records": [pace_to_dict(record(ranks))]}))
    got = analyze(tmp_path)
    assert got.summary.startswith("Job train is 25% slower") and got.culprits[0].rank == 1
    (tmp_path / slow.SLOW_FILE).write_text(json.dumps({"node": "n1", "records": [{"job": "train"}]}))
    assert analyze(tmp_path).summary == "The slow job's record cannot be read: node is not a string."


KEYS = ["job", "uid", "node", "time", "step_s", "baseline_s", "state", "ranks", "gpus", "rank", "pid", "samples",
        "collective", "frames", "index", "throttle", "processes", "window_s"]
JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                       lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.sampled_from(KEYS), kids, max_size=8),
                       max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(JSONISH)
def test_a_record_from_the_store_is_read_or_refused_in_one_line(data: Any) -> None:
    try:
        got = pace_from_dict(data)
    except ValueError as exc:
        assert "\n" not in str(exc)
    else:
        assert pace_from_dict(pace_to_dict(got)) == got


def test_a_record_round_trips_through_json() -> None:
    r = record([rank(0, frames=(("f (a.py:1)", 3),), gpu_index=0)], gpus=(GpuPace(0, "GPU-1", 0.5, ("power cap",), processes=((1, 2),)),))
    assert pace_from_dict(json.loads(json.dumps(pace_to_dict(r)))) == r


# -- the machine: looks at real beat segments, with a stub clock -------------------------------------

class Ranks:
    """WORLD ranks of one job with real beat segments in ``root``, beating as the test says."""

    def __init__(self, root: Path, world: int = 4, job: str = "train") -> None:
        self.dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        self.watched: list[Watched] = []
        self.beats = [0] * world
        self.ns = [0] * world
        for r in range(world):
            name = f"r{r}.beat"
            beat_segment.create(str(root / name), 10_000_000 + r)
            at = untrusted.UserFile(self.dir_fd, name, os.geteuid(), allow_root=True)
            reg = Registration(ProcessId(10_000_000 + r, 1), uid=os.geteuid(), job=job, rank=r, beat_file=str(root / name), beat_at=at)
            self.watched.append(Watched(reg, State.HEALTHY, seen_at=0.0, timeout=10.0))
        self.root = root

    def step(self, seconds: float, count: int = 1) -> None:
        for r in range(len(self.watched)):
            self.beats[r] += count
            self.ns[r] += int(seconds * count * 1e9)
            with open(self.root / f"r{r}.beat", "r+b") as f:
                f.seek(beat_segment.BEAT_OFFSET)
                f.write(struct.pack("<QQ", self.beats[r], self.ns[r]))


def machine(**cfg: Any) -> PaceMachine:
    config = Config(state_dir="/nonexistent", runtime_dir="/nonexistent-run", slow_for=10.0, slow_margin=0.15,
                    slow_sample_interval=1.0, **cfg)
    return PaceMachine(config, Paces(create(CollectorRegistry(), node="unit")), "n1")


def sample(w: Watched, now: float, kind: str) -> PaceSampled:
    return PaceSampled(w.process, Sample(now, (), (), None, None, main=kind, main_at=("f (t.py:1)",)))


def run(m: PaceMachine, ranks: Ranks, start: float, seconds: float, step: float, kinds: dict[int, str] | None = None) -> list[DeclareSlow]:
    """Looks every second for ``seconds``, the ranks stepping at ``step`` and sampled as ``kinds`` says
    (rank -> kind; the others wait in collectives a fifth of the time)."""
    out = []
    for i in range(int(seconds)):
        now = start + i
        ranks.step(step, max(1, round(1 / step)))
        out += m.tick(ranks.watched, now, wall=1e9 + now)
        for p in m.paces.values():
            for r, w in enumerate(ranks.watched):
                kind = (kinds or {}).get(r) or (pace.COLLECTIVE if i % 5 == 0 else pace.WAITING)
                p.sampling.add(w.process)
                m.sampled(p, sample(w, now, kind))
    return out


def test_a_job_learns_its_pace_then_a_rank_that_waits_least_makes_one_episode_until_it_recovers(tmp_path: Path) -> None:
    m, ranks = machine(), Ranks(tmp_path)
    assert run(m, ranks, 0, 30, 0.1) == []
    (p,) = m.paces.values()
    assert p.state == STEADY and p.baseline == pytest.approx(0.1)
    decided = run(m, ranks, 30, 60, 0.125, kinds={2: pace.RUNNING})
    (d,) = decided  # one episode, one declaration, however long it lasts
    assert p.state == SLOW and [w.registration.rank for w in d.group] == [0, 1, 2, 3]
    assert d.suspicion.reason == "slow" and "25% slower than its baseline" in d.suspicion.detail
    assert d.records[0].state == "slow" and slow.judge(d.records).pace["rank"] == 2  # type: ignore[index]
    assert run(m, ranks, 90, 20, 0.1) == [] and p.state == STEADY and p.incident is None


def test_a_job_slower_alike_everywhere_learns_a_new_pace_and_a_hang_is_not_slow(tmp_path: Path) -> None:
    m, ranks = machine(), Ranks(tmp_path)
    run(m, ranks, 0, 30, 0.1)
    (p,) = m.paces.values()
    assert run(m, ranks, 30, 45, 0.2, kinds={r: pace.RUNNING for r in range(4)}) == []
    assert p.state == STEADY and p.relearned == 1  # a new phase: its pace learned again
    run(m, ranks, 75, 25, 0.2)
    assert p.baseline == pytest.approx(0.2)
    object.__setattr__(ranks.watched[1], "state", State.HUNG)  # its hang is the heartbeat's business
    before = len(p.steps)
    assert run(m, ranks, 100, 30, 0.4) == [] and len(p.steps) == before and p.state == STEADY


def test_a_rank_on_another_node_takes_the_episode_there(tmp_path: Path) -> None:
    m, ranks = machine(), Ranks(tmp_path, world=2)
    run(m, ranks, 0, 30, 0.1)
    (p,) = m.paces.values()
    p.remote = {"n2": JobPace("train", os.geteuid(), "n2", 1e9 + 60, 0.125, 0.1, "slower", None, 30.0,
                              (rank(2, node="n2", collective=10), rank(3, node="n2", collective=0)))}
    assert run(m, ranks, 30, 40, 0.125) == []
    assert p.state == SLOW and p.elsewhere == "n2"
    assert p.state in (SLOWER, SLOW)
