"""Helpers for the worker tests: a fake engine, a worker in a thread, waiting, reading streams."""

from __future__ import annotations

import threading
import time

from rose.config import WorkerSettings
from rose.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepOutput, TokenLogprob
from rose.engine.sampling_params import SamplingParams
from rose.harness import worker_process
from rose.harness.job_audit import last_attempt, stream_events
from rose.harness.worker_process import wait_for
from rose.jobs.contract import parse
from rose.worker import RoseWorker, probe
from rose.worker.intake import Intake
from rose.worker.probe import Target
from rose.worker.rq_worker import RQWorker
from rose.worker.running import Running

__all__ = [
    "FakeEngine",
    "TinyWorker",
    "WorkerThread",
    "check_stream",
    "enqueue",
    "probe_target",
    "registered_rq_worker",
    "start_jobs",
    "status",
    "stream_events",
    "wait_for",
    "wait_status",
]


def enqueue(q, **kwargs):
    rq_opts = {
        k: kwargs.pop(k) for k in list(kwargs) if k in ("job_timeout", "result_ttl", "retry", "job_id")
    }
    kwargs.setdefault("max_tokens", 3)
    return q.enqueue("rose.jobs.generate", kwargs=kwargs, **rq_opts)


def status(r, job) -> str:
    return r.hget(job.key, "status").decode()


def wait_status(r, job, want: str, timeout: float = 10):
    wait_for(lambda: status(r, job) == want, timeout, what=f"job {job.id} {want} (is {status(r, job)})")


def check_stream(r, job_id: str, terminal: str) -> list[dict]:
    # the terminal event is published right after the job's status is stored
    wait_for(
        lambda: stream_events(r, job_id)[-1:] and stream_events(r, job_id)[-1]["type"] == terminal,
        5,
        what=f"{terminal} event of {job_id}",
    )
    events = last_attempt(stream_events(r, job_id))
    types = [e["type"] for e in events]
    assert types[-1] == terminal and types.count(terminal) == 1, types
    tokens = [e for e in events if e["type"] == "token"]
    assert [e["seq"] for e in events if "seq" in e] == list(range(len(tokens) + 1))
    return events


def registered_rq_worker(redis_server, name: str, queues=("rose",)) -> RQWorker:
    """RQ's side of a rose-worker (rose.worker.rq_worker), registered with RQ, with no loop: tests start jobs with
    `start_jobs` and drive the worker's parts (retirer, watch, endings) through their public methods."""
    worker = RQWorker(
        list(queues),
        name=name,
        connection=redis_server.client(),
        on_command=lambda command: None,
        socket_timeout=10,
        worker_ttl=60,
    )
    worker.register_birth()
    return worker


def start_jobs(rq: RQWorker, n: int) -> list[Running]:
    """Start `n` queued jobs on `rq`, as rose-worker's intake does (phase TAKEN, requests parsed)."""
    runs = Intake(rq).take(n, None)
    assert len(runs) == n, runs
    for run in runs:
        request = parse(run.job, run.queue.name, rq.queue_names(), trust_chat_template=False)
        assert not isinstance(request, str), request
        run.request = request
    return runs


def probe_target(rq: RQWorker) -> Target:
    return probe.target(rq)


class WorkerThread:
    """A RoseWorker running in a background thread (no signal handlers there: stop() does what SIGTERM does)."""

    def __init__(self, redis_server, queues, engine, **settings):
        settings.setdefault("redis_url", redis_server.url)
        settings.setdefault("recovery_interval", 0.5)
        settings.setdefault("drain_timeout", 5)
        self.settings = WorkerSettings(queues=queues, **settings)
        self.engine = engine
        self.worker = RoseWorker(
            queues, engine=engine, connection=redis_server.client(), settings=self.settings
        )
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            self.worker.work()
        except BaseException as exc:  # surfaced by stop()
            self.error = exc
            raise

    def start(self) -> WorkerThread:
        self.thread.start()
        wait_for(lambda: self.worker.started or self.error, what="worker start")
        return self

    def stop(self, force: bool = False, timeout: float = 30) -> None:
        if self.thread.is_alive():
            self.worker.request_stop(15, None)
            if force:
                self.worker.request_stop(15, None)
            self.thread.join(timeout)
        assert not self.thread.is_alive(), "worker did not stop"
        if self.error:
            raise self.error


class FakeEngine:
    """Each step gives every running request one token: id k, text f"w{k} " for the k-th generated token. A
    rose.worker.engine_protocol.WorkerEngine, with no paged store (no KV blocks) and no dtype."""

    dtype = None
    kv_blocks_used = kv_blocks_total = 0

    def __init__(self, max_num_seqs: int = 4, max_model_len: int = 64, step_delay: float = 0.0):
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.model_name = "fake"
        self.device = "cpu"
        self.tokenizer = object()
        self.requests: dict[str, dict] = {}
        self.order: list[str] = []
        self.fail_next_step: Exception | None = None  # a transient error: the next step raises it, once
        self.poison: set[str] = (
            set()
        )  # prompts (or request ids) under which every step raises, as a bad input would
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.loras: dict[str, object] = {}  # request id -> the LoRARequest it was added with (None: base)
        self.deadlines: dict[str, float | None] = {}  # request id -> the deadline it was added with
        self.steps = 0

    def add_request(self, request_id, prompt, params=None, *, priority=0, lora_request=None, deadline=None):
        params = params or SamplingParams()
        ids = list(prompt) if isinstance(prompt, list) else list(range(len(prompt.split())))
        if not ids:
            raise ValueError("empty prompt")
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id}")
        if len(ids) + (params.max_tokens or 0) > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"({self.max_model_len} tokens)"
            )
        self.requests[request_id] = {
            "ids": ids,
            "prompt": prompt if isinstance(prompt, str) else None,
            "params": params,
            "out": [],
            "text": "",
            "metrics": RequestMetrics(arrival_time=time.time(), num_prompt_tokens=len(ids)),
        }
        self.loras[request_id] = lora_request
        self.deadlines[request_id] = deadline
        self.order.append(request_id)
        self.added.append(request_id)

    def _output(self, rid, reason):
        req = self.requests[rid]
        return RequestOutput(
            request_id=rid,
            prompt=None,
            prompt_token_ids=req["ids"],
            outputs=[CompletionOutput(0, req["text"], list(req["out"]), reason)],
            metrics=req["metrics"],
        )

    def abort(self, request_id):
        if request_id not in self.requests:
            return None
        self.aborted.append(request_id)
        out = self._output(request_id, "abort")
        del self.requests[request_id]
        self.order.remove(request_id)
        return out

    def has_unfinished(self):
        return bool(self.requests)

    @property
    def num_running(self):
        return min(len(self.requests), self.max_num_seqs)

    @property
    def num_waiting(self):
        return max(0, len(self.requests) - self.max_num_seqs)

    def num_admittable(self):
        return max(0, self.max_num_seqs - len(self.requests))

    def get_stats(self):
        return {}

    def step(self):
        self.steps += 1
        if self.fail_next_step is not None:
            exc, self.fail_next_step = self.fail_next_step, None
            raise exc
        for rid in self.order[: self.max_num_seqs]:
            if rid in self.poison or self.requests[rid]["prompt"] in self.poison:
                raise ValueError(f"Overflow when unpacking long long (simulated, {rid})")
        if self.step_delay:
            time.sleep(self.step_delay)
        outs = []
        now = time.time()
        for rid in list(self.order[: self.max_num_seqs]):
            req = self.requests[rid]
            k = len(req["out"])
            text = f"w{k} "
            req["out"].append(k)
            req["text"] += text
            m = req["metrics"]
            m.first_token_time = m.first_token_time or now
            done = len(req["out"]) >= (req["params"].max_tokens or 16)
            top = req["params"].logprobs
            out = StepOutput(
                request_id=rid,
                new_token_ids=[k],
                new_text=text,
                finished=done,
                finish_reason="length" if done else None,
                # token k at -k/10, the alternatives k+1, k+2, ... below it
                new_logprobs=None
                if top is None
                else [TokenLogprob(k, -k / 10, {k + j: -(k + j) / 10 for j in range(top)})],
            )
            if done:
                m.finished_time = now
                out.output = self._output(rid, "length")
                del self.requests[rid]
                self.order.remove(rid)
            outs.append(out)
        return outs


class TinyWorker(worker_process.WorkerProcess):
    """The real rose-worker process on tiny-llama (CPU), scanning for orphans every second, logging to `log_path`;
    `fault`: its ROSE_FAULT_POINT (rose.worker.faults)."""

    def __init__(self, server, log_path, name: str, *args: str, fault: str | None = None):
        import os

        env = {**os.environ, "ROSE_FAULT_POINT": fault} if fault else None
        defaults = ["--model", "tiny-llama", "--device", "cpu", "--recovery-interval", "1"]
        super().__init__(server.url, name, [*defaults, *args], log_path=log_path, env=env)
