"""The draft service: proposes k tokens per sequence for a whole batch."""
