"""The application (top layer): the `minedraft` CLI, the load generator, offline generation, stack launching."""
