"""rose.worker.engine_protocol.WorkerEngine: every engine a worker runs has its members, and the worker reads nothing of
an engine that the Protocol does not list."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from worker_helpers import FakeEngine

from rose.bench.sim_engine import SimEngine
from rose.worker.engine_protocol import WorkerEngine

WORKER = Path(__file__).resolve().parents[2] / "rose" / "worker"


def members() -> set[str]:
    return {name for name in vars(WorkerEngine) if not name.startswith("_")}


def read_by_worker() -> set[str]:
    """The attributes rose/worker/ reads of an engine (`engine.x`, `self.engine.x`, `worker.engine.x`), but
    cli.py's: it builds the concrete Engine (and closes it)."""
    read = set()
    for path in WORKER.glob("*.py"):
        if path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            value = node.value
            if (isinstance(value, ast.Name) and value.id == "engine") or (
                isinstance(value, ast.Attribute) and value.attr == "engine"
            ):
                read.add(node.attr)
    return read


def test_the_protocol_lists_what_the_worker_reads():
    assert read_by_worker() == members()


@pytest.mark.parametrize("engine", [FakeEngine(), SimEngine()], ids=["FakeEngine", "SimEngine"])
def test_stand_ins_are_worker_engines(engine):
    assert isinstance(engine, WorkerEngine)


def test_the_engine_is_a_worker_engine():
    from rose.engine.engine import Engine
    from rose.engine.presets import build_preset

    model, tok = build_preset("tiny-gpt2")
    engine = Engine(model, tok, device="cpu", max_num_seqs=2, max_model_len=32)
    try:
        assert isinstance(engine, WorkerEngine)
        assert engine.kv_blocks_total > 0 and engine.num_admittable() > 0
    finally:
        engine.close()
