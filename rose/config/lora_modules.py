"""`--lora-modules` / ROSE_LORA_MODULES items in vLLM's forms: NAME=PATH, or a JSON object {"name", "path",
"base_model_name"}."""

from __future__ import annotations

import json

_LORA_FIELDS = ("name", "path", "base_model_name")  # vLLM's LoRAModulePath
_LORA_FORMS = 'NAME=PATH or a JSON object {"name": NAME, "path": PATH} (PATH a PEFT adapter directory)'


def parse_lora_module(item: object) -> tuple[str, str]:
    """One --lora-modules item in either of vLLM's forms -> (name, path): NAME=PATH (split at the first =), or a
    JSON object {"name": ..., "path": ..., "base_model_name": ...} (a string, or a dict already decoded).
    base_model_name (optional: vLLM's parent model of the adapter in its /v1/models) is accepted and ignored: a
    worker serves one model, and the adapter is checked against that model's layers at start. ValueError naming
    the item otherwise."""
    shown = json.dumps(item, default=str) if isinstance(item, dict) else repr(item)
    if isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            item = json.loads(item)
        except json.JSONDecodeError as exc:
            raise ValueError(f"want {_LORA_FORMS}, got {shown}: not JSON ({exc})") from None
    if isinstance(item, dict):
        unknown = [key for key in item if key not in _LORA_FIELDS]
        if unknown:
            raise ValueError(
                f"want {_LORA_FORMS}, got {shown}: unknown field {', '.join(map(repr, unknown))} (vLLM's "
                f"fields: {', '.join(_LORA_FIELDS)})"
            )
        for key in ("name", "path"):
            if not isinstance(item.get(key), str) or not item[key].strip():
                raise ValueError(f"want {_LORA_FORMS}, got {shown}: {key!r} must be a non-empty string")
        if not isinstance(item.get("base_model_name"), str | None):
            raise ValueError(f"want {_LORA_FORMS}, got {shown}: 'base_model_name' must be a string")
        return item["name"].strip(), item["path"].strip()
    name, sep, path = str(item).partition("=")
    name, path = name.strip(), path.strip()
    if not isinstance(item, str) or not sep or not name or not path:
        raise ValueError(f"want {_LORA_FORMS}, got {shown}")
    return name, path


def split_lora_modules(text: str) -> list[object]:
    """ROSE_LORA_MODULES -> its items: NAME=PATH and JSON objects separated by spaces or commas (the commas and
    spaces inside an object are its own), or one JSON array of them."""
    text = text.strip()
    if text.startswith("["):
        try:
            return list(json.loads(text))  # a JSON text starting with [ is an array
        except json.JSONDecodeError as exc:
            raise ValueError(f"lora_modules {text!r}: not a JSON array ({exc})") from None
    decoder = json.JSONDecoder()
    items: list[object] = []
    i = 0
    while i < len(text):
        if text[i].isspace() or text[i] == ",":
            i += 1
        elif text[i] == "{":
            try:
                item, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError as exc:
                raise ValueError(f"want {_LORA_FORMS}, got {text[i:]!r}: not JSON ({exc})") from None
            items.append(item)
        else:
            end = i
            while end < len(text) and not text[end].isspace() and text[end] != ",":
                end += 1
            items.append(text[i:end])
            i = end
    return items
