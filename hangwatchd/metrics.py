"""Every Prometheus metric hangwatchd exports, in one place.

Naming follows Prometheus practice: the ``hangwatchd_`` prefix, units in the
name, ``_total`` for counters, timestamps rather than ages. Labels that also
exist in dcgm-exporter (``Hostname``, ``pod``, ``namespace``, ``container``)
are added as constant labels from the environment where they apply.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    start_http_server,
)

from .config import STEP_NAMES
from .cudacore.layout import EXCEPTIONS

# Every label value a counter that an alert reads can take, each series made at 0 when the daemon
# starts: Prometheus's increase() sees no increase in a series born at 1, so a counter created on
# first use would never fire its alert for the first event on a node (issue 20).
HANG_REASONS = ("heartbeat", "stack")  # the detectors that declare a hang (detect/)
# The CUDA driver's exception types (CUDBGException_t names), what a dump that cannot be read counts
# as, and OTHER for a code this table does not know: a closed set, so the label cannot grow.
EXCEPTION_TYPES = tuple(dict.fromkeys((*EXCEPTIONS.values(), "UNREADABLE", "OTHER")))
INDEX_REBUILD_REASONS = ("corrupt", "missing")  # why an incident index was rebuilt at start (incidents/heal.py)
PASSES = ("look", "discovery", "rescan")  # what a pass of the loop is (hangwatchd_loop_passes_total)
# The XIDs counted by number (host/xid.py's catalogue: the common ones of both kinds); any other is "other".
XID_LABELS = ("13", "31", "43", "45", "46", "48", "62", "63", "64", "74", "79", "92", "94", "95", "109", "119", "120",
              "154", "other")


def exception_type(name: str) -> str:
    """The label for an exception type: itself when in the closed set, else OTHER."""
    return name if name in EXCEPTION_TYPES else "OTHER"


def xid_label(xid: int) -> str:
    return str(xid) if str(xid) in XID_LABELS else "other"


STEP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
LOOP_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5)
GAP_BUCKETS = (1.0, 2.0, 5.0, 5.5, 6.0, 7.5, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0)
LAST_INCIDENT_SERIES = 64
# The workload's job name. Never "job" (nor "instance"): Prometheus attaches its own job label, the
# scrape config's job_name, and renames an exporter's to exported_job, so dashboards and alerts
# grouping by job would see "hangwatchd" for every workload.
JOB_LABEL = "workload_job"


def constant_labels() -> dict[str, str]:
    """dcgm-exporter's join labels: the node, and the pod when running as a sidecar."""
    labels = {"Hostname": os.environ.get("NODE_NAME") or socket.gethostname()}
    for label, env in (("pod", "POD_NAME"), ("namespace", "POD_NAMESPACE"), ("container", "CONTAINER_NAME")):
        if os.environ.get(env):
            labels[label] = os.environ[env]
    return labels


@dataclass
class Metrics:
    registry: CollectorRegistry
    watched: Gauge
    last_beat: Gauge
    timeout: Gauge
    hangs: Counter
    state_changes: Counter
    step_duration: Histogram
    step_failures: Counter
    loop_duration: Histogram
    sample_gap: Histogram
    registration_errors: Counter
    incidents: Counter
    gpu_exceptions: Counter
    store_sends: Counter
    store_spooled: Gauge
    store_write_failures: Counter
    incidents_pending: Gauge
    loop_errors: Counter
    stack_samples: Counter
    stack_carried: Counter
    loop_cpu: Counter
    info: Info
    last_incident: Gauge
    jobs_aborted: Counter
    xid_errors: Counter
    gpu_implicating_jobs: Gauge
    gpu_suspect: Gauge
    index_rebuilds: Counter
    passes: Counter
    job_step: Gauge
    job_baseline: Gauge
    job_slowest_wait: Gauge
    job_slow: Gauge
    slow_episodes: Counter
    const: dict[str, str]
    # (reason, job) -> the incident id its series carries now: one series each, the latest.
    _last: dict[tuple[str, str], str] = field(default_factory=dict)

    def labels(self, **labels: str) -> dict[str, str]:
        """The constant labels plus these, for ``metric.labels(**m.labels(step="pyspy"))``."""
        return {**self.const, **labels}

    def gpus_seen(self, gpus: list[int], uuids: dict[int, str] | None = None) -> None:
        """The node's GPUs, found at start: their XID and suspect series made at 0, for the same reason as above."""
        for gpu in gpus:
            for xid in XID_LABELS:
                self.xid_errors.labels(**self.labels(gpu=str(gpu), xid=xid))
            uuid = (uuids or {}).get(gpu) or ""
            self.gpu_implicating_jobs.labels(**self.labels(gpu=str(gpu), UUID=uuid))
            self.gpu_suspect.labels(**self.labels(gpu=str(gpu), UUID=uuid))

    def incident_stored(self, incident: str, reason: str, job: str | None, when: float) -> None:
        """Point the latest-incident series of (reason, job) at this incident, so an alert can name it.

        One series per (reason, job), the oldest dropped past LAST_INCIDENT_SERIES: the id is a
        label, and a label that grows without bound would grow the scrape without bound."""
        key = (reason, job or "")
        old = self._last.pop(key, None)
        if old is not None:
            self.last_incident.remove(*self.const.values(), old, *key)
        while len(self._last) >= LAST_INCIDENT_SERIES:
            (stale_reason, stale_job), stale_id = next(iter(self._last.items()))
            del self._last[(stale_reason, stale_job)]
            self.last_incident.remove(*self.const.values(), stale_id, stale_reason, stale_job)
        self._last[key] = incident
        self.last_incident.labels(**self.labels(incident=incident, reason=reason, **{JOB_LABEL: job or ""})).set(when)


def create(registry: CollectorRegistry | None = None, node: str | None = None) -> Metrics:
    reg = registry or CollectorRegistry()
    const = constant_labels()
    if node:
        const["node"] = node  # the name this node has in the shared store and its incidents
    names = list(const)

    def labels(*extra: str) -> list[str]:
        return names + list(extra)

    m = Metrics(
        registry=reg,
        watched=Gauge("hangwatchd_watched_processes", "Watched processes by state.", labels("state"), registry=reg),
        last_beat=Gauge("hangwatchd_last_beat_timestamp_seconds", "Unix time of the last heartbeat of a watched process.",
                        labels(JOB_LABEL, "rank", "pid"), registry=reg),
        timeout=Gauge("hangwatchd_heartbeat_timeout_seconds", "Seconds without a beat before a watched process is hung.",
                      labels(JOB_LABEL, "rank", "pid"), registry=reg),
        hangs=Counter("hangwatchd_hangs_total", "Hung processes detected, by the signal that found them.",
                      labels("reason"), registry=reg),
        state_changes=Counter("hangwatchd_state_changes_total", "Watched processes entering a state.",
                              labels("state"), registry=reg),
        step_duration=Histogram("hangwatchd_capture_step_duration_seconds", "Duration of each capture step.",
                                labels("step"), buckets=STEP_BUCKETS, registry=reg),
        step_failures=Counter("hangwatchd_capture_step_failures_total", "Capture steps that failed or timed out.",
                              labels("step"), registry=reg),
        sample_gap=Histogram("hangwatchd_stack_sample_gap_seconds",
                             "Seconds between two stack samples of one process watched by its stack (stack_interval "
                             "when the sampler keeps up).", names, buckets=GAP_BUCKETS, registry=reg),
        loop_duration=Histogram("hangwatchd_loop_iteration_duration_seconds",
                                "Time the daemon's loop spends on one wake-up (its own latency).",
                                names, buckets=LOOP_BUCKETS, registry=reg),
        registration_errors=Counter("hangwatchd_registration_errors_total", "Registrations refused, by reason.",
                                    labels("reason"), registry=reg),
        incidents=Counter("hangwatchd_incidents_total", "Incidents stored, by reason.", labels("reason"), registry=reg),
        gpu_exceptions=Counter("hangwatchd_gpu_exceptions_total", "GPU exceptions reported by the CUDA driver, by type.",
                               labels("type"), registry=reg),
        store_sends=Counter("hangwatchd_store_sends_total", "Incidents and capture requests sent to the shared store "
                            "(outcome ok), and tries that failed (outcome failed, retried with backoff).",
                            labels("outcome"), registry=reg),
        store_spooled=Gauge("hangwatchd_store_spooled", "Incidents and requests queued on disk for the shared store.",
                            names, registry=reg),
        store_write_failures=Counter("hangwatchd_store_write_failures_total",
                                     "Incidents the state dir could not take (full disk): kept in the spool instead.",
                                     names, registry=reg),
        incidents_pending=Gauge("hangwatchd_incidents_pending", "Incident reports in the spool waiting for room in the state dir.",
                                names, registry=reg),
        loop_errors=Counter("hangwatchd_loop_errors_total",
                            "Errors the daemon's loop caught while handling one registration, process or dump.",
                            labels("where"), registry=reg),
        loop_cpu=Counter("hangwatchd_loop_cpu_seconds_total", "CPU time the daemon's loop thread spent handling events "
                         "and timers (its own work, not waiting and not other threads').", names, registry=reg),
        stack_samples=Counter("hangwatchd_stack_samples_total", "py-spy stack samples taken of watched processes, by kind "
                              "(plain or native) and outcome (ok or failed).", labels("kind", "outcome"), registry=reg),
        stack_carried=Counter("hangwatchd_stack_samples_carried_total", "Stack samples (counted in "
                              "hangwatchd_stack_samples_total too) given without running py-spy, by why: still (no "
                              "thread of the process had run since its stack was last read) or probe (the stack "
                              "probe read the same Python frames and locals as at that read).", labels("kind", "why"),
                              registry=reg),
        info=Info("hangwatchd_build", "Version of hangwatchd.", names, registry=reg),
        last_incident=Gauge("hangwatchd_last_incident_timestamp_seconds",
                            "Unix time of the latest incident stored for a reason and job; its id is the incident label.",
                            labels("incident", "reason", JOB_LABEL), registry=reg),
        jobs_aborted=Counter("hangwatchd_jobs_aborted_total",
                             "Jobs whose ranks on this node the daemon ended after storing their incident (on_hang = abort).",
                             names, registry=reg),
        xid_errors=Counter("hangwatchd_gpu_xid_errors_total", "XID errors the GPUs reported (NVML's events and the "
                           "kernel log's NVRM Xid lines, one each), by GPU index and XID (\"other\": one outside the "
                           "set counted by number).", labels("gpu", "xid"), registry=reg),
        gpu_implicating_jobs=Gauge("hangwatchd_gpu_implicating_jobs", "Different jobs whose incidents on this node "
                                   "implicated the GPU (a fault of the GPU, or a program's own fault on it) within "
                                   "suspect_window.", labels("gpu", "UUID"), registry=reg),
        gpu_suspect=Gauge("hangwatchd_gpu_suspect", "1 while the GPU is implicated by at least suspect_jobs different "
                          "jobs within suspect_window: hangwatchd health reports a node problem.",
                          labels("gpu", "UUID"), registry=reg),
        index_rebuilds=Counter("hangwatchd_index_rebuilds_total", "Incident indexes rebuilt from the incident "
                               "directories as the daemon started, by why: corrupt (moved aside and kept) or missing "
                               "(lost while incidents were stored).", labels("reason"), registry=reg),
        passes=Counter("hangwatchd_loop_passes_total", "Passes the loop made, by what: a look at a watched process "
                       "(look), a discovery scan handed in (discovery), a rescan of the registrations (rescan). What "
                       "marks that the daemon looked, where nothing else happens.", labels("what"), registry=reg),
        job_step=Gauge("hangwatchd_job_step_seconds", "Seconds a step of a job takes now: the median of its ranks' on "
                       "this node, from their beats.", labels(JOB_LABEL), registry=reg),
        job_baseline=Gauge("hangwatchd_job_step_baseline_seconds", "A job's own pace: seconds a step, learned from its "
                           "steady steps.", labels(JOB_LABEL), registry=reg),
        job_slowest_wait=Gauge("hangwatchd_job_slowest_rank_wait_ratio", "The share of its stack samples in which the "
                               "rank that waits least in collectives waited (rank and rank_node name it; across nodes "
                               "where the shared store says): the rank that holds the job back waits least.",
                               labels(JOB_LABEL, "rank", "rank_node"), registry=reg),
        job_slow=Gauge("hangwatchd_job_slow", "1 while a job is in a slow episode: the rank that holds it back, its node "
                       "and the cause class (docs/slow.md); gone when the job is back to its pace.",
                       labels(JOB_LABEL, "rank", "rank_node", "cause"), registry=reg),
        slow_episodes=Counter("hangwatchd_slow_episodes_total", "Slow episodes of jobs seen on this node (filed here, "
                              "or on the node of the rank that holds the job back).", names, registry=reg),
        const=const,
    )
    # Every series an alert reads, present at 0 from the start, so increase() sees the first event.
    for reason in HANG_REASONS:
        m.hangs.labels(**m.labels(reason=reason))
        m.incidents.labels(**m.labels(reason=reason))
    m.incidents.labels(**m.labels(reason="gpu-exception"))
    m.incidents.labels(**m.labels(reason="slow"))  # a slow job's episode (detect/pace_machine.py)
    m.slow_episodes.labels(**const)
    m.incidents.labels(**m.labels(reason="unattributed-dump"))  # a dump naming a process that is not its owner's
    for exc_type in EXCEPTION_TYPES:
        m.gpu_exceptions.labels(**m.labels(type=exc_type))
    for step in STEP_NAMES:
        m.step_failures.labels(**m.labels(step=step))
    m.jobs_aborted.labels(**const)
    for why in INDEX_REBUILD_REASONS:
        m.index_rebuilds.labels(**m.labels(reason=why))
    for what in PASSES:
        m.passes.labels(**m.labels(what=what))
    m.loop_duration.labels(**const)
    m.sample_gap.labels(**const)
    m.loop_cpu.labels(**const)
    m.store_write_failures.labels(**const)
    m.incidents_pending.labels(**const)
    return m


class AddressError(Exception):
    """The metrics address cannot be served: the message names it and what to do."""


def serve(registry: CollectorRegistry, address: str) -> str:
    """Serve /metrics on HOST:PORT in a thread; return the address bound (port 0 picks one)."""
    host, _, port = address.rpartition(":")
    try:
        server, _thread = start_http_server(int(port), addr=host or "0.0.0.0", registry=registry)
    except OSError as exc:  # socket.gaierror too: a host name that does not resolve
        why = "is in use" if exc.errno == 98 else f"cannot be served ({exc.strerror or exc})"
        raise AddressError(f"metrics address {address} {why}; pass --metrics-address HOST:PORT "
                           "(or metrics_address in the config) with a local address, or \"\" for none") from None
    return f"{host or '0.0.0.0'}:{server.server_port}"
