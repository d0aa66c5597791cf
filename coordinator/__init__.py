"""The coordinator: the public generation API, the batch manager and the PSD step loop."""
