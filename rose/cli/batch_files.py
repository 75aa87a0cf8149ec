"""The files of `rose batch`: input lines in, result lines out, and what a re-run reads back to resume.

A line format (rose's own plain format here, OpenAI's batch format in rose.cli.openai_batch) turns an input line
into an `Entry` (the job's fields, or why the line cannot run) and a job's outcome into an output line. The driver
(rose.cli.batch) only handles keys: a line's key is its id as JSON, the same in the input, the output and the
`<output>.jobs` file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


def key_of(line_id: Any) -> str:
    return json.dumps(line_id, sort_keys=True)


def failure_code(message: str) -> str:
    """The error code of a failed job's line: `invalid_structured_output` when its output broke its JSON schema
    (the message says what, and holds the text), else `job_failed`."""
    from rose.jobs.schemas import INVALID_STRUCTURED_OUTPUT  # lazily, as `validate` imports the job contract

    marker = INVALID_STRUCTURED_OUTPUT + ":"
    ours = message.startswith(marker) or message.startswith("RoseJobError: " + marker)  # RQ's stored form
    return INVALID_STRUCTURED_OUTPUT if ours else "job_failed"


@dataclass
class Entry:
    """One input line, parsed: `request` (job fields) to run, or `error` to report."""

    lineno: int
    id: Any
    request: dict[str, Any] | None = None
    error: str | None = None
    duplicate: bool = False  # an id seen on an earlier line: reported, not run, no output line
    queue: str | None = None  # None: the command's --queue
    context: dict[str, Any] = field(default_factory=dict)  # what the format needs to write the line's result


class LineFormat(Protocol):
    """How one kind of batch file is read and written."""

    unique_ids: bool  # True: a repeated id refuses the whole file before anything runs

    def line_key(self, lineno: int, text: str) -> tuple[str | None, str | None]:
        """(key, None) for an input line, or (None, problem) where the format cannot name the line at all."""
        ...

    def output_key(self, obj: Any) -> tuple[str, bool]:
        """(key, failed) of a line already written; KeyError / TypeError / ValueError if it is not one."""
        ...

    def parse(self, lineno: int, text: str, defaults: dict[str, Any]) -> Entry: ...

    def invalid_line(self, entry: Entry) -> dict[str, Any]:
        """The output line of an entry with an error (never submitted)."""
        ...

    def result_line(self, entry: Entry, job_id: str, result: dict[str, Any]) -> dict[str, Any]: ...

    def failed_line(self, entry: Entry, job_id: str, message: str, code: str) -> dict[str, Any]:
        """The output line of a job that failed (code "job_failed") or was canceled ("job_canceled", ...)."""
        ...


class PlainFormat:
    """rose's own lines: {id?, prompt | prompt_token_ids | messages, job fields...} in; {id, job_id, text,
    finish_reason, usage[, metadata, logprobs, prompt_logprobs, tool_calls, content, choices]} or {id[, job_id], error} out. The id defaults
    to the line number."""

    unique_ids = False  # a repeated id is reported and its later lines skipped, the rest runs

    def line_key(self, lineno: int, text: str) -> tuple[str | None, str | None]:
        line_id: Any = lineno
        try:
            obj = json.loads(text)
            if isinstance(obj, dict) and type(obj.get("id")) in (str, int):
                line_id = obj["id"]
        except ValueError:
            pass
        return key_of(line_id), None

    def output_key(self, obj: Any) -> tuple[str, bool]:
        return key_of(obj["id"]), "error" in obj

    def parse(self, lineno: int, text: str, defaults: dict[str, Any]) -> Entry:
        try:
            obj = json.loads(text)
        except ValueError as exc:
            return Entry(lineno, lineno, error=f"invalid JSON: {exc}")
        if not isinstance(obj, dict):
            return Entry(lineno, lineno, error=f"expected a JSON object, got {type(obj).__name__}")
        line_id = obj.pop("id", lineno)
        if not isinstance(line_id, str | int) or isinstance(line_id, bool):
            return Entry(lineno, lineno, error="'id' must be a string or an integer")
        problem = validate({**defaults, **obj})
        if problem is not None:
            return Entry(lineno, line_id, error=problem[0])
        return Entry(lineno, line_id, request=obj)

    def invalid_line(self, entry: Entry) -> dict[str, Any]:
        return {"id": entry.id, "error": f"line {entry.lineno}: {entry.error}"}

    def result_line(self, entry: Entry, job_id: str, result: dict[str, Any]) -> dict[str, Any]:
        line = {"id": entry.id, "job_id": job_id}
        line.update({k: result.get(k) for k in ("text", "finish_reason", "usage")})
        for name in ("metadata", "logprobs", "prompt_logprobs", "choices"):  # choices: n > 1
            if result.get(name) is not None:
                line[name] = result[name]
        if result.get("tool_calls") is not None:  # a job with tools: its calls, and the text outside them
            line["tool_calls"], line["content"] = result["tool_calls"], result.get("content")
        return line

    def failed_line(self, entry: Entry, job_id: str, message: str, code: str) -> dict[str, Any]:
        return {"id": entry.id, "job_id": job_id, "error": message}


def validate(fields: dict[str, Any]) -> tuple[str, str | None] | None:
    """None if `fields` make a valid rose.jobs.generate job, else (message, the field at fault or None)."""
    from rose.jobs.schemas import GenerateRequest, ValidationError, format_validation_error

    try:
        GenerateRequest(**fields)
    except ValidationError as exc:
        locs = [err["loc"] for err in exc.errors() if err["loc"]]
        message = format_validation_error(exc).removeprefix("invalid rose.jobs.generate arguments: ")
        return message, str(locs[0][0]) if locs else _named_field(message)
    except (TypeError, ValueError) as exc:
        return str(exc), _named_field(str(exc))
    return None


def _named_field(message: str) -> str | None:
    constraint = re.match(r"(response_format(?:\.json_schema\.schema)?|structured_outputs\.\w+)\b", message)
    if constraint:  # a constraint's checks name the field as the user sent it
        return constraint.group(1)
    # rose.engine.tool_calls.check_tools, the tools' schemas
    tools = re.match(r"'?(tools|tool_choice)\b", message)
    if tools:
        return tools.group(1)
    bound = re.match(r"((?:prompt_)?logprobs) must be <= ", message)  # the workers' max_logprobs
    if bound:
        return bound.group(1)
    named = re.search(r"\bSamplingParams\.(\w+)", message)  # SamplingParams' range checks name the field
    return named.group(1) if named else None


@dataclass
class Survey:
    """What a first pass over the input found."""

    total: int = 0
    skipped: int = 0  # lines already in the output (or error) file
    prev_failed: int = 0  # of those, the failed ones
    problems: list[str] = field(default_factory=list)  # why the file is refused (formats with unique ids)


def first_pass(path: Path, fmt: LineFormat) -> Iterator[tuple[int, str | None, str | None, str]]:
    """(line number, key, problem, text) of each non-blank line."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, text in enumerate(f, 1):
            if text.strip():
                key, problem = fmt.line_key(lineno, text)
                yield lineno, key, problem, text


def survey(path: Path, fmt: LineFormat, previous: dict[str, bool], most: int = 10) -> Survey:
    """Count the lines (and those already done); for a format with unique ids, list (the first `most`) lines
    that cannot be named and repeated ids, which refuse the file before anything is submitted."""
    found = Survey()
    seen: dict[str, int] = {}
    problems = 0
    for lineno, key, problem, _ in first_pass(path, fmt):
        found.total += 1
        if key is None:
            problem = f"line {lineno}: {problem}"
        elif fmt.unique_ids and key in seen:
            problem = f"line {lineno}: duplicate custom_id {key} (first on line {seen[key]})"
        elif fmt.unique_ids:
            seen[key] = lineno
        if problem is not None:
            problems += 1
            if problems <= most:
                found.problems.append(problem)
            continue
        if key in previous:
            found.skipped += 1
            found.prev_failed += previous[key]
    if problems > most:
        found.problems.append(f"... and {problems - most} more")
    return found


def scan_output(path: Path | None, fmt: LineFormat) -> dict[str, bool]:
    """key -> failed, for the lines already written; drops a torn last line (a crash mid-write)."""
    done: dict[str, bool] = {}
    if path is None or not path.exists():
        return done
    good_end = 0
    with path.open("rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                key, failed = fmt.output_key(json.loads(raw))
                done[key] = failed
            except (ValueError, KeyError, TypeError):
                pass  # a line we cannot read is kept, not counted
            good_end += len(raw)
    if good_end < path.stat().st_size:
        with path.open("r+b") as f:
            f.truncate(good_end)
    return done


def read_jobs_file(path: Path, done: set[str]) -> dict[str, str]:
    """key -> job id of the jobs a previous run submitted for lines not written yet."""
    jobs: dict[str, str] = {}
    if path.exists():
        with path.open() as f:
            for line in f:
                try:
                    obj = json.loads(line)
                    key = key_of(obj["id"])
                except (ValueError, KeyError, TypeError):
                    continue
                if key not in done:
                    jobs[key] = obj["job_id"]
    return jobs
