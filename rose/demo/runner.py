"""What `rose demo` runs: an embedded Redis, a rose worker in a thread, producer threads, a view; then cleanup."""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rose.demo.embedded import EmbeddedRedis, RedisMode
from rose.demo.view import Column, PlainView, make_view

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = ("Once upon a time", "The weather today is", "def fibonacci(n):", "Bonjour, je m'appelle")
# One set of sampling settings per column, cycled when more prompts are given.
SETTINGS: tuple[dict[str, Any], ...] = (
    {"temperature": 0.0},
    {"temperature": 0.7, "top_p": 0.9, "seed": 1},
    {"temperature": 1.0, "top_k": 40, "seed": 2},
    {"temperature": 1.2, "repetition_penalty": 1.3, "seed": 3},
)


@dataclass
class DemoOptions:
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    model: str = "tiny-llama"
    device: str = "cpu"
    max_tokens: int = 48
    redis: RedisMode = "auto"
    duration_limit: float = 120.0
    plain: bool = False


def _quiet_worker_logs() -> None:
    """RQ logs every job at INFO on its own logger, and the worker warns when it is told to stop: noise in the
    demo's display unless the user asked for more (`rose --log-level INFO demo`)."""
    if logging.getLogger().getEffectiveLevel() < logging.WARNING:
        return
    for name in ("rq.worker", "rq.job", "rq.queue"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("rose.worker").setLevel(logging.ERROR)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _settings_text(options: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in options.items())


class Demo:
    def __init__(self, opts: DemoOptions):
        self.opts = opts
        self.options = [
            {**SETTINGS[i % len(SETTINGS)], "max_tokens": opts.max_tokens} for i in range(len(opts.prompts))
        ]
        self.columns = [
            Column(prompt=p, settings=_settings_text(o))
            for p, o in zip(opts.prompts, self.options, strict=True)
        ]
        self.view: PlainView = make_view(self.columns, opts.plain)
        self.events: queue.Queue[tuple[str, int, Any]] = queue.Queue()
        self.results: list[dict[str, Any] | None] = [None] * len(opts.prompts)
        self.stop_event = threading.Event()
        self.redis: EmbeddedRedis | None = None
        self.worker: Any = None
        self.worker_thread: threading.Thread | None = None
        self.worker_error: BaseException | None = None
        self.client: Any = None
        self.producers: list[threading.Thread] = []

    # ---- set-up -----------------------------------------------------------------------------------------------

    def _start_worker(self) -> None:
        from rose.config import WorkerSettings
        from rose.engine.presets import is_preset
        from rose.worker.cli import build_engine
        from rose.worker.worker import RoseWorker

        assert self.redis is not None
        longest = max(len(p.encode()) for p in self.opts.prompts)
        settings = WorkerSettings(
            redis_url=self.redis.url,
            queues=[f"rose-demo-{uuid.uuid4().hex[:8]}"],
            name=f"rose-demo-{uuid.uuid4().hex[:8]}",
            model=self.opts.model,
            device=self.opts.device,
            max_num_seqs=max(4, len(self.opts.prompts)),
            # presets: a small KV store is enough (and quick to allocate); other models keep their own context
            max_model_len=min(4096, self.opts.max_tokens + longest + 64)
            if is_preset(self.opts.model)
            else None,
            drain_timeout=5,
            log_level="WARNING",
        )
        _quiet_worker_logs()
        engine = build_engine(settings)
        self._note_kernel_compile(engine)
        self.worker = RoseWorker(
            settings.queues, engine=engine, connection=self.redis.client(), settings=settings
        )
        self.worker_thread = threading.Thread(target=self._run_worker, name="rose-demo-worker", daemon=True)
        self.worker_thread.start()
        self.view.info(
            f"worker {self.worker.name}: model {self.opts.model} on {getattr(engine, 'device', '?')}, "
            f"queue {settings.queues[0]}"
        )

    def _note_kernel_compile(self, engine: Any) -> None:
        """The first run on a machine compiles the CPU decode kernels (numba; cached on disk afterwards) and its
        first tokens come at a few per second: say why, once, rather than look slow."""
        from rose.engine import cpu_attention

        if getattr(getattr(engine, "cache", None), "use_cpu_kernels", False) and (
            cpu_attention.kernels_cached() is False
        ):
            self.view.info("compiling CPU kernels (numba), first run only: the first tokens come slowly")

    def _run_worker(self) -> None:
        try:
            self.worker.work()
        except BaseException as exc:
            self.worker_error = exc
            log.exception("the demo worker stopped with an error")

    def _produce(self, i: int) -> None:
        """One producer: submit a job, forward its token deltas, then fetch its stored result."""
        from rose.jobs.client import JobCanceled, JobFailed

        limit = self.opts.duration_limit
        try:
            job = self.client.submit(self.opts.prompts[i], **self.options[i], result_ttl=600)
            self.events.put(("submitted", i, job.id))
            for delta in job.stream(timeout=limit):
                if self.stop_event.is_set():
                    return
                self.events.put(("delta", i, delta))
            self.events.put(("result", i, job.result(timeout=limit)))
        except JobFailed as exc:
            self.events.put(("ended", i, f"failed: {exc.message}"))
        except JobCanceled as exc:
            self.events.put(("ended", i, f"canceled: {exc.reason}"))
        except Exception as exc:
            if not self.stop_event.is_set():
                self.events.put(("ended", i, f"error: {exc!r}"))

    # ---- run --------------------------------------------------------------------------------------------------

    def run(self) -> int:
        """0: every job finished; 1: a job failed or the time limit was hit. Ctrl-C / SIGTERM raise
        KeyboardInterrupt here after everything is stopped."""
        started = time.monotonic()
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            self.redis = EmbeddedRedis.start(self.opts.redis)
            self.view.info(f"rose demo: embedded {self.redis.describe()}")
            self._start_worker()
            from rose.jobs.client import Client

            self.client = Client(self.redis.client(), queue=self.worker.queue_names()[0])
            code = self._loop(started + self.opts.duration_limit)
            if code == 0:
                self.view.results(self.results)
            return code
        finally:
            self.view.stop()
            self._cleanup()
            self.view.info(f"rose demo: stopped worker and Redis after {time.monotonic() - started:.1f} s")
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _loop(self, deadline: float) -> int:
        self.producers = [
            threading.Thread(target=self._produce, args=(i,), name=f"rose-demo-producer-{i}", daemon=True)
            for i in range(len(self.columns))
        ]
        self.view.start()
        for t in self.producers:
            t.start()
        ended = 0
        failed = False
        while ended < len(self.columns):
            if time.monotonic() > deadline:
                self.view.stop()
                self.view.info(f"rose demo: --duration-limit of {self.opts.duration_limit:g} s reached")
                return 1
            if self.worker_thread is not None and not self.worker_thread.is_alive():
                self.view.stop()
                self.view.info(f"rose demo: the worker stopped unexpectedly: {self.worker_error!r}")
                return 1
            try:
                kind, i, value = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            if kind == "submitted":
                self.columns[i].job_id = value
                self.view.submitted(i)
            elif kind == "delta":
                self.view.delta(i, value)
            elif kind == "result":
                self.results[i] = {"job_id": self.columns[i].job_id, **value}
                self.view.ended(i, "finished")
                ended += 1
            else:
                self.view.ended(i, value)
                failed = True
                ended += 1
        return 1 if failed else 0

    def _cleanup(self) -> None:
        """Cancel what still runs, stop the worker (as SIGTERM twice would), join everything, stop Redis."""
        self.stop_event.set()
        if self.client is not None:
            for col in self.columns:
                if col.job_id and col.status not in ("finished",):
                    try:
                        self.client.cancel(col.job_id)
                    except Exception:
                        log.debug("could not cancel %s", col.job_id, exc_info=True)
        if self.worker is not None and self.worker_thread is not None:
            self.worker.request_stop(signal.SIGTERM, None)
            self.worker.request_stop(signal.SIGTERM, None)
            self.worker_thread.join(timeout=30)
            if self.worker_thread.is_alive():
                log.warning("the demo worker did not stop within 30 s")
        for t in self.producers:
            t.join(timeout=5)
        if self.redis is not None:
            self.redis.close()
