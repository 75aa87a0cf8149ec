from __future__ import annotations

import pytest
from rq import Queue
from rq.serializers import JSONSerializer
from worker_helpers import FakeEngine, WorkerThread


@pytest.fixture
def run_worker(redis_server, r):
    started: list[WorkerThread] = []

    def start(queues=("rose",), engine=None, **settings) -> WorkerThread:
        wt = WorkerThread(redis_server, list(queues), engine or FakeEngine(), **settings).start()
        started.append(wt)
        return wt

    yield start
    for wt in started:
        if wt.thread.is_alive():
            wt.stop(force=True)


@pytest.fixture
def q(r):
    return Queue("rose", connection=r, serializer=JSONSerializer)
