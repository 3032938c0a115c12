"""What is kept, and for how long: the store's incidents and dumps by size and age, and stale driver logs.

Run on a worker thread every ``RETENTION_EVERY`` seconds while no capture is
in flight (a capture's draft is never counted against the limit).

Only what the store owns is counted: its incidents (root's directories) and its
index, by the blocks they use. The dump dir is any user's to write (and lies
beside the state dir, not in it): a sparse 60 GiB file there uses no disk and
must not make retention delete anyone's incidents.
"""

from __future__ import annotations

import time

import structlog

from ..config import Config
from .store import Store

log = structlog.get_logger("hangwatchd.daemon")

RETENTION_EVERY = 600.0
DRIVER_LOG_KEEP = 3600.0  # seconds a launcher's driver-log copy outlives its process


def enforce(store: Store, cfg: Config) -> None:
    """Drop what the config no longer keeps; log each removal, never raise for a file that resists."""
    try:
        for path in store.enforce_retention(cfg.max_state_bytes, cfg.dump_max_age_days * 86400,
                                            cfg.incident_max_age_days * 86400):
            log.info("retention_removed", path=path)
    except OSError as exc:
        log.error("retention_failed", error=str(exc))
    else:
        log.info("retention_checked", store_bytes=store._size(), max_state_bytes=cfg.max_state_bytes)
    cutoff = time.time() - DRIVER_LOG_KEEP
    for stale in cfg.driver_logs.glob("*.log"):
        try:
            if stale.lstat().st_mtime < cutoff:
                stale.unlink()
        except OSError:
            pass
