"""rose-worker's logging: `--log-format text` (human lines) or `json` (one JSON object per line).

Job lifecycle lines carry their structured fields (job_id, queue, event, token counts, timings) through
`extra=`; the JSON formatter puts every such field in the object (text lines say the same in their message).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal

LogFormat = Literal["text", "json"]

# Attributes every LogRecord has: anything else on a record came in through `extra=`.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: timestamp (ISO 8601, UTC), level, logger, message, then the extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in extra_fields(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def setup_logging(level: str = "INFO", fmt: LogFormat = "text", stream: Any = None) -> logging.Handler:
    """Configure the root logger (replacing its handlers) for the worker process."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler


def job_fields(run: Any, event: str, **fields: Any) -> dict[str, Any]:
    """The `extra=` of a job lifecycle line: event, job_id, queue, then the given fields (None ones dropped)."""
    out: dict[str, Any] = {"event": event, "job_id": run.id, "queue": run.queue.name}
    out.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in fields.items() if v is not None})
    return out
