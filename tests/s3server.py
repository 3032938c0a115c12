"""A real S3 protocol server for tests and benchmarks: moto's standalone server on loopback.

Started as a child process in its own process group, on a free port, and
stopped by its pid. It keeps objects in memory: a restart is a store that came
back empty (the bucket is made again), which a node must cope with anyway.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from typing import Any

from hangwatchd.testing import stop, wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    def __init__(self, bucket: str = "hangwatchd-test", port: int | None = None) -> None:
        self.bucket = bucket
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a daemon or the CLI needs to reach it: the standard AWS variables."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def url(self, prefix: str = "hw") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def start(self) -> S3Server:
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        proc = self.proc

        def answers() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"moto server on port {self.port} did not start (it exited)")
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
            except OSError:
                return False
            return True

        try:
            wait_for(answers, 30, f"moto server on port {self.port}", every=0.1)
        except TimeoutError:
            raise RuntimeError(f"moto server on port {self.port} did not start") from None
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, group=True)
        self.proc = None

    def client(self) -> Any:
        import boto3

        return boto3.session.Session().client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                              aws_access_key_id="testing", aws_secret_access_key="testing")

    def keys(self, prefix: str = "") -> list[str]:
        out: list[str] = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
