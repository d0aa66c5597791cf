"""gRPC plumbing (layer 4, beside observability): server set-up, the shared worker servicer, step streams."""
