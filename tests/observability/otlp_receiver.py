"""A real OTLP/gRPC trace receiver in the test's process, for services that run as processes of their own.

Services export with their production exporter (`--otel --otlp-endpoint http://127.0.0.1:PORT`); the
receiver keeps every span with the service.name of its resource, and `wait_for` blocks until the spans
received satisfy a predicate (observable state, not a sleep). Always `stop()` it.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict


def _value(any_value):
    return getattr(any_value, any_value.WhichOneof("value")) if any_value.WhichOneof("value") else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._received = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                received += [ReceivedSpan(resource.get("service.name", ""), span.name, span.trace_id.hex(),
                                          span.span_id.hex(), span.parent_span_id.hex(),
                                          {a.key: _value(a.value) for a in span.attributes})
                             for span in scope_spans.spans]
        with self._received:
            self.spans += received
            self._received.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, found, what: str, timeout: float = 60.0):
        """`found(spans)` once it is truthy; AssertionError naming `what` and the spans so far after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._received:
            while not (value := found(list(self.spans))):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = [(s.service, s.name) for s in self.spans]
                    raise AssertionError(f"timed out waiting for {what}; spans received: {names}")
                self._received.wait(left)
            return value

    def stop(self) -> None:
        self._server.stop(None)
