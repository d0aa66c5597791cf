"""Whether a failed call to a worker loses that worker to this coordinator, and why (for the log)."""

from __future__ import annotations

import grpc

from minedraft.rpc.server_utils import REASON_KEY


def lost_reason(exc: BaseException) -> str | None:
    """Why the worker a call that raised `exc` went to is lost: unreachable, past a deadline, or (FAILED_PRECONDITION)
    this coordinator's lease or the worker's channel gone. None where it is not: the request's fault, a model the
    worker cannot serve, an error of ours (INTERNAL), or no gRPC error at all."""
    if not isinstance(exc, grpc.aio.AioRpcError):  # (a step stream's failed call raises one too)
        return None
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"unreachable: {details}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "deadline exceeded"
    if code != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    reason = reason_of(exc)
    if reason == "lease":
        return f"lease lost: {details}"
    if reason == "channel":
        return "channel not set up (restarted)"
    if reason is None:  # a worker older than the reasons: each of its FAILED_PRECONDITIONs lost it
        return f"failed precondition: {details}"
    return None


def reason_of(exc: grpc.aio.AioRpcError) -> str | None:
    """The worker's reason for a FAILED_PRECONDITION ("lease", "channel", "model"); None where it sent none."""
    for key, value in exc.trailing_metadata() or ():
        if key == REASON_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None
