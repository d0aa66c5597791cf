"""The target service: prefills, verifies drafts, samples losslessly and commits accepted tokens."""
