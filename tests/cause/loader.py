"""A data loader's worker processes: each reads the shards it is sent; a shard that is a FIFO
nobody writes blocks its reader for ever."""

import multiprocessing as mp


def read_shard(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(1 << 16)


def worker_loop(worker_id: int, paths: "mp.Queue[str]", out: "mp.Queue[int]") -> None:
    while True:
        path = paths.get()
        if path is None:
            return
        data = read_shard(path)
        out.put(len(data))
