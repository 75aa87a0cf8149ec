"""Throwaway processes for `rose bench worker`: the harness's redis-server and rose-worker (rose.harness), set up
for the benchmark, their failures to start turned into BenchProcessError (one clear line from `rose bench`)."""

from __future__ import annotations

import os

from rose.harness import worker_process
from rose.harness.redis_server import RedisServerError, RedisServerProcess


class BenchProcessError(RuntimeError):
    """redis-server or rose-worker could not be started (missing binary, crashed, never ready)."""


class RedisProcess(RedisServerProcess):
    """A throwaway redis-server for the benchmark, started at once (missing binary or failed start:
    BenchProcessError); use it as a context manager, which stops it and removes its directory."""

    def __init__(self, binary: str | None = None, start_timeout: float = 10.0) -> None:
        try:
            super().__init__(binary=binary)
            self.start(start_timeout)
        except RedisServerError as exc:
            raise BenchProcessError(f"`rose bench worker` needs a local Redis: {exc}") from None


class WorkerProcess(worker_process.WorkerProcess):
    """A `rose-worker` subprocess on one queue; ready once registered with RQ and its engine described in Redis
    (`rose:worker:<name>`). `num_threads` is passed as OMP_NUM_THREADS / MKL_NUM_THREADS (torch reads them)."""

    def __init__(
        self,
        redis_url: str,
        queue: str,
        name: str,
        *,
        model: str = "tiny-llama",
        device: str = "cpu",
        dtype: str = "float32",
        max_num_seqs: int = 128,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        num_threads: int | None = None,
        start_timeout: float = 180.0,
    ) -> None:
        args = [
            "--model",
            model,
            "--device",
            device,
            "--dtype",
            dtype,
            "--max-num-seqs",
            str(max_num_seqs),
        ]
        args += ["--queue", queue, "--drain-timeout", "1", "--log-level", "WARNING"]
        if max_model_len is not None:
            args += ["--max-model-len", str(max_model_len)]
        if max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        env = dict(os.environ)
        if num_threads is not None:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(num_threads)
        super().__init__(redis_url, name, args, env=env)
        try:
            self.wait_ready(start_timeout, engine_info=True)
        except (worker_process.WorkerExited, TimeoutError) as exc:
            self.stop()
            raise BenchProcessError(str(exc)) from None
        except BaseException:
            self.stop()
            raise
