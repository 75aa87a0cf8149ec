"""Names of everything rose puts in Redis besides RQ's own keys (see docs/jobs.md)."""

from __future__ import annotations

DEFAULT_QUEUE = "rose"
FUNC_PATH = "rose.jobs.generate"

TOKENS_CHANNEL_PREFIX = "rose:tokens:"
STREAM_PREFIX = "rose:stream:"
WORKER_INFO_PREFIX = "rose:worker:"

STREAM_FIELD = "event"  # each stream entry holds the event JSON in this field

# job.meta keys the worker maintains
META_REQUEUES = "rose_requeues"  # times the job was requeued because its worker died
META_LAST_WORKER = "rose_last_worker"


def tokens_channel(job_id: str) -> str:
    """Pub/sub channel carrying the job's events live."""
    return f"{TOKENS_CHANNEL_PREFIX}{job_id}"


def stream_key(job_id: str) -> str:
    """Redis stream holding every event of the job, for replay."""
    return f"{STREAM_PREFIX}{job_id}"


def worker_info_key(worker_name: str) -> str:
    """Hash with the engine's description and live counters of one rose-worker."""
    return f"{WORKER_INFO_PREFIX}{worker_name}"
