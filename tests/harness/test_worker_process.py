"""rose.harness.worker_process: the helper benchmarks and end-to-end tests drive rose-worker with."""

from __future__ import annotations

import pytest

from rose.harness.worker_process import WorkerExited, WorkerProcess, wait_for


def test_wait_for_returns_the_value_or_raises_the_given_error():
    calls = iter([0, None, "ready"])
    assert wait_for(lambda: next(calls), 5, "a value", interval=0.01) == "ready"

    class Boom(Exception):
        pass

    with pytest.raises(Boom, match="timed out after 0 s waiting for nothing"):
        wait_for(lambda: False, 0.05, "nothing", interval=0.01, error=Boom)


@pytest.mark.timeout(120)
def test_a_worker_that_exits_is_reported_with_its_log(unused_port, tmp_path):
    url = f"redis://127.0.0.1:{unused_port}/0"  # nothing listens there: rose-worker exits at once
    proc = WorkerProcess(
        url, "doomed", ["--model", "tiny-llama", "--device", "cpu"], log_path=tmp_path / "w.log"
    )
    with pytest.raises(WorkerExited, match="(?s)rose-worker exited with [1-9].*Redis"):
        proc.wait_ready(60)
    assert proc.proc.poll() is not None
    proc.stop()
    assert (tmp_path / "w.log").exists()  # a log the caller named is kept


def test_own_log_is_removed_on_stop(unused_port):
    proc = WorkerProcess(f"redis://127.0.0.1:{unused_port}/0", "doomed", ["--model", "tiny-llama"])
    assert proc.wait(60) != 0
    assert proc.log_path.exists()
    proc.stop()
    assert not proc.log_path.exists()
