"""Errors the services map to gRPC statuses; kept free of heavy imports so the coordinator starts fast."""


class InvalidRequest(ValueError):
    """A request's own fault (INVALID_ARGUMENT, HTTP 400); `param` names the request field at fault where one is.
    Any other ValueError is a fault of ours (INTERNAL)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InternalError(RuntimeError):
    """A broken invariant: what the caller sent was fine, the services disagree among themselves (INTERNAL)."""


class ModelLoadError(ValueError):
    """A model directory or a draft/target pair that cannot be served, with a message a person can act on (a
    ValueError for the start-up code that catches either; FAILED_PRECONDITION if a call meets it)."""


class CapacityError(RuntimeError):
    """No free slot, or a sequence would outgrow the cache."""


class UnknownSequenceError(KeyError):
    """A control message named a sequence this worker does not hold (finished, released, or never prefilled)."""


class ChannelNotSetUpError(RuntimeError):
    """A data-plane call before SetupChannel: the worker restarted since its coordinator set the channel up."""


class ChannelSetupError(RuntimeError):
    """A channel whose two ends cannot meet (a rendezvous refused or timed out): FAILED_PRECONDITION at SetupChannel,
    which fails the coordinator's start."""


class LeaseError(RuntimeError):
    """An internal call or Lease call that the worker's lease refuses (FAILED_PRECONDITION): another coordinator
    holds the worker, or the caller's lease has expired."""


class LeaseSecretError(LeaseError):
    """A Lease call without the deployment's lease secret, which its worker was started with (PERMISSION_DENIED:
    waiting would not help)."""


class RankLostError(RuntimeError):
    """A tensor-parallel rank of this worker died: the worker cannot run its model until it is started again."""
