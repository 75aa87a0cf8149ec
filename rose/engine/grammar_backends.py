"""The grammar engines behind structured outputs: xgrammar and llguidance (vLLM's `xgrammar` and `guidance`
backends). Everything that touches either library lives here, so an upgrade touches this file only.

A backend turns a constraint into a compiled grammar and a compiled grammar into per-request matchers; the
manager (rose.engine.grammar) owns the compile pool, the cache and the logits. Both fill the same bitmask: int32
words, bit j of word w allows token 32 * w + j (xgrammar's and llguidance's common layout), so masking is shared.

* `parse` runs on the caller's thread and raises ValueError("structured_outputs.<kind> is invalid: ...") for a
  constraint the engine refuses (fast: no vocabulary work).
* `compile` runs on the manager's pool (both release the GIL); `size` is what the cache counts of it.
* `matcher` makes a request's matcher; `accept` feeds it a sampled token (False: refused); `ended` says whether the
  token it accepted ended the grammar (a stop token where the grammar may end: the output's last token is the one
  before); `allows` says whether it would accept a token, leaving it as it was; `fill` writes the next-token masks
  of several matchers at once.

JSON whitespace: `any_whitespace` False writes one line (vLLM's disable_any_whitespace); otherwise whitespace is
allowed between tokens, at most `max_json_whitespace` characters of it at a time (None: no limit).
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import TYPE_CHECKING, Any, Protocol

from rose.engine.schema_rewrite import ascii_classes, ascii_patterns, closed_objects
from rose.engine.structured_outputs import DEFAULT_MAX_JSON_WHITESPACE, StructuredOutputsParams

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# xgrammar's errors start with "[hh:mm:ss] /project/cpp/file.cc:123: "; the rest is the useful part
_XGR_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")


def clean_error(exc: BaseException) -> str:
    return _XGR_PREFIX.sub("", str(exc)).strip() or type(exc).__name__


def choice_as_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`; each alternative a JSON string literal, whose escapes (\\", \\\\, \\n, \\uXXXX)
    xgrammar's EBNF parser reads the same way (`\\x` would not do: it reads as many hex digits as follow)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _invalid(params: StructuredOutputsParams, why: str) -> ValueError:
    one_line = " ".join(part.strip() for part in why.splitlines() if part.strip())  # llguidance's span lines
    return ValueError(f"structured_outputs.{params.kind} is invalid: {one_line}")


class Backend(Protocol):
    name: str

    def parse(self, params: StructuredOutputsParams) -> Any: ...
    def compile(self, parsed: Any) -> Any: ...
    def size(self, compiled: Any) -> int: ...
    def matcher(self, compiled: Any) -> Any: ...
    def accept(self, matcher: Any, token: int) -> bool: ...
    def allows(self, matcher: Any, token: int) -> bool: ...
    def ended(self, matcher: Any, token: int) -> bool: ...
    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None: ...


def parse(
    backend: str,
    params: StructuredOutputsParams,
    any_whitespace: bool = True,
    max_whitespace: int | None = DEFAULT_MAX_JSON_WHITESPACE,
) -> Any:
    """The constraint as `backend` reads it, with no tokenizer (fast): what an engine's `parse` does, for checks
    where no engine is (rose.engine.structured_check). Raises ValueError naming the constraint and the problem."""
    if backend == "xgrammar":
        return parse_grammar(params, any_whitespace, max_whitespace)
    return parse_guidance(params, _guidance_json_options(any_whitespace, max_whitespace))


def parse_grammar(
    params: StructuredOutputsParams,
    any_whitespace: bool = True,
    max_whitespace: int | None = DEFAULT_MAX_JSON_WHITESPACE,
) -> Any:
    """The constraint as an xgrammar Grammar. Raises ValueError naming the constraint and the problem."""
    import xgrammar as xgr

    kind = params.kind
    spacing: dict[str, Any] = {"any_whitespace": any_whitespace}
    if any_whitespace and max_whitespace is not None:
        spacing["max_whitespace_cnt"] = max_whitespace
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(params.json, **spacing)
        if kind == "json_object":
            # any JSON *object* (OpenAI's json_object); xgrammar's builtin JSON grammar would also allow an array
            return xgr.Grammar.from_json_schema({"type": "object"}, strict_mode=False, **spacing)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_as_ebnf(params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except Exception as exc:  # xgrammar raises RuntimeError / its own error types
        raise _invalid(params, clean_error(exc)) from None


class XGrammarBackend:
    name = "xgrammar"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        threads: int,
        any_whitespace: bool,
        max_json_whitespace: int | None,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.any_whitespace, self.max_json_whitespace = any_whitespace, max_json_whitespace
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        # xgrammar's own cache off: the manager's LRU holds compiled grammars, xgrammar's would grow without bound
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher()

    def parse(self, params: StructuredOutputsParams) -> Any:
        return parse_grammar(params, self.any_whitespace, self.max_json_whitespace)

    def compile(self, parsed: Any) -> Any:
        return self.compiler.compile_grammar(parsed)

    def size(self, compiled: Any) -> int:
        return compiled.memory_size_bytes

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def allows(self, matcher: Any, token: int) -> bool:
        if not matcher.accept_token(token):
            return False
        matcher.rollback(1)  # xgrammar has no check that leaves the matcher as it was
        return True

    def ended(self, matcher: Any, token: int) -> bool:
        return matcher.is_terminated()

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)


def _guidance_json_options(any_whitespace: bool, max_whitespace: int | None) -> dict[str, Any]:
    if any_whitespace:
        bound = "*" if max_whitespace is None else f"{{0,{max_whitespace}}}"
        return {"whitespace_pattern": f"[ \\t\\n\\r]{bound}"}
    return {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
    }  # one line, as xgrammar


def parse_guidance(params: StructuredOutputsParams, json_options: dict[str, Any]) -> str:
    """The constraint as an llguidance grammar (serialized), checked without a tokenizer."""
    import llguidance as ll

    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = ascii_patterns(closed_objects(params.json)) if kind == "json" else {"type": "object"}
            grammar = ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=json_options)
        elif kind == "regex":
            grammar = ll.grammar_from("regex", ascii_classes(params.regex))
        elif kind == "choice":
            grammar = ll.grammar_from("grammar", choice_as_ebnf(params.choice))
        else:
            grammar = ll.grammar_from("grammar", params.grammar)
    except Exception as exc:
        raise _invalid(params, str(exc)) from None
    failed, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if failed:
        raise _invalid(params, "; ".join(messages))
    return grammar


class GuidanceBackend:
    """llguidance: grammars are compiled lazily, token by token, against a token trie built once per tokenizer; a
    'compiled' grammar here is its validated serialized form, and each request's matcher builds its own lexer."""

    name = "guidance"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        threads: int,
        any_whitespace: bool,
        max_json_whitespace: int | None,
    ) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._ll, self._lt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids) or None
        )
        self.stop_token_ids = frozenset(stop_token_ids) or frozenset([self.tokenizer.eos_token])
        # the fill holds up the step while it runs, so it may use every core this process may run on
        self._executor = llguidance.LLExecutor(num_threads=max(threads, len(os.sched_getaffinity(0))))
        self._json_options = _guidance_json_options(any_whitespace, max_json_whitespace)

    def parse(self, params: StructuredOutputsParams) -> str:
        return parse_guidance(params, self._json_options)

    def compile(self, parsed: str) -> str:
        failed, messages = self._ll.LLMatcher.validate_grammar_with_warnings(parsed, self.tokenizer)
        if failed:
            raise ValueError("; ".join(m.strip() for m in messages))
        return parsed

    def size(self, compiled: str) -> int:
        return len(compiled)

    def matcher(self, compiled: str) -> Any:
        matcher = self._ll.LLMatcher(self.tokenizer, compiled, log_level=1)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def accept(self, matcher: Any, token: int) -> bool:
        if matcher.is_error():  # a limit it hit (its mask then allows only EOS): refused, not a clean end
            logger.error("llguidance matcher error: %s", matcher.get_error())
            return False
        if matcher.is_stopped():  # only a stop token may follow a finished grammar
            return token in self.stop_token_ids
        return matcher.consume_token(token)

    def allows(self, matcher: Any, token: int) -> bool:
        if matcher.is_error():
            return False
        if matcher.is_stopped():
            return token in self.stop_token_ids
        return matcher.validate_tokens([token]) == 1

    def ended(self, matcher: Any, token: int) -> bool:
        # llguidance stops as soon as nothing can follow (before the stop token): the stop token ends it
        return token in self.stop_token_ids

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            self._lt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self._lt.fill_next_token_bitmask_par(
                self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask
            )


def apply_bitmask_kernel(
    logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int, indices: list[int] | None = None
) -> None:
    """xgrammar's masking kernel (CUDA, or its CPU one) on either backend's bitmask (one layout): disallowed
    logits of the rows `indices` (all when None) set to -inf, in place."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=indices)


def make_backend(
    name: str,
    tokenizer: Any,
    vocab_size: int,
    stop_token_ids: list[int],
    threads: int,
    any_whitespace: bool,
    max_json_whitespace: int | None,
) -> Backend:
    backend = {"xgrammar": XGrammarBackend, "guidance": GuidanceBackend}.get(name)
    if backend is None:
        raise ValueError(f"unknown structured outputs backend {name!r}")
    return backend(tokenizer, vocab_size, stop_token_ids, threads, any_whitespace, max_json_whitespace)
