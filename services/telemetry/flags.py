"""The observability flags both services share: --otel, --otlp-endpoint, --metrics-port, --log-format."""

from __future__ import annotations

import argparse
import os

from services.telemetry.metrics import metrics_port
from services.telemetry.request_log import LOG_FORMATS
from services.telemetry.tracing import TracingSettings


def add_telemetry_arguments(parser) -> None:
    """Add the flags to `parser` (an ArgumentParser or an argument group)."""
    parser.add_argument("--otel", action="store_true",
                        help="export traces over OTLP; endpoint, protocol and service name from --otlp-endpoint "
                             "and the standard OTEL_* variables (OTEL_EXPORTER_OTLP_ENDPOINT, "
                             "OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_SERVICE_NAME)")
    parser.add_argument("--otlp-endpoint", metavar="URL",
                        help="OTLP collector, e.g. http://otel-collector:4317; implies --otel "
                             "(unset: OTEL_EXPORTER_OTLP_ENDPOINT, else http://localhost:4317)")
    parser.add_argument("--metrics-port", type=metrics_port, default="off", metavar="PORT",
                        help="serve Prometheus /metrics on this port; 0 picks a free one, 'off' or a negative "
                             "number serves none (default: %(default)s)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="text, or json: one JSON object per line (default: %(default)s)")


def tracing_settings(args: argparse.Namespace, service_name: str) -> TracingSettings:
    """Tracing is on with --otel or --otlp-endpoint, unless OTEL_SDK_DISABLED=true."""
    disabled = os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    return TracingSettings(enabled=(args.otel or bool(args.otlp_endpoint)) and not disabled,
                           endpoint=args.otlp_endpoint, service_name=service_name)
