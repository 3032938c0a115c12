"""A vLLM-style engine core process dies and its frontend waits forever: the frontend starts the
engine core (``run_engine_core``, process EngineCore_0) with a duplex pipe and keeps its own
copy of the child's end open (it was never closed after the fork). The engine core is killed
with SIGKILL (OOM) while it serves; the frontend's ``recv()`` on the pipe never sees EOF,
because the frontend itself still holds the other end. Requests hang; the frontend, which beat
once per response, stays up.

Reports: vllm-project/vllm#39863 ("EngineCore dies silently while parent (APIServer) remains
alive ... causing service hang"); vllm-project/vllm#21443 ("When EngineCore process is killed
by kill -9 ... new requests to api server hang").
"""

import multiprocessing as mp
import os
import signal

import hangwatchd

CASE = {
    "title": "engine core process killed; frontend waits on a pipe it holds open itself",
    "source": "vllm-project/vllm#39863; vllm-project/vllm#21443 (EngineCore killed, the API server hangs)",
    "healthy": False,
    "watch": {"heartbeat_timeout": 3},
    "ranks": 1,
    "culprit": ["EngineCore_0", "run_engine_core"],
    "cause": r"killed|SIGKILL|signal 9|died|is gone",
    "hangs_after": 1,
}


def run_engine_core(conn: "mp.connection.Connection") -> None:
    served = 0
    while True:
        request = conn.recv()
        served += 1
        if served == 4:
            os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer takes the engine core mid-request
        conn.send(f"output for {request}")


def main() -> None:
    ctx = mp.get_context("fork")
    frontend_end, core_end = ctx.Pipe(duplex=True)
    core = ctx.Process(target=run_engine_core, args=(core_end,), name="EngineCore_0")
    core.start()
    # core_end.close() is missing: this process keeps the engine core's end open, so its death is no EOF here
    for i in range(10):
        frontend_end.send(f"request-{i}")
        frontend_end.recv()
        hangwatchd.beat()


if __name__ == "__main__":
    main()
