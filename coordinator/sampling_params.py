"""A request's SamplingParams from the values a client was given, as the HTTP API and `minedraft generate` build it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from minedraft.proto import generation_pb2

FIELDS = frozenset(generation_pb2.SamplingParams.DESCRIPTOR.fields_by_name)


def sampling_params(given: Mapping[str, Any]) -> generation_pb2.SamplingParams:
    """SamplingParams of the entries of `given` named as its fields, those that are None left out: an optional
    field is then unset, which differs from 0 (unset top_p is 1, a top_p of 0 is refused; unset seed is random)."""
    return generation_pb2.SamplingParams(**{k: v for k, v in given.items() if k in FIELDS and v is not None})
