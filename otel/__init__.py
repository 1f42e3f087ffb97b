"""OpenTelemetry: server spans in, per-endpoint latency statistics, the heatmap out."""
