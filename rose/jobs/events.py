"""Events published for each job on `rose:tokens:<id>` (pub/sub) and `rose:stream:<id>` (replayable stream).

The JSON written carries no `job_id`: the channel and the stream are the job's (the id was a third of a
token event's bytes). `parse_event(data, job_id)` fills it in from the key, and still reads events that carry it.

Pub/sub carries every event as JSON. A stream entry holds either an event's JSON in its field `event`
(keys.STREAM_FIELD), or a plain token event (no `logprobs`, no `index`) as its own fields `seq`, `text` and
`token_ids` (the ids in decimal, joined by commas): Redis keeps the field names of a stream's node once, so a
token event is stored at the size of its values (`token_entry`). `parse_entry(fields, job_id)` reads both forms.

Within one attempt, token events carry seq 0, 1, 2, ... without gaps and the single terminal event (done, error
or canceled) carries the next seq. A `reset` event means the job restarts from scratch (worker crash, requeue):
drop what was received so far; the seq of the new attempt starts again at 0.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from rose.jobs import keys

__all__ = [
    "TERMINAL_TYPES",
    "TOKEN_ENTRY_FIELDS",
    "CanceledEvent",
    "DoneEvent",
    "ErrorEvent",
    "Event",
    "ResetEvent",
    "TokenEvent",
    "Usage",
    "entry_dict",
    "parse_entry",
    "parse_event",
    "token_entry",
    "token_event",
    "token_event_json",
]


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)  # extra: newer workers may add fields

    job_id: str  # not in the JSON written: the channel and stream it is written to name the job

    def to_json(self) -> str:
        return self.model_dump_json(exclude={"job_id"})


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class TokenEvent(_Base):
    type: Literal["token"] = "token"
    seq: int
    text: str
    token_ids: list[int]
    # a job with `logprobs`: one entry per token of `token_ids` (rose.jobs.logprobs.LogprobEntry); absent otherwise
    logprobs: list[dict[str, Any]] | None = None
    # a job with n > 1 choices: the choice the tokens belong to (seq counts the job's events, all choices'); absent
    # otherwise
    index: int | None = None

    def to_json(self) -> str:
        return self.model_dump_json(
            exclude={"job_id"} | {k for k in ("logprobs", "index") if getattr(self, k) is None}
        )


class DoneEvent(_Base):
    type: Literal["done"] = "done"
    seq: int
    finish_reason: str
    usage: Usage


class ErrorEvent(_Base):
    type: Literal["error"] = "error"
    seq: int
    message: str


class CanceledEvent(_Base):
    type: Literal["canceled"] = "canceled"
    seq: int
    reason: str = "canceled"


class ResetEvent(_Base):
    type: Literal["reset"] = "reset"
    reason: str = "restart"


Event = Annotated[
    TokenEvent | DoneEvent | ErrorEvent | CanceledEvent | ResetEvent, Field(discriminator="type")
]
TERMINAL_TYPES = frozenset({"done", "error", "canceled"})

_adapter: TypeAdapter[Any] = TypeAdapter(Event)
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def token_event_json(
    seq: int,
    text: str,
    token_ids: list[int],
    logprobs: list[Any] | None = None,
    index: int | None = None,
) -> str:
    """`TokenEvent(...).to_json()` for the worker's hot path (one per job per step), at a quarter of the cost; the
    `logprobs` and `index` keys only when given."""
    return _token_json(seq, text, ",".join(map(str, token_ids)), logprobs, index)


def token_event(
    seq: int,
    text: str,
    token_ids: list[int],
    logprobs: list[Any] | None = None,
    index: int | None = None,
) -> tuple[str, tuple[int, str, str] | None]:
    """A token event as the worker publishes it: its JSON (`token_event_json`), and the values of its stream entry
    (`token_entry`) when it is stored as fields: a plain token event, without `logprobs` or `index` (those keys have
    no field); None: stored as its JSON."""
    ids = ",".join(map(str, token_ids))
    entry = (seq, text, ids) if logprobs is None and index is None else None
    return _token_json(seq, text, ids, logprobs, index), entry


def _token_json(seq: int, text: str, ids: str, logprobs: list[Any] | None, index: int | None) -> str:
    head = f'{{"type":"token","seq":{seq:d},"text":{_encode(text)},"token_ids":[{ids}]'
    if logprobs is not None:
        head += f',"logprobs":{_encode(logprobs)}'
    if index is not None:
        head += f',"index":{index:d}'
    return head + "}"


def parse_event(
    data: str | bytes | dict, job_id: str | None = None
) -> TokenEvent | DoneEvent | ErrorEvent | CanceledEvent | ResetEvent:
    """An event from its JSON (or dict). `job_id`: the job whose channel or stream it was read from (the JSON a
    worker writes does not carry it; one that does keeps its own)."""
    if isinstance(data, str | bytes):
        data = json.loads(data)
    if job_id is not None and "job_id" not in data:
        data = {**data, "job_id": job_id}
    return _adapter.validate_python(data)


TOKEN_ENTRY_FIELDS = ("seq", "text", "token_ids")  # a plain token event's fields in its stream entry
_EVENT_FIELD = keys.STREAM_FIELD.encode()
_SEQ, _TEXT, _IDS = (name.encode() for name in TOKEN_ENTRY_FIELDS)


def token_entry(seq: int, text: str, token_ids: list[int]) -> tuple[int, str, str]:
    """The values of a plain token event's stream entry, in `TOKEN_ENTRY_FIELDS`' order."""
    return seq, text, ",".join(map(str, token_ids))


def entry_dict(fields: dict[bytes, bytes] | dict[str, str]) -> dict[str, Any]:
    """The event a stream entry holds, as the dict of its JSON (no `job_id`), from either form (the fields as
    redis-py reads them, bytes or decoded). ValueError for an entry that holds neither."""
    if any(isinstance(k, str) for k in fields):  # a connection with decode_responses
        fields = {str(k).encode(): str(v).encode() for k, v in fields.items()}
    data = fields.get(_EVENT_FIELD)
    if data is not None:
        return json.loads(data)
    try:
        seq, text, ids = fields[_SEQ], fields[_TEXT], fields[_IDS]
    except KeyError:
        raise ValueError(
            f"a stream entry with neither an event nor a token's fields: {sorted(fields)}"
        ) from None
    token_ids = [int(i) for i in ids.split(b",")] if ids else []
    return {"type": "token", "seq": int(seq), "text": text.decode(), "token_ids": token_ids}


def parse_entry(
    fields: dict[bytes, bytes] | dict[str, str], job_id: str | None = None
) -> TokenEvent | DoneEvent | ErrorEvent | CanceledEvent | ResetEvent:
    """The event a stream entry holds (`entry_dict`), with the job's id (`parse_event`)."""
    return parse_event(entry_dict(fields), job_id)
