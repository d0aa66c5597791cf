"""What the coordinator and both services share: engine, channels, sampling, telemetry and the CLI."""
