"""Structured-output conformance on real vocabularies: the whole schema corpus (tests/engine/structured_corpus.py)
through rose's engine, per grammar backend x real tokenizer x pushed model, at temperature 1 with fixed seeds.

    python3 benchmarks/structured_conformance.py                       # both backends, tokenizers and pushes
    python3 benchmarks/structured_conformance.py --tokenizers phi-3-mini-4k-instruct --seeds 4 --json-out r.json

Models are tiny random-weight Llamas over each tokenizer's vocabulary (tests/engine/real_tokenizers.py), pushed
toward tokens that close JSON quickly ("short") or toward whitespace ("whitespace"): what is measured is what the
grammar backend allows, not what a model would say. Per combination it prints:

* valid stop: finished "stop" and `rose.engine.structured_check.violation` finds nothing;
* invalid: finished "error" with `structured_output_error` (the engine's check caught an output the backend's
  mask let through), listed after the table with the violation;
* length: cut by --max-tokens (not checked: the text may be unfinished JSON);
* refused: `add_request` raised ValueError (the backend's parser refused the schema), and compile errors (the
  compile on the pool failed: the request finished "error" without `structured_output_error`);
* compile p50 / p99 / max: each schema's grammar compiled alone, before any generation (the manager's
  `make_request(...).wait()`, one schema at a time), timed as the difference in `get_stats()`'s
  `structured_output_compile_s`: the pool's time inside the backend's compile, for this tokenizer's vocabulary
  (the generation pass then finds every grammar in the engine's cache). With ~60 schemas, p99 (nearest rank) is the
  slowest. xgrammar compiles the token masks ahead of time; llguidance ("guidance") builds them lazily while masking,
  so its compile is a validation and its cost shows in mask/row instead;
* mask/row: `structured_output_mask_s / structured_output_masked_rows` over the generation pass: the mean time
  to fill and apply one constrained row's token mask in a step;
* max gap: the longest whitespace run between JSON tokens of any output (the engine bounds it by
  `max_json_whitespace`, default rose.engine.structured_outputs.DEFAULT_MAX_JSON_WHITESPACE).

Run on the CPU with one torch thread (`--threads`), as the tests do; the grammar compiles use the engine's own
pool (xgrammar: one thread on a CPU engine).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "engine"))  # the corpus and the tokenizer helpers live with the tests

import torch  # noqa: E402
from real_tokenizers import PUSHES, TOKENIZER_NAMES, load_tokenizer, pushed_model  # noqa: E402
from structured_corpus import CORPUS, longest_whitespace_gap  # noqa: E402

from rose.engine.engine import Engine  # noqa: E402
from rose.engine.sampling_params import SamplingParams  # noqa: E402
from rose.engine.structured_check import violation  # noqa: E402
from rose.engine.structured_outputs import (  # noqa: E402
    DEFAULT_MAX_JSON_WHITESPACE,
    StructuredOutputsParams,
)

PROMPT = "Answer in JSON:"


@dataclass
class Result:
    """One (backend, tokenizer, push) combination over the whole corpus."""

    backend: str
    tokenizer: str
    push: str
    vocab: int
    valid_stop: int = 0
    invalid: int = 0
    length: int = 0
    refused: int = 0
    compile_errors: int = 0
    # "stop" outputs the checker says break their schema: must stay 0 (rose's guarantee)
    unchecked_stop: int = 0
    compile_s: dict[str, float] = field(default_factory=dict)
    mask_s_per_row: float = 0.0
    max_gap: int = 0
    gen_s: float = 0.0
    steps: int = 0
    failures: list[dict] = field(default_factory=list)  # invalid outputs, refusals, compile errors
    outputs: list[dict] = field(default_factory=list)


def backend_kwargs(backend: str) -> dict:
    """The Engine keyword selecting `backend`, where this rose has one; None if it cannot run that backend."""
    if "structured_outputs_backend" in inspect.signature(Engine).parameters:
        return {"structured_outputs_backend": backend}
    return {} if backend == "xgrammar" else None


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of `values`; 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def compile_each(engine: Engine, result: Result) -> None:
    """Compile every corpus grammar alone (fills the engine's grammar cache), timing each from the stats."""
    manager = engine.structured_outputs
    for name, schema in CORPUS:
        before = manager.get_stats()["structured_output_compile_s"]
        try:
            manager.make_request(StructuredOutputsParams(json=schema)).wait()
        except ValueError:
            continue  # refused or failed: counted by the generation pass, through add_request
        result.compile_s[name] = manager.get_stats()["structured_output_compile_s"] - before


def run_combination(
    backend: str, tokenizer_name: str, push: str, seeds: int, max_tokens: int
) -> Result | None:
    kwargs = backend_kwargs(backend)
    if kwargs is None:
        print(f"skipped {backend}: this Engine has no structured_outputs_backend", file=sys.stderr)
        return None
    tokenizer = load_tokenizer(tokenizer_name)
    model = pushed_model(tokenizer, push)
    requests = len(CORPUS) * seeds
    engine = Engine(
        model,
        tokenizer,
        device="cpu",
        dtype="float32",
        max_num_seqs=requests,
        max_model_len=max_tokens + 32,
        **kwargs,
    )
    result = Result(backend, tokenizer_name, push, vocab=len(tokenizer))
    try:
        engine.prepare_structured_outputs()
        compile_each(engine, result)
        stats0 = engine.get_stats()
        start = time.perf_counter()
        params_of: dict[str, tuple[str, int, SamplingParams]] = {}
        for name, schema in CORPUS:
            for seed in range(seeds):
                params = SamplingParams(
                    temperature=1.0,
                    seed=seed,
                    max_tokens=max_tokens,
                    structured_outputs=StructuredOutputsParams(json=schema),
                )
                rid = f"{name}#{seed}"
                try:
                    engine.add_request(rid, PROMPT, params)
                except ValueError as exc:
                    result.refused += 1
                    result.failures.append(
                        {"schema": name, "seed": seed, "kind": "refused", "error": str(exc)}
                    )
                    continue
                params_of[rid] = (name, seed, params)
        outputs = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.output
        result.gen_s = time.perf_counter() - start
        stats = engine.get_stats()
    finally:
        engine.close()
    result.steps = stats["num_steps"] - stats0["num_steps"]
    rows = stats.get("structured_output_masked_rows", 0) - stats0.get("structured_output_masked_rows", 0)
    mask_s = stats.get("structured_output_mask_s", 0.0) - stats0.get("structured_output_mask_s", 0.0)
    result.mask_s_per_row = mask_s / rows if rows else 0.0
    for rid, (name, seed, params) in params_of.items():
        out = outputs[rid]
        gap = longest_whitespace_gap(out.text)
        result.max_gap = max(result.max_gap, gap)
        record = {
            "schema": name,
            "seed": seed,
            "finish_reason": out.finish_reason,
            "tokens": len(out.token_ids),
            "gap": gap,
            "text": out.text,
            "structured_output_error": out.structured_output_error,
            "error": out.error,
        }
        result.outputs.append(record)
        if out.finish_reason == "stop":
            if violation(params.structured_outputs, out.text) is None:
                result.valid_stop += 1
            else:
                result.unchecked_stop += 1
                result.failures.append({**record, "kind": "unchecked stop"})
        elif out.finish_reason == "length":
            result.length += 1
        elif out.structured_output_error is not None:
            result.invalid += 1
            result.failures.append({**record, "kind": "invalid"})
        else:
            result.compile_errors += 1
            result.failures.append({**record, "kind": "compile error"})
    return result


def print_table(results: list[Result], max_tokens: int) -> None:
    header = (
        f"{'backend':9} {'tokenizer':23} {'vocab':>7} {'push':10} {'valid':>5} {'invalid':>7} {'length':>6} "
        f"{'refused':>7} {'compile p50':>11} {'p99':>7} {'max':>7} {'mask/row':>8} {'max gap':>7} {'gen s':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        times = list(r.compile_s.values())
        refused = f"{r.refused}" + (f"+{r.compile_errors}c" if r.compile_errors else "")
        print(
            f"{r.backend:9} {r.tokenizer:23} {r.vocab:>7} {r.push:10} {r.valid_stop:>5} {r.invalid:>7} "
            f"{r.length:>6} {refused:>7} {percentile(times, 50) * 1e3:>9.0f}ms "
            f"{percentile(times, 99) * 1e3:>5.0f}ms {max(times, default=0) * 1e3:>5.0f}ms "
            f"{r.mask_s_per_row * 1e6:>6.0f}us {r.max_gap:>7} {r.gen_s:>6.1f}"
        )
    print(
        f"(max_tokens {max_tokens}; 'refused' +Nc: N compile errors; unchecked stops: "
        f"{sum(r.unchecked_stop for r in results)})"
    )


def print_failures(results: list[Result]) -> None:
    for r in results:
        for f in r.failures:
            what = f.get("structured_output_error") or f.get("error")
            print(f"  {r.backend} {r.tokenizer} {r.push} {f['schema']}#{f['seed']} [{f['kind']}]: {what}")
            if "text" in f:
                print(f"      text: {f['text']!r:.300}")


def print_long_outputs(results: list[Result]) -> None:
    for r in results:
        cut = sorted(o["schema"] for o in r.outputs if o["finish_reason"] == "length")
        wide = sorted(
            f"{o['schema']} ({o['gap']})" for o in r.outputs if o["gap"] > DEFAULT_MAX_JSON_WHITESPACE
        )
        print(f"  {r.backend} {r.tokenizer} {r.push}: length: {', '.join(cut) or '-'}")
        print(f"      gaps over {DEFAULT_MAX_JSON_WHITESPACE}: {', '.join(wide) or '-'}")


def print_slowest_compiles(results: list[Result], n: int = 3) -> None:
    for r in results:
        slowest = sorted(r.compile_s.items(), key=lambda kv: -kv[1])[:n]
        shown = ", ".join(f"{name} {s * 1e3:.0f}ms" for name, s in slowest)
        print(f"  {r.backend} {r.tokenizer} {r.push}: {shown}; all {sum(r.compile_s.values()):.1f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizers", nargs="+", default=list(TOKENIZER_NAMES), choices=TOKENIZER_NAMES)
    parser.add_argument("--backends", nargs="+", default=["guidance", "xgrammar"])
    parser.add_argument("--pushes", nargs="+", default=list(PUSHES), choices=list(PUSHES))
    parser.add_argument("--seeds", type=int, default=1, help="requests per schema, seeds 0..N-1 (default 1)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as the tests)")
    parser.add_argument("--json-out", type=Path, help="write every output and figure here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    results = []
    for backend in args.backends:
        for tokenizer_name in args.tokenizers:
            for push in args.pushes:
                start = time.perf_counter()
                result = run_combination(backend, tokenizer_name, push, args.seeds, args.max_tokens)
                if result is not None:
                    results.append(result)
                    print(
                        f"# {backend} {tokenizer_name} {push}: {time.perf_counter() - start:.1f}s",
                        file=sys.stderr,
                        flush=True,
                    )
    print(
        f"corpus: {len(CORPUS)} schemas x {args.seeds} seed(s), temperature 1, torch threads {args.threads}"
    )
    print_table(results, args.max_tokens)
    print("\ninvalid outputs, refusals and compile errors:")
    print_failures(results)
    print("\ncut by max_tokens, and whitespace runs past the bound:")
    print_long_outputs(results)
    print("\nslowest compiles:")
    print_slowest_compiles(results)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps([asdict(r) for r in results], indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
