"""The store's URL: ``s3://BUCKET/PREFIX``. Endpoint and credentials come from the standard AWS variables."""

from __future__ import annotations

import re
from dataclasses import dataclass

# S3's own bucket-name rules (3-63 lowercase letters, digits, dots, hyphens).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class StoreURLError(ValueError):
    """Not a usable store URL: the message says what is expected."""


@dataclass(frozen=True)
class StoreURL:
    bucket: str
    prefix: str  # without leading or trailing slash; "" for the bucket's root

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def parse(url: str) -> StoreURL:
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise StoreURLError(f"store {url!r} is not an s3:// URL; expected s3://BUCKET/PREFIX")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not _BUCKET.match(bucket):
        raise StoreURLError(f"store {url!r}: {bucket!r} is not a valid bucket name; expected s3://BUCKET/PREFIX")
    prefix = prefix.strip("/")
    if "//" in prefix or any(c in prefix for c in "\0\n\r"):
        raise StoreURLError(f"store {url!r}: the prefix {prefix!r} is not a valid key prefix")
    return StoreURL(bucket, prefix)
