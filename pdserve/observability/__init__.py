"""Traces (OpenTelemetry) and structured logs, shared by the router and the instances."""
