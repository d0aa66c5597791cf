"""Data plane: how draft tokens and probabilities travel from the draft service to the target service."""

from minedraft.channels.base import Channel
from minedraft.channels.registry import make_channel

__all__ = ["Channel", "make_channel"]
