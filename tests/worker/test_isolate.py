"""rose.worker.isolate against a model of the engine: which requests are present, which make a step raise."""

from __future__ import annotations

from types import SimpleNamespace

from rose.worker.isolate import isolate


class Model:
    def __init__(self, present: list[str], bad: set[str], transient: int = 0):
        self.present, self.bad, self.transient, self.steps = list(present), bad, transient, 0

    def step(self):
        self.steps += 1
        if self.transient:
            self.transient -= 1
            raise RuntimeError("transient")
        hit = [r for r in self.present if r in self.bad]
        if hit:
            raise ValueError(f"bad {hit[0]}")
        return [SimpleNamespace(request_id=r, new_token_ids=[1], finished=False) for r in self.present]


def run(model: Model, suspects: list[str]):
    return isolate(model.step, suspects, model.present.remove, model.present.append)


def test_several_culprits_among_many_are_found_and_only_they_stay_out():
    ids = [f"r{i}" for i in range(16)]
    model = Model(["old", *ids], bad={"r3", "r11"})
    found = run(model, ids)
    assert set(found.culprits) == {"r3", "r11"} and found.error is None
    assert str(found.culprits["r3"]) == "bad r3"
    assert sorted(model.present) == sorted(["old", *(i for i in ids if i not in {"r3", "r11"})])
    assert all(o.request_id not in found.culprits for o in found.outputs)


def test_a_transient_error_blames_nobody():
    model = Model(["a", "b"], bad=set(), transient=0)
    found = run(model, ["a", "b"])
    assert found.culprits == {} and found.error is None and sorted(model.present) == ["a", "b"]


def test_an_error_without_the_suspects_is_returned_and_they_are_put_back():
    model = Model(["old", "new"], bad={"old"})
    found = run(model, ["new"])
    assert str(found.error) == "bad old" and found.culprits == {}
    assert sorted(model.present) == ["new", "old"]
