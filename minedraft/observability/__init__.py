"""Observability (layer 4, beside rpc): OpenTelemetry tracing and Prometheus metrics."""
