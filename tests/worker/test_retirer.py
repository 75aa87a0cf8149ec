"""rose.worker.retirer: finished jobs' results stored off the loop's thread; failures handed back to the loop."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import redis

from rose.worker.retirer import Retirer


def _run(job_id: str):
    return SimpleNamespace(id=job_id, retire_inline=False)


def test_stores_in_order_off_the_calling_thread():
    stored, threads = [], set()
    gate = threading.Event()

    def store(run):
        gate.wait(5)
        threads.add(threading.current_thread().name)
        stored.append(run.id)

    retirer = Retirer(store, (redis.ConnectionError,))
    retirer.start()
    for i in range(3):
        retirer.submit(_run(f"j{i}"))
    assert retirer.busy  # handed over, not stored yet: the worker must not exit
    gate.set()
    assert retirer.wait_idle(5)
    assert stored == ["j0", "j1", "j2"]
    assert threads == {"rose-retirer"}
    assert not retirer.busy and retirer.take_failed() == []
    retirer.close()
    assert not retirer.running


def test_failures_go_back_to_the_loop_marked_inline():
    def store(run):
        if run.id == "down":
            raise redis.ConnectionError("connection refused")
        if run.id == "bug":
            raise KeyError("oops")

    retirer = Retirer(store, (redis.ConnectionError,))
    retirer.start()
    runs = [_run("ok"), _run("down"), _run("bug")]
    for run in runs:
        retirer.submit(run)
    assert retirer.wait_idle(5)
    failed = retirer.take_failed()
    assert [r.id for r in failed] == ["down", "bug"]
    assert all(r.retire_inline for r in failed) and not runs[0].retire_inline
    assert retirer.take_failed() == []
    retirer.close()
