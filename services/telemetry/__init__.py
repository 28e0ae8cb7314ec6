"""Observability shared by both services: OpenTelemetry tracing, Prometheus metrics, request logs.

Torch-free (the frontend imports it). Everything here is opt-in: with tracing off no span
objects or interceptors exist, with metrics off no metric objects are touched.
"""
