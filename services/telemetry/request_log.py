"""Logs: --log-format text|json, --log-level, and one structured line per finished request.

The request line goes to the `tandem.requests` logger at INFO:

    text: ... INFO tandem.requests: request finished request_id=ab12 trace_id=4bf9... prompt_tokens=12 ...
    json: {"time": "...", "level": "INFO", "logger": "tandem.requests", "message": "request finished",
           "request_id": "ab12", "trace_id": "4bf9...", "prompt_tokens": 12, ...}
"""

from __future__ import annotations

import json
import logging
import sys

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

request_logger = logging.getLogger("tandem.requests")


class RequestRecord:
    """A finished request's fields; renders as `key=value` pairs in text logs, as top-level keys in JSON."""

    message = "request finished"

    def __init__(self, fields: dict) -> None:
        self.fields = fields

    def __str__(self) -> str:
        pairs = " ".join(f"{key}={_text(value)}" for key, value in self.fields.items() if value is not None)
        return f"{self.message} {pairs}"


def _text(value) -> str:
    return f"{value:.6f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)


def log_request(fields: dict) -> None:
    """The one line for a finished request (request_id, trace_id, tokens, latencies, finish_reason)."""
    if request_logger.isEnabledFor(logging.INFO):
        request_logger.info("%s", RequestRecord(fields))


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a RequestRecord's fields become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name}
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) == 1 and isinstance(args[0], RequestRecord):
            entry["message"] = args[0].message
            entry.update(args[0].fields)
        else:
            entry["message"] = record.getMessage()
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str = "INFO", log_format: str = "text", stream=None) -> None:
    """Root logging for a service process: `level` and `log_format` (text or json) on stderr.

    Like logging.basicConfig, a no-op when the root logger already has handlers (an embedding app, pytest).
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
