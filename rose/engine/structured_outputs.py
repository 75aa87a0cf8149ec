"""Per-request output constraints (vLLM's `StructuredOutputsParams`), and OpenAI's `response_format` mapped onto them.

Exactly one constraint per request: `json` (a JSON schema, as a dict or a JSON string), `regex`, `choice` (the output
is exactly one of the strings), `grammar` (EBNF, as xgrammar reads it: GBNF-style `root ::= ...`), or `json_object`
(any JSON object). Checks here are about shape only; whether a schema, regex or grammar compiles is decided by the
grammar engine (rose.engine.grammar) when the request is added, which raises ValueError naming the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Whitespace between two tokens of constrained JSON, at most (characters): a newline and 2-space indentation nine
# levels deep. Unbounded, a model that leans toward whitespace (real ones do in JSON mode) writes it until max_tokens.
DEFAULT_MAX_JSON_WHITESPACE = 20
# A grammar still compiling this long after it was asked for fails its requests alone, with the reason (the compile
# itself runs on; a later request for it may find it done). xgrammar at 151k tokens: seconds for bounded strings.
GRAMMAR_COMPILE_TIMEOUT_S = 60.0
# The grammar engines (vLLM's names; rose.engine.grammar_backends) and what `auto` runs, chosen on rose's
# conformance corpus: validity first, then mask and compile time (benchmarks/README.md, structured outputs)
BACKENDS = ("xgrammar", "guidance")
DEFAULT_BACKEND = "guidance"


def resolve_backend(name: str) -> str:
    """`auto` -> DEFAULT_BACKEND; a backend's own name as it is; anything else: ValueError."""
    if name == "auto":
        return DEFAULT_BACKEND
    if name not in BACKENDS:
        raise ValueError(f"structured_outputs_backend must be auto, {' or '.join(BACKENDS)}, got {name!r}")
    return name


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # normalized form, used as the compiled-grammar cache key
    key: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [
            k
            for k in CONSTRAINT_KINDS
            if getattr(self, k) is not None and (k, getattr(self, k)) != ("json_object", False)
        ]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of 'json', 'regex', 'choice', 'grammar', 'json_object'"
                + (f", got {', '.join(given)}" if given else "")
            )
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(value, dict):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {value!r}")
            object.__setattr__(self, "json", value)  # parsed once; properties keep their order
            # not sort_keys: the order of a schema's properties is the order the output writes them in
            spec = json.dumps(value, ensure_ascii=False)
        elif kind == "choice":
            if (
                not isinstance(value, list | tuple)
                or not value
                or not all(isinstance(c, str) and c for c in value)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(value))
            spec = json.dumps(list(value), ensure_ascii=False)
        elif kind == "json_object":
            if value is not True:
                raise ValueError("structured_outputs.json_object must be true")
            spec = ""
        else:
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
            spec = value
        object.__setattr__(self, "key", (kind, spec))

    @property
    def kind(self) -> str:
        return self.key[0]

    def to_dict(self) -> dict[str, Any]:
        """The one constraint set, as a job's `structured_outputs` field carries it."""
        kind = self.kind
        return {kind: getattr(self, kind)}

    @classmethod
    def from_dict(cls, value: Any) -> StructuredOutputsParams:
        if isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            raise ValueError('structured_outputs must be an object such as {"json": {...schema...}}')
        unknown = set(value) - set(CONSTRAINT_KINDS)
        if unknown:
            raise ValueError(
                f"structured_outputs has unknown keys {sorted(unknown)}; use one of {', '.join(CONSTRAINT_KINDS)}"
            )
        return cls(**value)

    @classmethod
    def from_response_format(cls, response_format: Any) -> StructuredOutputsParams | None:
        """OpenAI's `response_format`: {"type": "text"} (no constraint), {"type": "json_object"}, or
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
        if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
            raise ValueError(
                "response_format must be an object with a 'type': 'text', 'json_object' or 'json_schema'"
            )
        kind = response_format["type"]
        extra = set(response_format) - {"type", "json_schema"}
        if extra:
            raise ValueError(f"response_format has unknown keys {sorted(extra)}")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ValueError(
                    "response_format of type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}"
                )
            unknown = set(spec) - {"name", "schema", "strict", "description"}
            if unknown:
                raise ValueError(f"response_format.json_schema has unknown keys {sorted(unknown)}")
            try:
                return cls(json=spec["schema"])
            except ValueError as exc:  # named as the user sent it
                raise ValueError(
                    str(exc).replace("structured_outputs.json", "response_format.json_schema.schema")
                ) from None
        raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
