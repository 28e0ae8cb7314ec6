"""One structured log line per finished request: request id, trace id, tokens, latency, finish reason."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import subprocess
import sys

import grpc
import pytest

from services.telemetry.request_log import TEXT_FORMAT, JsonFormatter, RequestRecord, request_logger
from tests.held_steps import abort, steps_held_until

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


@pytest.fixture
def request_lines():
    """The JSON request lines logged during the test (as dicts)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    level = request_logger.level
    request_logger.addHandler(handler)
    request_logger.setLevel(logging.INFO)
    try:
        yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    finally:
        request_logger.removeHandler(handler)
        request_logger.setLevel(level)


@pytest.mark.parametrize("tracing", [False, True])
def test_a_finished_request_logs_one_line_with_the_clients_trace_id(make_stack, request_lines, tracing):
    stack = make_stack(tracing=tracing)
    stack.run(stack.generate([5, 6, 7, 8, 9], 6, request_id="logged-1", metadata=(("traceparent", TRACEPARENT),)))
    lines = request_lines()
    assert len(lines) == 1
    line = lines[0]
    assert line["logger"] == "tandem.requests" and line["level"] == "INFO" and line["message"] == "request finished"
    assert (line["request_id"], line["trace_id"], line["finish_reason"]) == ("logged-1", TRACE_ID, "length")
    assert (line["prompt_tokens"], line["completion_tokens"], line["cached_tokens"]) == (5, 6, 0)
    assert 0 < line["ttft_s"] <= line["e2e_s"] and line["queue_s"] >= 0


def test_a_cancelled_stream_logs_an_abort(make_stack, request_lines):
    stack = make_stack()

    async def cancel_after_first_token():
        with steps_held_until(stack.engine.server.busy_loop, abort):  # the engine hears the cancel first
            call = stack.stub.Generate(stack.generate_request([5, 6, 7], 80, request_id="cancelled-1"))
            await call.read()
            call.cancel()
            for _ in range(500):
                if request_lines():
                    return
                await asyncio.sleep(0.01)

    stack.run(cancel_after_first_token())
    [line] = request_lines()
    assert (line["request_id"], line["finish_reason"]) == ("cancelled-1", "abort")
    assert line["completion_tokens"] < 80 and line["trace_id"] is None


def test_a_refused_request_logs_nothing(make_stack, request_lines):
    stack = make_stack()
    with pytest.raises(grpc.aio.AioRpcError):
        stack.run(stack.generate([10_000], 2))
    assert request_lines() == []


def test_text_and_json_renderings():
    fields = {"request_id": "r1", "trace_id": None, "finish_reason": "stop", "prompt_tokens": 3, "e2e_s": 0.25}
    record = logging.LogRecord("tandem.requests", logging.INFO, __file__, 1, "%s", (RequestRecord(fields),), None)
    text = logging.Formatter(TEXT_FORMAT).format(record)
    assert text.endswith("INFO tandem.requests: request finished request_id=r1 finish_reason=stop "
                         "prompt_tokens=3 e2e_s=0.25")
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "request finished" and entry["trace_id"] is None and entry["e2e_s"] == 0.25
    plain = logging.LogRecord("x", logging.WARNING, __file__, 1, "engine at %s lost", ("h:1",), None)
    assert json.loads(JsonFormatter().format(plain))["message"] == "engine at h:1 lost"


@pytest.mark.parametrize("level, expected_lines", [("INFO", 1), ("WARNING", 0)])
def test_configure_logging_sets_format_and_level_for_a_process(level, expected_lines):
    code = ("from services.telemetry.request_log import configure_logging, log_request; "
            f"configure_logging({level!r}, 'json'); log_request({{'request_id': 'p1', 'completion_tokens': 4}})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert len(lines) == expected_lines
    if lines:
        assert lines[0]["request_id"] == "p1" and lines[0]["completion_tokens"] == 4
