"""Command-line flags for the job fields beyond sampling: chat rendering options and output constraints.

Shared by the subcommands that make single requests (`rose generate`, `rose submit`; a `rose batch` line carries
these fields itself):
`add_chat_args` / `chat_kwargs` (vLLM's and OpenAI's chat options), `add_constraint_args` / `constraint_kwargs`
(the `structured_outputs` field: --json-schema, --regex, --choice, --grammar, --json-object), and `add_request_args`
/ `request_kwargs` for both; `add_tool_args` / `tool_kwargs` (OpenAI's `tools` / `tool_choice`: `rose submit`).
Each `*_kwargs` function returns only the fields the user set, under the job's field names, so the result can be
merged into a job as it is. Values that are JSON can also be given as `@path` (read from that file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time
from pathlib import Path
from typing import Any

from rose.jobs.schemas import check_deadline

__all__ = [
    "add_chat_args",
    "add_constraint_args",
    "add_request_args",
    "add_tool_args",
    "chat_kwargs",
    "constraint_kwargs",
    "json_arg",
    "request_kwargs",
    "text_arg",
    "tool_kwargs",
]


def text_arg(value: str) -> str:
    """A flag's value as given, or the contents of the file it names as `@path`."""
    if value.startswith("@"):
        path = Path(value[1:])
        try:
            return path.read_text(encoding="utf-8")
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror or exc}") from None
    return value


def json_arg(value: str) -> Any:
    """A flag's JSON value, given inline or as `@path`."""
    text = text_arg(value)
    try:
        return json.loads(text)
    except ValueError as exc:
        where = value if value.startswith("@") else "the value"
        raise argparse.ArgumentTypeError(f"{where} is not valid JSON: {exc}") from None


def _json_of_kind(value: str, kind: type[dict] | type[list], example: str) -> Any:
    """A flag's JSON value (inline or `@path`, as `json_arg`) that must be a `kind`: dict (an object) or list;
    `example`: one, for the error message."""
    obj = json_arg(value)
    if not isinstance(obj, kind):
        noun = "object" if kind is dict else "list"
        raise argparse.ArgumentTypeError(f"must be a JSON {noun}, e.g. '{example}'")
    return obj


def json_object_arg(value: str) -> dict[str, Any]:
    return _json_of_kind(value, dict, '{"enable_thinking": false}')


def json_list_arg(value: str) -> list[Any]:
    return _json_of_kind(value, list, '[{"type": "function", ...}]')


def tool_choice_arg(value: str) -> str | dict[str, Any]:
    """none, auto, required, a function's name (OpenAI's {"type": "function", "function": {"name": ...}}), or
    that object as JSON (or @FILE)."""
    if value in ("none", "auto", "required"):
        return value
    if value.startswith(("{", "@")):
        return json_object_arg(value)
    return {"type": "function", "function": {"name": value}}


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    """How chat messages are rendered (only for requests made of messages)."""
    group = parser.add_argument_group("chat rendering (with chat messages only)")
    group.add_argument(
        "--chat-template",
        type=text_arg,
        default=None,
        metavar="JINJA|@FILE",
        help="a Jinja chat template to use instead of the model's (a worker accepts it only when started with "
        "--trust-request-chat-template)",
    )
    group.add_argument(
        "--chat-template-kwargs",
        type=json_object_arg,
        default=None,
        metavar="JSON|@FILE",
        help="extra variables for the chat template, e.g. '{\"enable_thinking\": false}'",
    )
    group.add_argument(
        "--no-add-generation-prompt",
        dest="add_generation_prompt",
        action="store_const",
        const=False,
        default=None,
        help="do not open an assistant turn after the messages",
    )
    group.add_argument(
        "--continue-final-message",
        action="store_const",
        const=True,
        default=None,
        help="continue the last (assistant) message instead of starting a new one (implies "
        "--no-add-generation-prompt)",
    )


def given(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    """The flags among `names` the user set (unset ones are None), by name: their job fields."""
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def chat_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The chat fields the user set (job field names). They are valid on `messages` jobs only."""
    out = given(
        args, ("chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")
    )
    if out.get("continue_final_message"):
        out.setdefault("add_generation_prompt", False)
    return out


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    """OpenAI's tool calling (chat messages only): the result has `tool_calls` and `content` (docs/jobs.md)."""
    group = parser.add_argument_group("tool calling (with chat messages only)")
    group.add_argument(
        "--tools",
        type=json_list_arg,
        default=None,
        metavar="JSON|@FILE",
        help='OpenAI-format tools: \'[{"type": "function", "function": {"name": "get_weather", "parameters": '
        "{...}}}]'",
    )
    group.add_argument(
        "--tool-choice",
        type=tool_choice_arg,
        default=None,
        metavar="CHOICE",
        help="auto (the default with --tools: the worker's parser reads the calls the model writes), none, "
        "required (at least one call, decoded under the tools' schemas), or a function's NAME (a call of that "
        "function); also OpenAI's JSON object",
    )


def tool_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The tool fields the user set (job field names); valid on `messages` jobs only."""
    return given(args, ("tools", "tool_choice"))


def add_constraint_args(parser: argparse.ArgumentParser) -> None:
    """One output constraint (vLLM's structured outputs); the flags exclude each other."""
    group = parser.add_argument_group(
        "output constraint (vLLM structured outputs; at most one)"
    ).add_mutually_exclusive_group()
    group.add_argument(
        "--json-schema",
        type=json_arg,
        default=None,
        metavar="JSON|@FILE",
        help="the output is JSON valid under this JSON schema",
    )
    group.add_argument("--regex", default=None, help="the output matches this regular expression")
    group.add_argument(
        "--choice",
        action="append",
        default=None,
        metavar="TEXT",
        help="the output is exactly one of these strings (repeat the flag for each)",
    )
    group.add_argument(
        "--grammar",
        type=text_arg,
        default=None,
        metavar="EBNF|@FILE",
        help="the output follows this EBNF grammar (GBNF style: root ::= ...)",
    )
    group.add_argument(
        "--json-object", action="store_true", default=None, help="the output is a JSON object (any)"
    )


def constraint_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`{"structured_outputs": {kind: value}}` for the constraint flag the user gave, else {}.

    Raises ValueError naming the problem when the constraint is malformed (an empty choice, a schema that is not an
    object); whether a schema, regex or grammar compiles is decided where the request is added.
    """
    from rose.engine.structured_outputs import StructuredOutputsParams

    given = {
        "json": getattr(args, "json_schema", None),
        "regex": getattr(args, "regex", None),
        "choice": getattr(args, "choice", None),
        "grammar": getattr(args, "grammar", None),
        "json_object": getattr(args, "json_object", None) or None,
    }
    given = {kind: value for kind, value in given.items() if value is not None}
    if not given:
        return {}
    try:
        params = StructuredOutputsParams.from_dict(given)
    except ValueError as exc:
        flag = {"json": "--json-schema", "json_object": "--json-object"}.get(
            next(iter(given)), "--" + next(iter(given))
        )
        raise ValueError(f"{flag}: {exc}") from None
    return {"structured_outputs": params.to_dict()}


_DURATION = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_deadline(text: str) -> float:
    """--deadline WHEN -> a Unix time: seconds from now (`600`, `90s`, `10m`, `2h`, `1d`), or an ISO 8601 time with
    its zone (`2036-11-27T18:00:00+00:00`, `...Z`); a time the job field would refuse is refused here
    (rose.jobs.schemas.check_deadline)."""
    value = text.strip()
    unit = _DURATION.get(value[-1:].lower(), 0)
    number = value[:-1] if unit else value
    try:
        seconds = float(number) * (unit or 1)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds) or seconds <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: a deadline from now must be > 0 seconds")
        if seconds >= 1e9:  # ~32 years: a Unix time given for a duration
            raise argparse.ArgumentTypeError(
                f"{text!r}: want seconds from now, not a Unix time (give a time as ISO 8601 with its zone)"
            )
        return time.time() + seconds
    try:
        when = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: want seconds from now (600, 90s, 10m, 2h, 1d) or an ISO 8601 time with its zone "
            "(2036-11-27T18:00:00+00:00)"
        ) from None
    if when.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r}: give the time's zone (e.g. +00:00 or Z)")
    if when.timestamp() <= time.time():
        raise argparse.ArgumentTypeError(f"{text!r} is in the past: the jobs would fail at once")
    try:
        check_deadline(when.timestamp())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return when.timestamp()


def add_placement_args(parser: argparse.ArgumentParser) -> None:
    """The job fields `tenant` and `deadline` (rose submit, rose batch)."""
    parser.add_argument(
        "--tenant",
        default=None,
        metavar="NAME",
        help="the job field tenant: who the jobs are for (a team, a customer); a batch line's own tenant (an OpenAI "
        "line's body.user) wins",
    )
    parser.add_argument(
        "--deadline",
        type=parse_deadline,
        default=None,
        metavar="WHEN",
        help="the job field deadline: seconds from now (600, 10m, 2h) or an ISO 8601 time with its zone; a job "
        "not started by then fails with 'deadline exceeded', and among waiting jobs the earliest deadline starts "
        "first",
    )


def placement_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return given(args, ("tenant", "deadline"))


def add_request_args(parser: argparse.ArgumentParser) -> None:
    """Both groups: chat rendering options and an output constraint."""
    add_chat_args(parser)
    add_constraint_args(parser)


def request_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Every field the flags of `add_request_args` set: the chat options and `structured_outputs` (the chat options
    are valid on `messages` requests only)."""
    return {**chat_kwargs(args), **constraint_kwargs(args)}
