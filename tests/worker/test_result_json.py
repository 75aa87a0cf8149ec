"""The JSON the worker writes through RQ (rose.worker.rq_worker.CompactJSONSerializer): results without spaces and
with their text as UTF-8, which producers read with RQ's JSONSerializer as before."""

from __future__ import annotations

import base64
import json

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer
from test_retirer import finished_runs, worker_parts

from rose.jobs import keys
from rose.jobs.client import Client
from rose.worker.rq_worker import CompactJSONSerializer


@pytest.fixture
def parts(redis_server, r):
    yield from worker_parts(redis_server)


def test_results_are_stored_as_compact_utf8_json_that_rqs_serializer_reads(parts, r):
    """The worker's serializer writes a result without spaces and its text as UTF-8 (RQ base64s it: every byte
    counts four thirds), through the batch and through RQ's own handler alike; producers read it unchanged."""
    by_handler, *batch = finished_runs(parts, r, 3)
    for run in (by_handler, *batch):
        run.result["text"] = "héllo 世界 \U0001f339"
        run.result["token_ids"] = [5, 6, 151643]
    parts.endings.succeed(by_handler)
    parts.retirer.submit(batch)
    assert parts.retirer.drain().stored == batch
    for run in (by_handler, *batch):
        ((_, fields),) = r.xrange(keys.rq_results_key(run.id))
        raw = base64.b64decode(fields[b"return_value"])
        assert raw == json.dumps(run.result, separators=(",", ":"), ensure_ascii=False).encode()
        assert "世界".encode() in raw and b", " not in raw and b": " not in raw
        assert Client(r, queue="rose").job(run.id).result(timeout=1) == run.result
        assert Job.fetch(run.id, connection=r, serializer=JSONSerializer).return_value() == run.result
    parts.announce(batch)


def test_a_lone_surrogate_is_written_escaped():
    """A value holding what UTF-8 cannot (a lone surrogate, which a producer's JSON can carry) is written all-ASCII,
    still without spaces."""
    value = {"metadata": {"note": "\udc80"}, "text": "é"}
    written = CompactJSONSerializer.dumps(value)
    assert written == b'{"metadata":{"note":"\\udc80"},"text":"\\u00e9"}'
    assert JSONSerializer.loads(written) == value
