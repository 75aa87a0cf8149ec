"""rose.worker.retirer: the jobs of a step retired as one batch in two pipelined rounds, leaving Redis exactly as RQ's
own handle_job_success does; dependents, a WATCH abort and Redis errors hand the jobs back, and the watch's check
says which of them are still ours to store through RQ's handler (rose.worker.endings)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import pytest
import redis
from redis._parsers.base import BaseParser
from rq.job import Job, JobStatus
from rq.registry import FinishedJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from worker_helpers import probe_target, registered_rq_worker, start_jobs, stream_events, wait_for

from rose.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from rose.harness.redis_server import RedisServerProcess
from rose.jobs import keys
from rose.jobs.client import Client
from rose.worker import batch_store, rq_store
from rose.worker.endings import Endings
from rose.worker.metrics import WorkerMetrics
from rose.worker.outbox import Outbox
from rose.worker.publisher import Publisher
from rose.worker.retirer import Retirer
from rose.worker.rq_worker import RQWorker
from rose.worker.running import Choice, Phase
from rose.worker.watch import Verdict, Watch

pytestmark = pytest.mark.timeout(60)


@dataclass
class Parts:
    """The worker's parts a retirement goes through, on a registered RQ worker with no loop."""

    rq: RQWorker
    retirer: Retirer
    endings: Endings
    outbox: Outbox
    watch: Watch

    def announce(self, runs) -> None:
        """What the loop does with jobs a batch stored (their done events written with their results)."""
        for run in runs:
            self.endings.stored(run, announced=True)
        self.outbox.flush()
        assert self.outbox.publisher.flush(timeout=5)

    def check(self, runs) -> dict[str, Verdict]:
        """What the loop does with handed-back jobs: their status read; returns the findings by job id."""
        for run in runs:
            run.phase = Phase.CHECKING
        checked = self.watch.check({run.id: run for run in runs})
        assert {run.id for run in checked.checked} == {run.id for run in runs}
        return {f.run.id: f.verdict for f in checked.findings}


@pytest.fixture
def parts(redis_server, r):
    yield from worker_parts(redis_server)


def worker_parts(redis_server):
    rq = registered_rq_worker(redis_server, "retirer")
    outbox = Outbox(Publisher(rq.connection), rq.default_result_ttl)
    metrics = WorkerMetrics(
        name=rq.name, model="fake", device="cpu", dtype="", queues=["rose"], version="test"
    )
    yield Parts(
        rq,
        Retirer(rq, outbox.done_commands),
        Endings(rq, outbox, metrics),
        outbox,
        Watch(probe_target(rq), 3600),
    )
    outbox.publisher.close(timeout=1)
    rq.connection.close()


def finished_runs(parts, r, n: int, **submit):
    client = Client(r, queue="rose")
    jobs = [client.submit(f"prompt {i}", max_tokens=2, **submit) for i in range(n)]
    runs = start_jobs(parts.rq, n)
    assert [run.id for run in runs] == [job.id for job in jobs]
    return finish(parts, runs)


def finish(parts, runs):
    """The engine's part: each started job generated two tokens."""
    for run in runs:
        run.choices = [Choice(["a", "b"], [5, 6])]
        run.output = RequestOutput(
            request_id=run.id,
            prompt=None,
            prompt_token_ids=[1, 2],
            outputs=[CompletionOutput(0, "ab", [5, 6], "length")],
            metrics=RequestMetrics(arrival_time=time.time(), num_prompt_tokens=2),
        )
        run.result = run.build_result(parts.rq.name)
        run.phase = Phase.FINISHED
    return runs


def job_state(r, run) -> dict:
    """What RQ stored about a finished job, minus what differs between any two jobs (ids, times)."""
    job = Job.fetch(run.id, connection=r, serializer=JSONSerializer)
    result = Result.fetch_latest(job, serializer=JSONSerializer)
    fields = {k.decode(): v for k, v in r.hgetall(job.key).items()}
    volatile = {
        "created_at",
        "enqueued_at",
        "started_at",
        "ended_at",
        "last_heartbeat",
        "data",
        "description",
    }
    return {
        "status": job.get_status(),
        "fields": sorted(set(fields) - volatile),
        "worker_name": fields.get("worker_name"),
        "ttl": r.ttl(job.key) > 0,
        "result_type": result.type if result else None,
        "result_keys": sorted(result.return_value) if result else None,
        "finished": run.id in FinishedJobRegistry("rose", connection=r),
        "started": any(
            m.startswith(run.id.encode())
            for m in r.zrange(StartedJobRegistry("rose", connection=r).key, 0, -1)
        ),
        "execution": r.exists(run.execution.key),
    }


def test_a_batch_leaves_redis_as_rqs_handler_does(parts, r):
    by_handler, *batch = finished_runs(parts, r, 4)
    parts.endings.succeed(by_handler)  # RQ's handle_job_success
    assert not parts.retirer.submit(batch).handed_back
    assert parts.retirer.busy
    retired = parts.retirer.advance(wait=True)  # the one round trip's reply
    assert retired.stored == batch and not retired.handed_back
    assert not parts.retirer.busy and parts.retirer.batched_jobs == 3
    expected = job_state(r, by_handler)
    assert expected["status"] == JobStatus.FINISHED and expected["finished"] and not expected["started"]
    for run in batch:
        assert job_state(r, run) == expected
        assert Client(r, queue="rose").job(run.id).result(timeout=1)["token_ids"] == [5, 6]
    counts = r.hmget(parts.rq.key, "successful_job_count", "total_working_time")
    assert int(counts[0]) == 4 and float(counts[1]) > 0
    parts.announce(batch)
    assert parts.endings.completed == 4
    for run in [by_handler, *batch]:  # the batch's done events came with their results
        assert [e["type"] for e in stream_events(r, run.id)] == ["done"]


def test_a_batch_rewrites_only_what_changed_and_expires_a_dependents_set_of_dependencies(parts, r):
    """RQ's handler saves the whole job hash (the prompt twice, in the payload and the description) and EXPIREs the
    job's dependents and dependencies sets; the batch writes the fields that changed and EXPIREs the sets that
    exist: the same hash, the same TTLs."""
    (parent,) = finished_runs(parts, r, 1)
    client = Client(r, queue="rose")
    dependents = [client.submit(f"after {i}", max_tokens=2, depends_on=parent.id) for i in range(2)]
    parts.endings.succeed(parent)  # RQ's handler enqueues the dependents
    by_handler, by_batch = finish(parts, start_jobs(parts.rq, 2))  # in the order RQ enqueued them
    assert {by_handler.id, by_batch.id} == {job.id for job in dependents}
    before = r.hgetall(by_batch.key)
    parts.endings.succeed(by_handler)
    parts.retirer.submit([by_batch])
    assert parts.retirer.drain().stored == [by_batch]
    after = r.hgetall(by_batch.key)
    changed = {k for k in after if before.get(k) != after[k]}
    assert changed == {b"status", b"ended_at"} and set(after) == set(before) | {b"ended_at"}
    assert job_state(r, by_batch) == job_state(r, by_handler)
    for run in (by_handler, by_batch):
        assert r.smembers(run.job.dependencies_key) == {parent.id.encode()}
        assert 0 < r.ttl(run.job.dependencies_key) <= parts.rq.default_result_ttl
        assert abs(r.ttl(run.key) - r.ttl(run.job.dependencies_key)) <= 1


def test_success_writes_leave_out_what_changes_nothing(parts, r):
    """The job hash: one HSET of the fields that changed; EXPIRE: the dependencies set of a job that has one only,
    no dependents set (the script finds it empty)."""
    (parent,) = finished_runs(parts, r, 1)
    Client(r, queue="rose").submit("after", max_tokens=2, depends_on=parent.id)
    parts.endings.succeed(parent)  # enqueues the dependent
    (dependent,) = finish(parts, start_jobs(parts.rq, 1))
    (plain,) = finished_runs(parts, r, 1)
    commands = rq_store.success_commands(parts.rq, [dependent, plain])
    for run in (dependent, plain):
        (hset,) = [c for c in commands if c[0] == "HSET" and c[1] == run.key]
        assert {str(f) for f in hset[2::2]} == {"status", "ended_at"}
    expired = {c[1] for c in commands if c[0] == "EXPIRE"}
    assert dependent.job.dependencies_key in expired and plain.job.dependencies_key not in expired
    assert not expired & {dependent.job.dependents_key, plain.job.dependents_key}
    recorded = rq_store.success_commands(
        parts.rq, finished_runs(parts, r, 1), slim=False
    )  # RQ's, as recorded
    assert len([c for c in recorded if c[0] == "HSET"]) == 2 and len(recorded) > len(commands) / 2


def test_the_reply_is_read_only_once_redis_has_answered(parts, r):
    runs = finished_runs(parts, r, 2)
    r.client_pause(300, all=True)  # Redis answers nothing for a while: the loop must not wait for it
    assert not parts.retirer.submit(runs).handed_back
    assert not parts.retirer.advance().stored and parts.retirer.busy
    stored = []
    wait_for(
        lambda: stored.extend(parts.retirer.advance().stored) or not parts.retirer.busy, 5, what="the reply"
    )
    assert stored == runs and parts.retirer.batched_jobs == 2


def test_jobs_with_dependents_are_handed_back_for_rqs_handler(parts, r):
    parent, other = finished_runs(parts, r, 2)
    dependent = Client(r, queue="rose").submit("after", max_tokens=1, depends_on=parent.id)
    assert dependent.status() == "deferred"
    parts.retirer.submit([parent, other])
    retired = parts.retirer.drain()
    assert retired.handed_back == [parent, other] and not retired.stored and parts.retirer.batched_jobs == 0
    assert parts.check([parent, other]) == {}  # still ours: RQ's handler stores them
    for run in (parent, other):
        parts.endings.succeed(run)  # enqueues the dependent
    assert Job.fetch(dependent.id, connection=r, serializer=JSONSerializer).get_status() == JobStatus.QUEUED
    assert job_state(r, other)["status"] == JobStatus.FINISHED


def test_a_refused_write_hands_the_batch_back_and_a_check_finds_it_stored(parts, r):
    """A write Redis refuses (here: the results stream key holds a string) does not stop the others; the batch goes
    back to the loop, whose check finds it stored (nothing is stored twice)."""
    runs = finished_runs(parts, r, 2)
    r.set(f"rq:results:{runs[0].id}", "not a stream")
    parts.retirer.submit(runs)
    assert parts.retirer.drain().handed_back == runs
    assert parts.check(runs) == {run.id: Verdict.STORED for run in runs}


def test_a_lost_reply_hands_the_jobs_back_and_a_check_finds_them_stored(parts, r, monkeypatch):
    """The batch reached Redis but its reply was lost with the connection: the jobs go back to the loop, whose check
    finds them stored by this worker (announced, never stored twice)."""
    from rose.worker import resp

    runs = finished_runs(parts, r, 2)
    parts.retirer.submit(runs)
    real_read = resp.Pending.read

    def lost(self, keep=False):
        if keep:  # round 1's replies
            return real_read(self, keep=True)
        wait_for(lambda: r.hget(runs[0].key, "status") == b"finished", 5, what="the batch stored")
        self.abandon()
        raise redis.ConnectionError("connection lost")

    monkeypatch.setattr(resp.Pending, "read", lost)
    assert parts.retirer.drain().handed_back == runs and not parts.retirer.busy
    monkeypatch.setattr(resp.Pending, "read", real_read)
    assert parts.check(runs) == {run.id: Verdict.STORED for run in runs}
    assert all(len(Job.fetch(run.id, connection=r, serializer=JSONSerializer).results()) == 1 for run in runs)


def test_a_job_no_longer_ours_sends_the_batch_back_to_be_checked(parts, r):
    canceled, other = finished_runs(parts, r, 2)
    Client(r, queue="rose").cancel(canceled.id)
    parts.retirer.submit([canceled, other])
    assert parts.retirer.drain().handed_back == [canceled, other] and parts.retirer.batched_jobs == 0
    assert parts.check([canceled, other]) == {canceled.id: Verdict.CANCELED}
    parts.endings.cancel(canceled, "canceled")
    parts.endings.succeed(other)
    assert job_state(r, other)["status"] == JobStatus.FINISHED
    state = job_state(r, canceled)
    assert state["status"] == JobStatus.CANCELED and state["result_type"] is None and not state["execution"]


def test_a_cancel_between_the_two_rounds_aborts_the_batch_and_nothing_is_stored(parts, r, monkeypatch):
    """Round 1 found both jobs ours; a cancel lands before round 2 runs: EXEC writes nothing (the job hash was
    WATCHed), the batch goes back, and the check tells the canceled job from the one still ours."""
    canceled, other = finished_runs(parts, r, 2)
    real_store_commands = batch_store.store_commands

    def cancel_first(*args):
        Client(r, queue="rose").cancel(canceled.id)
        return real_store_commands(*args)

    monkeypatch.setattr(batch_store, "store_commands", cancel_first)
    parts.retirer.submit([canceled, other])
    retired = parts.retirer.drain()
    assert retired.handed_back == [canceled, other] and not retired.stored and parts.retirer.batched_jobs == 0
    assert r.hget(other.key, "status") == b"started" and not r.exists(f"rq:results:{other.id}")
    assert not r.exists(keys.stream_key(other.id))  # its done event was not written either
    assert parts.check([canceled, other]) == {canceled.id: Verdict.CANCELED}


def test_a_dependent_enqueued_between_the_two_rounds_aborts_the_batch(parts, r, monkeypatch):
    """RQ's handler enqueues a job's dependents: one that arrives after round 1 read none aborts EXEC (the
    dependents set is WATCHed too), and RQ's handler, after the check, enqueues it."""
    parent, other = finished_runs(parts, r, 2)
    real_store_commands = batch_store.store_commands
    dependents = []

    def enqueue_dependent_first(*args):
        dependents.append(Client(r, queue="rose").submit("after", max_tokens=1, depends_on=parent.id))
        return real_store_commands(*args)

    monkeypatch.setattr(batch_store, "store_commands", enqueue_dependent_first)
    parts.retirer.submit([parent, other])
    assert parts.retirer.drain().handed_back == [parent, other]
    assert r.hget(parent.key, "status") == b"started" and dependents[0].status() == "deferred"
    assert parts.check([parent, other]) == {}
    parts.endings.succeed(parent)
    assert (
        Job.fetch(dependents[0].id, connection=r, serializer=JSONSerializer).get_status() == JobStatus.QUEUED
    )


def test_a_connection_lost_between_the_rounds_hands_the_batch_back_with_nothing_written(
    parts, r, monkeypatch
):
    runs = finished_runs(parts, r, 2)
    real_store_commands = batch_store.store_commands

    def kill_first(*args):
        r.client_kill_filter(_type="normal", skipme=True)  # every other client: the batch's connection too
        return real_store_commands(*args)

    monkeypatch.setattr(batch_store, "store_commands", kill_first)
    parts.retirer.submit(runs)
    assert parts.retirer.drain().handed_back == runs and not parts.retirer.busy
    for run in runs:
        assert r.hget(run.key, "status") == b"started" and not r.exists(f"rq:results:{run.id}")
    assert parts.check(runs) == {}


def oom_refusals(r) -> int:
    return int(r.info("errorstats").get("errorstat_OOM", {}).get("count", 0))


@pytest.fixture
def full(r):
    """Redis refusing every write for memory while the test says so (`full(True)`)."""

    def fill(on: bool) -> None:
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1 if on else 0)

    yield fill
    fill(False)


def test_a_full_redis_refuses_a_batch_once_and_nothing_is_written(parts, r, full):
    """Round 1's no-op write is refused: round 2 is never sent (one refusal a batch, not one a write), nothing is
    written, and the batch goes back to be retired again (not to RQ's handler: its ends and done events stay one
    transaction), as it is once Redis has room."""
    runs = finished_runs(parts, r, 3)
    r.config_resetstat()
    full(True)
    parts.retirer.submit(runs)
    retired = parts.retirer.drain()
    assert retired.full == runs and not retired.handed_back and not retired.stored
    assert oom_refusals(r) == 1
    full(False)
    assert all(r.hget(run.key, "status") == b"started" for run in runs)
    parts.retirer.submit(runs)  # the same jobs, as the loop sends them again
    assert parts.retirer.drain().stored == runs
    parts.announce(runs)
    for run in runs:
        assert job_state(r, run)["status"] == JobStatus.FINISHED  # an earlier try's writes were no model
        assert [e["type"] for e in stream_events(r, run.id)] == ["done"]


def test_redis_full_between_the_rounds_writes_nothing(parts, r, monkeypatch, full):
    """Round 2's commands are refused as they are queued: EXEC aborts, not one write is done."""
    runs = finished_runs(parts, r, 2)
    real_store_commands = batch_store.store_commands

    def fill_first(*args):
        full(True)
        return real_store_commands(*args)

    monkeypatch.setattr(batch_store, "store_commands", fill_first)
    parts.retirer.submit(runs)
    assert parts.retirer.drain().full == runs
    full(False)
    for run in runs:
        assert r.hget(run.key, "status") == b"started" and r.exists(run.execution.key)
        assert not r.exists(f"rq:results:{run.id}") and not r.exists(keys.stream_key(run.id))
    assert parts.check(runs) == {}


def test_a_failure_rqs_handler_could_not_store_raises_for_the_caller_to_retry(parts, r, monkeypatch):
    """RQ's handle_job_failure logs and swallows a Redis error of its transaction: the ending must not."""
    (run,) = finished_runs(parts, r, 1)
    real_execute = redis.client.Pipeline.execute
    calls = []

    def lost(self, *args, **kwargs):
        if self.command_stack and not calls:  # the handler's transaction, once
            calls.append(1)
            self.reset()
            raise redis.ConnectionError("connection lost")
        return real_execute(self, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", lost)
    with pytest.raises(redis.ConnectionError, match="was not stored"):
        parts.endings.fail(run, "bad input", retry=False)
    assert calls and r.hget(run.key, "status") == b"started"
    parts.endings.fail(run, "bad input", retry=False)
    assert r.hget(run.key, "status") == b"failed"


def stream_sizes(r, run) -> dict[str, int]:
    return {key: r.memory_usage(key) for key in (f"rq:results:{run.id}", keys.stream_key(run.id))}


def test_a_batchs_streams_are_stored_at_their_size_with_their_data_and_expiry(parts, r):
    """Redis gives a new stream 4 KB (its first node's room) that a job's few entries never fill: the batch stores
    RQ's result stream and rose's events again at their size, their entries, ids and expiry unchanged."""
    runs = finished_runs(parts, r, 3)
    parts.retirer.submit(runs)
    assert parts.retirer.drain().stored == runs
    for run in runs:
        sizes = stream_sizes(r, run)
        assert all(size < 2048 for size in sizes.values()), sizes  # ~4.7 KB each without
        for key in sizes:
            assert parts.rq.default_result_ttl - 5 < r.ttl(key) <= parts.rq.default_result_ttl
            info = r.xinfo_stream(key)
            assert info["length"] == info["entries-added"] == 1
            assert info["last-generated-id"] == info["first-entry"][0]
        assert [e["type"] for e in stream_events(r, run.id)] == ["done"]
        assert job_state(r, run)["result_keys"] == sorted(run.result)
    parts.announce(runs)


def blocked_readers_get_the_end(parts, r, redis_server, run, since: str) -> None:
    """A reader blocked on rose's events (XREAD, as `Job.stream()`) and one on RQ's result (`latest_result(timeout)`),
    both from `since`, while `run` is retired: both get its end."""
    got: dict[str, object] = {}

    def read(name: str, key: str) -> None:
        with redis_server.client() as reader:
            got[name] = reader.xread({key: since}, block=10_000)

    threads = [
        threading.Thread(target=read, args=("events", keys.stream_key(run.id))),
        threading.Thread(target=read, args=("result", f"rq:results:{run.id}")),
    ]
    for thread in threads:
        thread.start()
    wait_for(lambda: r.info("clients")["blocked_clients"] == 2, 5, what="two readers blocked")
    parts.retirer.submit([run])
    assert parts.retirer.drain().stored == [run]
    for thread in threads:
        thread.join(10)
    assert json.loads(got["events"][0][1][0][1][b"event"])["type"] == "done"
    assert got["result"][0][1][0][0] == r.xrange(f"rq:results:{run.id}")[0][0]
    parts.announce([run])


def test_readers_waiting_on_a_jobs_streams_get_its_end(parts, r, redis_server):
    """Both readers get the end, written (XADD) and copied at its size in the first batch."""
    (run,) = finished_runs(parts, r, 1)
    blocked_readers_get_the_end(parts, r, redis_server, run, "0-0")


def test_a_streamed_jobs_events_are_copied_at_their_size(parts, r):
    """A stream there before round 2 (a streamed job's events) gets its `done` event by XADD, then is copied onto
    itself at its size, in the first batch and in those that restore the streams they create."""
    retired_twice(parts, r, 1)
    (run,) = finished_runs(parts, r, 1)
    stream = keys.stream_key(run.id)
    for i in range(40):
        r.xadd(stream, {"event": json.dumps({"type": "token", "seq": i, "text": "ab"})})
    entries = r.xrange(stream)
    assert r.memory_usage(stream) > 4096
    parts.retirer.submit([run])
    assert parts.retirer.drain().stored == [run]
    assert r.xrange(stream)[:-1] == entries and r.memory_usage(stream) < 4096
    assert [e["type"] for e in stream_events(r, run.id)][-1] == "done"
    parts.announce([run])


def test_a_large_stream_is_left_as_it_is(parts, r):
    """A stream past the bytes compacted (a large result: its node holds no spare room to win) is not copied."""
    (run,) = finished_runs(parts, r, 1)
    stream = keys.stream_key(run.id)
    r.xadd(stream, {"event": "x" * batch_store.COMPACT_BYTES})
    before = r.memory_usage(stream)
    r.config_resetstat()
    parts.retirer.submit([run])
    assert parts.retirer.drain().stored == [run]
    assert r.xlen(stream) == 2 and r.memory_usage(stream) >= before
    assert r.info("commandstats")["cmdstat_copy"]["calls"] == 1  # RQ's result stream only
    parts.announce([run])


@pytest.mark.parametrize("renamed", [("COPY", "RESTORE"), ("COMMAND", "RESTORE")])
def test_a_redis_without_copy_or_restore_stores_the_batch_as_it_is(tmp_path, renamed):
    """A Redis without COPY (before 6.2, or renamed away), or that will not say (COMMAND renamed away), and without
    RESTORE: the results are stored, the streams left as written."""
    args = [x for command in renamed for x in ("--rename-command", command, "")]
    server = RedisServerProcess(directory=tmp_path, args=args)
    server.start()
    try:
        r = server.client()
        for parts in worker_parts(server):
            for _ in range(2):  # the first batch asks, the second knows
                runs = finished_runs(parts, r, 2)
                parts.retirer.submit(runs)
                assert parts.retirer.drain().stored == runs
                assert all(job_state(r, run)["status"] == JobStatus.FINISHED for run in runs)
                assert all(min(stream_sizes(r, run).values()) > 4096 for run in runs)
                parts.announce(runs)
        r.close()
    finally:
        server.stop()


def test_a_redis_without_copy_restores_the_streams_at_their_size(tmp_path):
    server = RedisServerProcess(directory=tmp_path, args=["--rename-command", "COPY", ""])
    server.start()
    try:
        r = server.client()
        for parts in worker_parts(server):
            sizes = []
            for _ in range(2):  # the first batch asks, the second restores
                runs = finished_runs(parts, r, 2)
                parts.retirer.submit(runs)
                assert parts.retirer.drain().stored == runs
                sizes.append(max(max(stream_sizes(r, run).values()) for run in runs))
                parts.announce(runs)
            assert sizes[0] > 4096 and sizes[1] < 2048, sizes
        r.close()
    finally:
        server.stop()


def test_a_result_stream_too_large_to_copy_is_left_as_it_is(parts, r):
    """RQ's result stream is not there before round 2: its size is what round 2 writes into it; past
    COMPACT_BYTES (a long result) it is not copied."""
    (run,) = finished_runs(parts, r, 1)
    run.result = {**run.result, "text": "x" * batch_store.COMPACT_BYTES}
    r.config_resetstat()
    parts.retirer.submit([run])
    assert parts.retirer.drain().stored == [run]
    assert r.info("commandstats")["cmdstat_copy"]["calls"] == 1  # rose's events only
    assert r.memory_usage(keys.stream_key(run.id)) < 2048
    parts.announce([run])


def test_copy_denied_by_an_acl_leaves_the_writes_standing_and_is_not_tried_again(new_redis_server):
    """COMMAND INFO says Redis has COPY, an ACL denies it (and RESTORE, as `-@dangerous` does): the first batch's
    copies are refused as they are queued, in a transaction of their own, and its results stand, as do those of the
    batch whose RESTORE is refused; later batches copy and restore nothing."""
    r = new_redis_server.client()
    r.acl_setuser(
        "default",
        enabled=True,
        nopass=True,
        commands=["+@all", "-copy", "-restore"],
        keys=["~*"],
        channels=["*"],
    )
    for parts in worker_parts(new_redis_server):
        for _ in range(3):
            runs = finished_runs(parts, r, 2)
            parts.retirer.submit(runs)
            assert parts.retirer.drain().stored == runs
            assert all(job_state(r, run)["status"] == JobStatus.FINISHED for run in runs)
            assert all(min(stream_sizes(r, run).values()) > 4096 for run in runs)  # left as written
            parts.announce(runs)
            stats = r.info("commandstats")
            copies, restores = stats.get("cmdstat_copy", {}), stats.get("cmdstat_restore", {})
            assert copies.get("rejected_calls") == 4 and not copies.get("calls")  # the first batch's only
            assert restores.get("rejected_calls") == 1 and not restores.get("calls")  # its probe only
    r.close()


def retired_twice(parts, r, n: int) -> list:
    """The jobs of a second batch: the first asked whether Redis takes restored streams."""
    for _ in range(2):
        runs = finished_runs(parts, r, n)
        parts.retirer.submit(runs)
        assert parts.retirer.drain().stored == runs
        parts.announce(runs)
    return runs


def test_the_streams_a_batch_creates_are_restored_as_xadd_and_copy_leave_them(parts, r):
    """From the second batch on, a stream round 2 creates (RQ's result, a not-streamed job's events) is RESTOREd at
    its size, its expiry folded in: one command where XADD, EXPIRE, COPY and RENAME were four, and Redis holds it
    byte for byte as an XADD of the same entry (same id) copied at its size, with the same expiry."""
    retired_twice(parts, r, 2)
    r.config_resetstat()
    runs = finished_runs(parts, r, 3)
    parts.retirer.submit(runs)
    assert parts.retirer.drain().stored == runs
    parts.announce(runs)
    stats = r.info("commandstats")
    assert stats["cmdstat_restore"]["calls"] == 6
    assert not any(f"cmdstat_{name}" in stats for name in ("xadd", "copy", "rename"))
    for run in runs:
        for key in (f"rq:results:{run.id}", keys.stream_key(run.id)):
            assert parts.rq.default_result_ttl - 5 < r.ttl(key) <= parts.rq.default_result_ttl
            ((entry_id, fields),) = r.xrange(key)
            r.xadd("as-xadd", fields, id=entry_id)
            r.copy("as-xadd", "as-xadd-copied")
            assert r.dump(key) == r.dump("as-xadd-copied")
            r.delete("as-xadd", "as-xadd-copied")
        assert [e["type"] for e in stream_events(r, run.id)] == ["done"]
        assert job_state(r, run)["result_keys"] == sorted(run.result)
        assert Client(r, queue="rose").job(run.id).result(timeout=1)["token_ids"] == [5, 6]


def test_readers_waiting_on_restored_streams_get_the_end(parts, r, redis_server):
    """RESTORE wakes a reader blocked on the stream it creates, as XADD does."""
    retired_twice(parts, r, 1)
    (run,) = finished_runs(parts, r, 1)
    r.config_resetstat()
    blocked_readers_get_the_end(parts, r, redis_server, run, "$")
    assert r.info("commandstats")["cmdstat_restore"]["calls"] == 2


def test_a_stream_made_between_the_rounds_gets_its_entry_all_the_same(parts, r, monkeypatch):
    """A stream round 1 found not there but that exists by round 2: its RESTORE is refused (BUSYKEY), the other
    writes stand, the entry is written with XADD after all, and later batches restore as before."""
    retired_twice(parts, r, 1)
    (run,) = finished_runs(parts, r, 1)
    real_store_commands = batch_store.store_commands

    def make_first(*args):
        r.xadd(f"rq:results:{run.id}", {"made": "meanwhile"})
        return real_store_commands(*args)

    monkeypatch.setattr(batch_store, "store_commands", make_first)
    parts.retirer.submit([run])
    assert parts.retirer.drain().stored == [run]
    parts.announce([run])
    assert [fields for _, fields in r.xrange(f"rq:results:{run.id}")][0] == {b"made": b"meanwhile"}
    assert Client(r, queue="rose").job(run.id).result(timeout=1)["token_ids"] == [5, 6]
    assert [e["type"] for e in stream_events(r, run.id)] == ["done"]
    monkeypatch.undo()
    r.config_resetstat()
    (later,) = finished_runs(parts, r, 1)
    parts.retirer.submit([later])
    assert parts.retirer.drain().stored == [later]
    assert r.info("commandstats")["cmdstat_restore"]["calls"] == 2
    parts.announce([later])


def test_restore_denied_after_the_probe_hands_the_batch_back_once_then_restores_no_more(new_redis_server):
    """An ACL that denies RESTORE once the probe said yes (a failover to a server set up otherwise): the batch is
    refused as it is queued, nothing written, and goes back to RQ's handler; later batches write XADD and COPY."""
    r = new_redis_server.client()
    for parts in worker_parts(new_redis_server):
        retired_twice(parts, r, 1)
        r.acl_setuser(
            "default", enabled=True, nopass=True, commands=["+@all", "-restore"], keys=["~*"], channels=["*"]
        )
        runs = finished_runs(parts, r, 2)
        parts.retirer.submit(runs)
        assert parts.retirer.drain().handed_back == runs
        r.config_resetstat()
        assert all(r.hget(run.key, "status") == b"started" for run in runs)
        assert parts.check(runs) == {}
        for run in runs:
            parts.endings.succeed(run)  # what the loop does with them: RQ's handler
        later = finished_runs(parts, r, 2)
        parts.retirer.submit(later)
        assert parts.retirer.drain().stored == later
        assert all(max(stream_sizes(r, run).values()) < 2048 for run in later)  # copied
        assert "cmdstat_restore" not in r.info("commandstats")  # not even asked again
        parts.announce(later)
    r.close()


def parsed(error: str) -> Exception:
    """An error reply as redis-py hands it over."""
    return BaseParser.parse_error(error)


@pytest.mark.parametrize(
    ("reply", "restorable"),
    [
        (b"OK", True),
        (parsed("NOPERM User rose-worker has no permissions to run the 'restore' command"), False),
        (parsed("ERR DUMP payload version or checksum are wrong"), False),
        (parsed("ERR unknown command 'RESTORE'"), False),
        (parsed("OOM command not allowed when used memory > 'maxmemory'."), None),
        (parsed("READONLY You can't write against a read only replica."), None),
        (parsed("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."), None),
        (parsed("TRYAGAIN Multiple keys request during rehashing of slot"), None),
        (parsed("BUSY Redis is busy running a script."), None),
    ],
)
def test_what_the_probe_says_of_restore(reply, restorable):
    """Only a refusal of RESTORE itself (denied, unknown, its payload refused) says Redis will not take one; a full
    Redis or one failing over says nothing (asked again)."""
    sent = [("HSET", "k", "f", "v")]
    replies = [b"OK", b"QUEUED", [1], reply]  # MULTI, the write queued, EXEC, the probe
    assert batch_store.stored(replies, sent, probe=True).restorable is restorable


def test_an_xadd_that_must_not_make_its_stream_is_never_restored():
    writes = [
        ("XADD", "s", "NOMKSTREAM", "*", "f", "v"),
        ("XADD", "t", "MAXLEN", "~", "10", "NOMKSTREAM", "*", "f", "v"),
        ("XADD", "u", "MAXLEN", "~", "10", "*", "f", "v"),
    ]
    commands, sent = batch_store.store_commands(writes, [], ["s", "t", "u"], 1_796_001_267_333)
    assert [c[:2] for c in sent] == [("XADD", "s"), ("XADD", "t"), ("RESTORE", "u")]
