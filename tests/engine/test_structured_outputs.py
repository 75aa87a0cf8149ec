"""Structured outputs (rose.engine.grammar): every constraint kind, invalid constraints, the scheduling of requests
whose grammar is compiling, masking (argmax over allowed tokens, logprobs), seeds, prefix caching, abort, and the
proof: hundreds of random-weight requests, constrained or not, batched together, all produce valid outputs."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import replace

import jsonschema
import pytest
import torch
import xgrammar as xgr
from engine_helpers import drain, generate, make_engine, text_prompt

from rose.engine.engine import Engine
from rose.engine.grammar import StructuredOutputManager
from rose.engine.grammar_backends import apply_bitmask_kernel, choice_as_ebnf
from rose.engine.logits_mask import allocate_bitmask
from rose.engine.presets import build_preset
from rose.engine.sampling_params import SamplingParams
from rose.engine.sequence import SequenceStatus
from rose.engine.structured_outputs import StructuredOutputsParams

MAX_MODEL_LEN = 256

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
        "required": ["color", "size"],
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 4,
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
            "flag": {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
        },
        "required": ["id", "tags", "flag"],
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}, "kind": {"const": "x"}},
        "required": ["code", "kind"],
    },
]
REGEXES = [r"[a-z]{3}-\d{2}", r"(yes|no)!", r"\d{1,4}(\.\d{1,2})?", r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)"]
CHOICES = [["yes", "no", "maybe so"], ['say "hi"', "back\\slash", "new\nline", "é中文🌹"]]


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def engine(request) -> Engine:
    """JSON on one line (disable_any_whitespace), so that greedy random-weight rows cannot loop on whitespace; each
    grammar backend in turn."""
    return make_engine(
        "tiny-llama",
        max_num_seqs=64,
        max_model_len=MAX_MODEL_LEN,
        disable_any_whitespace=True,
        structured_outputs_backend=request.param,
    )


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def spaced(request) -> Engine:
    """The default: any whitespace between JSON tokens (vLLM's default)."""
    return make_engine(
        "tiny-llama", max_num_seqs=8, max_model_len=MAX_MODEL_LEN, structured_outputs_backend=request.param
    )


def so(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


def check(params: StructuredOutputsParams, text: str) -> None:
    """Raise unless `text` satisfies the constraint."""
    kind = params.kind
    if kind == "json":
        jsonschema.validate(json.loads(text), params.json)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(params.regex, text), (params.regex, text)
    elif kind == "choice":
        assert text in params.choice, (params.choice, text)
    else:
        raise AssertionError(kind)


def replay_masks(engine: Engine, params: StructuredOutputsParams, tokens: list[int]) -> list[torch.Tensor]:
    """An independent matcher over the same grammar (the engine's backend): the allowed-token mask before each of
    `tokens`."""
    backend = engine.structured_outputs.backend
    matcher = backend.matcher(backend.compile(backend.parse(params)))
    masks = []
    bitmask = allocate_bitmask(1, engine.vocab_size)
    for tok in tokens:
        backend.fill([matcher], bitmask)
        logits = torch.zeros(1, engine.vocab_size)
        apply_bitmask_kernel(logits, bitmask, engine.vocab_size)
        masks.append(logits[0] == 0)
        assert backend.accept(matcher, tok), f"token {tok} refused by the grammar"
    return masks


# ---------------------------------------------------------------------------------------------------- the proof


def test_hundreds_of_constrained_requests_batched_with_unconstrained_ones_are_all_valid(engine):
    constraints = [so(json=s) for s in SCHEMAS] * 20 + [so(regex=r) for r in REGEXES] * 13
    constraints += [so(choice=c) for c in CHOICES] * 25
    constraints = constraints[:200]
    assert len(constraints) == 200
    requests = []
    for i, c in enumerate(constraints):
        params = SamplingParams(temperature=float(i % 2), max_tokens=160, structured_outputs=c, seed=i)
        requests.append((f"c{i}", text_prompt(3 + i % 11, offset=i), params))
    for i in range(24):
        requests.append(
            (f"u{i}", text_prompt(4 + i % 7, offset=i), SamplingParams(temperature=1, max_tokens=40))
        )
    run = generate(engine, requests)
    assert len(run.outputs) == len(requests)
    for i, c in enumerate(constraints):
        out = run.outputs[f"c{i}"]
        assert out.finish_reason == "stop", (c, out.text, len(out.token_ids))
        check(c, out.text)
    assert {run.outputs[f"u{i}"].finish_reason for i in range(24)} <= {"stop", "length"}
    # the grammars were compiled once each, then found in the cache
    stats = engine.get_stats()
    assert stats["structured_output_compiles"] <= len(SCHEMAS) + len(REGEXES) + len(CHOICES)
    assert stats["structured_output_cache_hits"] >= 200 - stats["structured_output_compiles"]
    assert engine.scheduler.num_constrained == 0


def test_every_kind_with_any_whitespace(spaced):
    constraints = [so(json=SCHEMAS[0]), so(json=SCHEMAS[3]), so(json_object=True), so(regex=REGEXES[0])]
    constraints += [so(choice=CHOICES[1]), so(grammar='root ::= "a" ("b" | "c")* "d"')]
    requests = [
        (
            f"k{i}",
            "hello world",
            SamplingParams(temperature=1.0, seed=7 + i, max_tokens=240, structured_outputs=c),
        )
        for i, c in enumerate(constraints)
    ]
    run = generate(spaced, requests)
    for i, c in enumerate(constraints):
        out = run.outputs[f"k{i}"]
        if c.kind == "grammar":
            assert re.fullmatch(r"a[bc]*d", out.text) and out.finish_reason == "stop"
        elif c.kind == "json_object" and out.finish_reason == "length":
            continue  # an unbounded object may run to max_tokens: nothing to validate
        else:
            assert out.finish_reason == "stop", (c, out.text)
            check(c, out.text)


def test_choice_literals_are_escaped():
    ebnf = choice_as_ebnf(['say "hi"', "back\\slash", "new\nline"])
    assert ebnf == 'root ::= "say \\"hi\\"" | "back\\\\slash" | "new\\nline"'
    xgr.Grammar.from_ebnf(ebnf)


# ---------------------------------------------------------------------------------------------------- invalid


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (
            {"regex": "ab[c"},
            r"structured_outputs\.regex is invalid: .*(Unclosed '\['|unclosed character class)",
        ),
        ({"grammar": "root ::= foo"}, r"structured_outputs\.grammar is invalid: .*foo"),
        ({"json": {"type": "nonsense"}}, r"structured_outputs\.json is invalid: .*nonsense"),
        ({"json": {"type": "string", "pattern": "[a"}}, r"structured_outputs\.json is invalid"),
    ],
)
def test_invalid_constraints_raise_at_add_request_and_leave_others_alone(engine, constraint, message):
    alone = generate(engine, [("ref", "bonjour merci", SamplingParams(temperature=0, max_tokens=12))])
    engine.add_request("other", "bonjour merci", SamplingParams(temperature=0, max_tokens=12))
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", "hello", SamplingParams(structured_outputs=constraint))
    assert engine.get_request("bad") is None and engine.num_running + engine.num_waiting == 1
    run = drain(engine, stepped_before=True)
    assert run.outputs["other"].token_ids == alone.outputs["ref"].token_ids


@pytest.mark.parametrize("bad", [{"choice": []}, {"choice": [""]}, {"choice": "yes"}])
def test_invalid_choice_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        SamplingParams(structured_outputs=bad)


def test_constraints_need_a_tokenizer():
    eng = make_engine("tiny-llama", max_num_seqs=2, max_model_len=64)
    eng.tokenizer = None
    with pytest.raises(ValueError, match="need a tokenizer"):
        eng.add_request("r", [5, 6, 7], SamplingParams(structured_outputs={"regex": "a+"}))
    assert not eng.has_unfinished()


# ---------------------------------------------------------------------------------------------------- masking


def test_greedy_constrained_tokens_are_the_argmax_over_allowed_tokens(engine):
    """Reference: transformers' own forward over the whole sequence, masked by an independent matcher."""
    params = so(json=SCHEMAS[0])
    prompt = engine.tokenizer.encode("the queue worker reads")
    run = generate(
        engine, [("g", prompt, SamplingParams(temperature=0, max_tokens=60, structured_outputs=params))]
    )
    out = run.outputs["g"]
    assert out.finish_reason == "stop" and out.token_ids[-1] in engine.eos_token_ids
    check(params, out.text)
    masks = replay_masks(engine, params, out.token_ids)
    model, _ = build_preset("tiny-llama")  # the same weights (fixed seed), with transformers' own attention
    with torch.inference_mode():
        ids = torch.tensor([prompt + out.token_ids])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1, : engine.vocab_size]
    expected = logits.masked_fill(~torch.stack(masks), float("-inf")).argmax(-1).tolist()
    assert out.token_ids == expected
    unmasked = logits.argmax(-1).tolist()
    assert unmasked != expected  # the mask changed what greedy picks (the test can fail)


def test_logprobs_never_show_masked_tokens(engine):
    params = so(json=SCHEMAS[1])
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=60, logprobs=20, structured_outputs=params)
    out = generate(engine, [("lp", "hello", sp)]).outputs["lp"]
    assert out.finish_reason == "stop"
    masks = replay_masks(engine, params, out.token_ids)
    sizes = set()
    for lp, allowed, tok in zip(out.logprobs, masks, out.token_ids, strict=True):
        assert lp.token_id == tok and lp.logprob > float("-inf")
        assert all(allowed[t] for t in lp.top), "a masked token shows in the top logprobs"
        assert len(lp.top) == min(20, int(allowed.sum()))
        # log-softmax over the allowed tokens only: their probabilities sum to 1
        assert sum(torch.tensor(list(lp.top.values())).exp().tolist()) <= 1.0 + 1e-5
        sizes.add(len(lp.top))
    assert min(sizes) < 20  # some steps had fewer than 20 allowed tokens


def test_seeded_constrained_requests_give_the_same_tokens_alone_or_batched(engine):
    sp = [
        SamplingParams(temperature=1.0, seed=11, max_tokens=120, structured_outputs=so(json=SCHEMAS[3])),
        SamplingParams(temperature=0.8, seed=12, max_tokens=40, structured_outputs=so(regex=REGEXES[3])),
    ]
    alone = [
        generate(engine, [(f"a{i}", "hello world", p)]).outputs[f"a{i}"].token_ids for i, p in enumerate(sp)
    ]
    others = [
        (f"o{i}", text_prompt(5, i), SamplingParams(temperature=1.0, max_tokens=30, structured_outputs=c))
        for i, c in enumerate([None, so(json=SCHEMAS[0]), so(choice=CHOICES[0]), None])
    ]
    run = generate(engine, others[:2] + [(f"b{i}", "hello world", p) for i, p in enumerate(sp)] + others[2:])
    assert [run.outputs[f"b{i}"].token_ids for i in range(2)] == alone


def test_min_tokens_and_ignore_eos_end_with_the_grammar(engine):
    sp = SamplingParams(
        temperature=1.0, max_tokens=30, min_tokens=10, ignore_eos=True, structured_outputs=so(choice=["yes"])
    )
    out = generate(engine, [("m", "hello", sp)]).outputs["m"]
    assert out.text == "yes" and out.finish_reason == "stop"
    assert out.token_ids[-1] in engine.eos_token_ids


def test_max_tokens_cuts_a_constrained_request_with_length(engine):
    sp = SamplingParams(temperature=0, max_tokens=3, structured_outputs=so(json=SCHEMAS[0]))
    out = generate(engine, [("cut", "hello", sp)]).outputs["cut"]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_stop_strings_still_apply(engine):
    sp = SamplingParams(
        temperature=0, max_tokens=30, stop=["world"], structured_outputs=so(choice=["hello world"])
    )
    out = generate(engine, [("s", "x", sp)]).outputs["s"]
    assert out.text == "hello " and out.finish_reason == "stop"


# ---------------------------------------------------------------------------------------------------- scheduling


class SlowCompiler:
    """Wraps the backend's compile: each compile waits for `release` (so a test controls when it is done)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.threads: list[str] = []

    def compile(self, grammar):
        self.threads.append(threading.current_thread().name)
        if not self.release.wait(timeout=30):
            raise RuntimeError("test compile never released")
        return self.inner(grammar)


def test_a_compiling_grammar_neither_blocks_the_loop_nor_the_requests_behind_it(engine, monkeypatch):
    manager = engine.structured_outputs
    slow = SlowCompiler(manager.backend.compile)
    monkeypatch.setattr(manager.backend, "compile", slow.compile)
    schema = {"type": "object", "properties": {"slow": {"enum": [1, 2]}}, "required": ["slow"]}
    engine.add_request("slow", "hello", SamplingParams(max_tokens=20, structured_outputs={"json": schema}))
    engine.add_request("next", "hello", SamplingParams(temperature=0, max_tokens=8))
    finished = []
    for _ in range(8):
        t0 = time.perf_counter()
        finished += [o.request_id for o in engine.step() if o.finished]
        assert time.perf_counter() - t0 < 1.0
    assert finished == ["next"]  # admitted and finished behind the waiting request
    assert engine.get_request("slow").block_ids == [] and engine.num_waiting == 1 and engine.has_unfinished()
    assert engine.get_request("slow").status is SequenceStatus.WAITING_FOR_GRAMMAR
    assert slow.threads and all(name.startswith("rose-grammar") for name in slow.threads)
    # only the compiling request is left: step() waits for it instead of spinning
    t0 = time.perf_counter()
    assert engine.step() == []
    assert time.perf_counter() - t0 >= 0.04
    slow.release.set()
    engine.get_request("slow").structured.wait(timeout=30)
    engine.step()  # compiled: admitted, prefilled, and its first token drawn under its grammar
    assert engine.get_request("slow").status is SequenceStatus.RUNNING
    run = drain(engine, stepped_before=True)
    assert run.outputs["slow"].finish_reason == "stop"
    assert json.loads(run.outputs["slow"].text)["slow"] in (1, 2)


def test_a_compile_that_fails_on_the_pool_finishes_its_request_with_error(engine, monkeypatch):
    def failing(grammar):
        raise RuntimeError("out of memory while compiling")

    monkeypatch.setattr(engine.structured_outputs.backend, "compile", failing)
    engine.add_request("fine", "hello", SamplingParams(temperature=0, max_tokens=6))
    engine.add_request(
        "doomed", "hello", SamplingParams(max_tokens=9, structured_outputs={"regex": "z{1,3}q"})
    )
    run = drain(engine)
    assert run.outputs["doomed"].finish_reason == "error" and run.outputs["doomed"].token_ids == []
    assert "structured_outputs.regex" in run.outputs["doomed"].error
    assert "out of memory while compiling" in run.outputs["doomed"].error
    assert run.outputs["fine"].error is None
    assert run.outputs["fine"].finish_reason == "length"
    assert engine.scheduler.num_constrained == 0
    # a later request with the same constraint compiles again (failures are not cached)
    monkeypatch.undo()
    sp = SamplingParams(max_tokens=9, structured_outputs={"regex": "z{1,3}q"})
    assert re.fullmatch("z{1,3}q", generate(engine, [("again", "hello", sp)]).outputs["again"].text)


def test_abort_of_a_constrained_request_frees_its_matcher(engine):
    sp = SamplingParams(temperature=0, max_tokens=100, structured_outputs=so(json=SCHEMAS[3]))
    engine.add_request("ab", "hello", sp)
    engine.add_request("keep", "hello", SamplingParams(temperature=0, max_tokens=5))
    for _ in range(3):
        engine.step()
    seq = engine.get_request("ab")
    assert seq.structured is not None and seq.output_token_ids
    out = engine.abort("ab")
    assert out.finish_reason == "abort" and seq.structured is None
    assert engine.scheduler.num_constrained == 0
    run = drain(engine, stepped_before=True)
    assert run.outputs["keep"].finish_reason == "length" and "ab" not in run.outputs


def test_prefix_caching_with_constraints():
    eng = make_engine(
        "tiny-llama",
        max_num_seqs=4,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=True,
        disable_any_whitespace=True,
        block_size=16,  # the prompt's full blocks are cached
    )
    prompt = text_prompt(40)
    sp = SamplingParams(temperature=0, max_tokens=80, structured_outputs=so(json=SCHEMAS[0]))
    first = generate(eng, [("p1", prompt, sp)]).outputs["p1"]
    second = generate(eng, [("p2", prompt, sp)]).outputs["p2"]
    assert eng.get_stats()["prefix_cache_hit_tokens"] > 0
    assert second.token_ids == first.token_ids and first.finish_reason == "stop"
    check(sp.structured_outputs, second.text)


def test_a_schema_keeps_its_property_order_in_the_cache_and_as_a_string(engine):
    def schema(order):
        props = {name: {"type": "integer", "minimum": 0, "maximum": 9} for name in order}
        return {"type": "object", "properties": props, "required": list(order), "additionalProperties": False}

    params = SamplingParams(temperature=0, max_tokens=32)
    texts = {}
    for rid, constraint in (
        ("za", {"json": schema(["zeta", "alpha"])}),
        ("az", {"json": schema(["alpha", "zeta"])}),  # same properties, other order: not the cached grammar
        ("za-str", {"json": json.dumps(schema(["zeta", "alpha"]))}),  # as a JSON string: compiled as written
    ):
        engine.add_request(rid, "hello", replace(params, structured_outputs=constraint))
        texts[rid] = drain(engine).outputs[rid].text
    assert list(json.loads(texts["za"])) == ["zeta", "alpha"]
    assert list(json.loads(texts["az"])) == ["alpha", "zeta"]
    assert list(json.loads(texts["za-str"])) == ["zeta", "alpha"]


def test_the_cpu_masks_equal_xgrammars_kernel_on_a_partly_constrained_batch(engine):
    tok = engine.tokenizer
    managers = {
        backend: StructuredOutputManager(
            tok, engine.vocab_size, engine.eos_token_ids, engine.device, mask_backend=backend
        )
        for backend in ("lookup", "numba", "xgrammar")
    }
    logits = torch.randn(5, engine.vocab_size, generator=torch.Generator().manual_seed(0))
    masked = {}
    for backend, manager in managers.items():
        reqs = [manager.make_request(so(regex="[0-9]{2}-x")), manager.make_request(so(choice=["yes", "no"]))]
        for r in reqs:
            r.wait()
        assert reqs[0].advance(tok.encode("1")[0]) is False  # one step into the first grammar
        out = logits.clone()
        manager.apply_grammar_bitmask(out, [None, reqs[0], None, reqs[1], None])
        masked[backend] = out
        manager.shutdown()
    assert torch.equal(masked["lookup"], masked["xgrammar"]) and torch.equal(
        masked["numba"], masked["xgrammar"]
    )
    for row in (0, 2, 4):  # unconstrained rows untouched
        assert torch.equal(masked["lookup"][row], logits[row])
    allowed = masked["lookup"][[1, 3]].isfinite().sum(dim=1).tolist()
    assert 0 < allowed[0] < engine.vocab_size and 0 < allowed[1] < engine.vocab_size
    assert managers["lookup"].get_stats()["structured_output_masked_rows"] == 2


def test_a_grammar_that_compiles_too_long_fails_its_request_alone(engine, monkeypatch):
    """Past the manager's compile_timeout the waiting request finishes "error" with the reason; the others run."""
    manager = engine.structured_outputs
    slow = SlowCompiler(manager.backend.compile)
    monkeypatch.setattr(manager.backend, "compile", slow.compile)
    monkeypatch.setattr(manager, "compile_timeout", 0.2)
    schema = {"type": "object", "properties": {"too_slow": {"enum": [1, 2]}}, "required": ["too_slow"]}
    engine.add_request("slow", "hello", SamplingParams(max_tokens=8, structured_outputs={"json": schema}))
    engine.add_request("next", "hello", SamplingParams(temperature=0, max_tokens=4))
    try:
        run = drain(engine)
    finally:
        slow.release.set()
    assert run.outputs["slow"].finish_reason == "error" and run.outputs["slow"].token_ids == []
    assert run.outputs["slow"].error == "structured_outputs.json: compiling it took longer than 0.2 s"
    assert run.outputs["next"].finish_reason == "length"
