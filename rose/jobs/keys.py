"""Names of everything rose puts in Redis (see docs/jobs.md), and of the RQ keys producers read, from RQ's own
classes (so `RQ_KEY_PREFIX` holds; RQ 2.x and 3.x name them alike). The worker's RQ bookkeeping is in
rose.worker.rq_store."""

from __future__ import annotations

from rq.job import Job
from rq.results import Result

DEFAULT_QUEUE = "rose"
FUNC_PATH = "rose.jobs.generate"

TOKENS_CHANNEL_PREFIX = "rose:tokens:"
STREAM_PREFIX = "rose:stream:"
WORKER_INFO_PREFIX = "rose:worker:"
FAIR_PREFIX = "rose:fair:"  # the fleet's fair-share counters (rose.worker.fair_queue)
# each queue's fair-share index (2: its entries carry their costs; an earlier version's is under FAIR_PREFIX)
FAIR_INDEX_PREFIX = "rose:fair2:"
# Jobs whose end is stored in RQ but whose terminal event may not be in their stream yet: job id -> worker name
# (rose.worker.seal). Normally empty but for the jobs ending this instant.
SEALS_KEY = "rose:seals"
# never written: a `SET ... XX` on it changes nothing, and is refused while Redis is full (rose.worker.redis_guard)
OOM_PROBE_KEY = "rose:oom-probe"
# a stream restored onto it (expiring at once) in a worker's first retirement: does Redis take the streams rose
# restores at their size (rose.worker.stream_dump)?
RESTORE_PROBE_KEY = "rose:restore-probe"

# a stream entry holds an event's JSON in this field, or a plain token event as its own fields (rose.jobs.events)
STREAM_FIELD = "event"

# job.meta keys the worker maintains
META_REQUEUES = "rose_requeues"  # times the job was requeued because its worker died
META_LAST_WORKER = "rose_last_worker"


def tokens_channel(job_id: str) -> str:
    """Pub/sub channel carrying the job's events live."""
    return f"{TOKENS_CHANNEL_PREFIX}{job_id}"


def job_id_of_channel(channel: bytes | str) -> str:
    """The job whose events `channel` carries (a `PSUBSCRIBE rose:tokens:*` message's channel): events name no job."""
    return _after(TOKENS_CHANNEL_PREFIX, channel)


def stream_key(job_id: str) -> str:
    """Redis stream holding every event of the job, for replay."""
    return f"{STREAM_PREFIX}{job_id}"


def worker_info_key(worker_name: str) -> str:
    """Hash with the engine's description and live counters of one rose-worker."""
    return f"{WORKER_INFO_PREFIX}{worker_name}"


def fair_key(queue_name: str, part: str) -> str:
    """A key of `queue_name`'s fair-share index: mark, mark_enqueued, order, tenants, deadlines
    (rose.worker.fair_queue)."""
    return f"{FAIR_INDEX_PREFIX}{queue_name}:{part}"


def fair_tenant_key(queue_name: str, tenant: str) -> str:
    """The list of `tenant`'s waiting jobs in `queue_name`'s fair-share index."""
    return f"{FAIR_INDEX_PREFIX}{queue_name}:tenant:{tenant}"


def fair_counters_key() -> str:
    """Sorted set: each tenant's service, tokens / weight, counted by every worker of the fleet."""
    return f"{FAIR_PREFIX}counters"


# ---- RQ's keys, for producers ---------------------------------------------------------------------------------

JOB_STATUS_FIELD = "status"  # of RQ's job hash


def rq_job_key(job_id: str) -> str:
    """RQ's hash of the job (`rq:job:<id>`)."""
    return Job.key_for(job_id)


def rq_results_key(job_id: str) -> str:
    """RQ's stream of the job's results (`rq:results:<id>`)."""
    return Result.get_key(job_id)


def job_id_of_results_key(key: bytes | str) -> str:
    return _after(rq_results_key(""), key)


def _after(prefix: str, key: bytes | str) -> str:
    """The job id a key or channel name holds after its family's prefix."""
    return (key.decode() if isinstance(key, bytes) else key).removeprefix(prefix)
