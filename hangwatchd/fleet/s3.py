"""The S3 client: boto3, so endpoint, keys, profiles, instance roles and IRSA work as in every AWS tool.

``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) points it at MinIO, Ceph RGW,
GCS's S3 API or a test server. Timeouts are short and retries few: the uploader
has its own backoff, and a daemon must never hang on its store.
"""

from __future__ import annotations

from typing import Any


def client(connect_timeout: float = 3.0, read_timeout: float = 10.0) -> Any:
    import boto3
    from botocore.config import Config

    cfg = Config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                 retries={"max_attempts": 2, "mode": "standard"},
                 # Path-style works with every S3-compatible server, virtual-host needs DNS per bucket.
                 s3={"addressing_style": "path"})
    return boto3.session.Session().client("s3", config=cfg)


def is_missing(exc: Exception) -> bool:
    """Whether a botocore error means 'no such key' (as opposed to the store being unreachable)."""
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")


def not_modified(exc: Exception) -> bool:
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
    return code in ("304", "NotModified")
