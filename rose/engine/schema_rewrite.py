r"""What rose does to a JSON schema (and a regex) before llguidance reads it, so that both grammar backends hold
outputs to the same meaning, xgrammar's (rose.engine.grammar_backends):

* `closed_objects`: an object schema that lists properties and says nothing of others gets no others
  (`additionalProperties: false`), as xgrammar's strict mode does and as an extraction means; JSON Schema's default
  would let a model append keys of its own, free strings that need not end. Outputs stay valid under the schema as
  given. A schema combined in place with others (`allOf` / `anyOf` / `oneOf` / `if` / `then` / `else` / `not` /
  `dependentSchemas` / a `$ref` beside its keywords) is left open, and so are those branches and the `$defs` they
  refer to: closed, each would refuse the properties the others add (OpenAPI's `allOf` inheritance).
* `ascii_classes`: \d and \w as ECMA 262 (JSON Schema's `pattern` dialect, and xgrammar's) read them, ASCII, where
  llguidance's Rust regexes are Unicode-aware (its \d takes "７"). `ascii_patterns` applies it to every `pattern` and
  `patternProperties` key of a schema, through schema keywords only (a `const` or `enum` value is data).

Each returns a rewritten copy; the input is not changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

# keywords whose value is a map of name -> subschema, a subschema, or a list of subschemas
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_ONE = (
    "items",
    "additionalItems",
    "contains",
    "additionalProperties",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "not",
    "if",
    "then",
    "else",
)
_MANY = ("prefixItems", "allOf", "anyOf", "oneOf", "items")
# subschemas that apply to the same instance as the schema holding them
_IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas")


def _rewrite(schema: Any, child: Callable[[Any, str, str], Any], path: str) -> Any:
    """A copy of `schema` with each subschema replaced by child(subschema, keyword, its JSON pointer)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {
                name: child(sub, key, f"{path}/{key}/{_pointer(name)}") for name, sub in out[key].items()
            }
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = child(out[key], key, f"{path}/{key}")
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [child(sub, key, f"{path}/{key}/{i}") for i, sub in enumerate(out[key])]
    return out


def _pointer(name: str) -> str:
    """A name as a JSON pointer token (RFC 6901), as a `$ref` spells it: `a/b` -> `a~1b`."""
    return name.replace("~", "~0").replace("/", "~1")


def _combined(schema: dict) -> bool:
    return any(key in schema for key in (*_IN_PLACE, "$ref"))


def closed_objects(schema: Any) -> Any:
    open_refs: set[str] = set()
    _collect_open_refs(schema, True, open_refs)
    return _close(schema, True, open_refs, "#")


def _collect_open_refs(schema: Any, close: bool, found: set[str]) -> None:
    """The local `$ref`s reached where a schema must stay open (an in-place branch, a ref beside keywords)."""
    if not isinstance(schema, dict):
        return
    ref = schema.get("$ref")
    if isinstance(ref, str) and (not close or len(schema) > 1):
        # a pointer in a URI fragment is percent-encoded (RFC 6901 section 6): "#/$defs/my%20def" is "my def"
        found.add(unquote(ref) if ref.startswith("#") else ref)

    def child(sub: Any, key: str, _path: str) -> Any:
        _collect_open_refs(sub, key not in _IN_PLACE, found)
        return sub

    _rewrite(schema, child, "#")


def _close(schema: Any, close: bool, open_refs: set[str], path: str) -> Any:
    if not isinstance(schema, dict):
        return schema

    def child(sub: Any, key: str, sub_path: str) -> Any:
        return _close(sub, key not in _IN_PLACE and sub_path not in open_refs, open_refs, sub_path)

    out = _rewrite(schema, child, path)
    lists_properties = isinstance(out.get("properties"), dict) or isinstance(
        out.get("patternProperties"), dict
    )
    says_nothing = "additionalProperties" not in out and "unevaluatedProperties" not in out
    if close and lists_properties and says_nothing and not _combined(out):
        out["additionalProperties"] = False
    return out


_ASCII = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(pattern: str) -> str:
    r"""`pattern` with \d, \w (and \D, \W outside brackets) spelled as the ASCII ranges ECMA 262 means."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            e = pattern[i + 1]
            if e in _ASCII:
                out.append(_ASCII[e] if in_class else f"[{_ASCII[e]}]")
            elif e.lower() in _ASCII and not in_class:
                out.append(f"[^{_ASCII[e.lower()]}]")
            else:
                out.append(c + e)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            i += 1
            if pattern[i : i + 1] == "^":
                out.append("^")
                i += 1
            if pattern[i : i + 1] == "]":  # a leading ']' is a literal in Rust's classes
                out.append("]")
                i += 1
            continue
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def ascii_patterns(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = _rewrite(schema, lambda sub, _key, _path: ascii_patterns(sub), "#")
    if isinstance(out.get("pattern"), str):
        out["pattern"] = ascii_classes(out["pattern"])
    if isinstance(out.get("patternProperties"), dict):
        out["patternProperties"] = {ascii_classes(k): v for k, v in out["patternProperties"].items()}
    return out
