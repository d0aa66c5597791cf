from minedraft.proto.minedraft.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftServiceGetInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.WorkerInfo
    def __init__(self, info: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ...) -> None: ...

class DraftServiceSetupChannelRequest(_message.Message):
    __slots__ = ("channel", "handshake", "num_speculative_tokens", "max_batch_size", "num_batches", "setup_timeout_s", "attach_back", "close")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SETUP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ATTACH_BACK_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    channel: str
    handshake: bytes
    num_speculative_tokens: int
    max_batch_size: int
    num_batches: int
    setup_timeout_s: float
    attach_back: bool
    close: bool
    def __init__(self, channel: _Optional[str] = ..., handshake: _Optional[bytes] = ..., num_speculative_tokens: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., num_batches: _Optional[int] = ..., setup_timeout_s: _Optional[float] = ..., attach_back: _Optional[bool] = ..., close: _Optional[bool] = ...) -> None: ...

class DraftServiceSetupChannelResponse(_message.Message):
    __slots__ = ("handshake",)
    HANDSHAKE_FIELD_NUMBER: _ClassVar[int]
    handshake: bytes
    def __init__(self, handshake: _Optional[bytes] = ...) -> None: ...

class DraftServicePrepareRequest(_message.Message):
    __slots__ = ("num_speculative_tokens", "max_batch_size", "num_batches", "tetris")
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    TETRIS_FIELD_NUMBER: _ClassVar[int]
    num_speculative_tokens: int
    max_batch_size: int
    num_batches: int
    tetris: bool
    def __init__(self, num_speculative_tokens: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., num_batches: _Optional[int] = ..., tetris: _Optional[bool] = ...) -> None: ...

class DraftServicePrepareResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftServicePrefillRequest(_message.Message):
    __slots__ = ("sequences", "release_seq_ids", "from_target")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    FROM_TARGET_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[_common_pb2.SequenceSpec]
    release_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    from_target: _common_pb2.TargetPayload
    def __init__(self, sequences: _Optional[_Iterable[_Union[_common_pb2.SequenceSpec, _Mapping]]] = ..., release_seq_ids: _Optional[_Iterable[int]] = ..., from_target: _Optional[_Union[_common_pb2.TargetPayload, _Mapping]] = ...) -> None: ...

class DraftServicePrefillResponse(_message.Message):
    __slots__ = ("timings", "cached_prompt_tokens", "free_blocks")
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    timings: _common_pb2.Timings
    cached_prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    free_blocks: int
    def __init__(self, timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., cached_prompt_tokens: _Optional[_Iterable[int]] = ..., free_blocks: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("step_id", "batch_id", "seq_ids", "num_accepted", "next_token_ids", "num_draft_tokens", "release_seq_ids", "num_missed_tokens", "missed_token_ids", "from_target", "verify_token_budget")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MISSED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FROM_TARGET_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    batch_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: _containers.RepeatedScalarFieldContainer[int]
    next_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    release_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_missed_tokens: _containers.RepeatedScalarFieldContainer[int]
    missed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    from_target: _common_pb2.TargetPayload
    verify_token_budget: int
    def __init__(self, step_id: _Optional[int] = ..., batch_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[_Iterable[int]] = ..., next_token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ..., release_seq_ids: _Optional[_Iterable[int]] = ..., num_missed_tokens: _Optional[_Iterable[int]] = ..., missed_token_ids: _Optional[_Iterable[int]] = ..., from_target: _Optional[_Union[_common_pb2.TargetPayload, _Mapping]] = ..., verify_token_budget: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("drafts", "timings", "free_blocks")
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    drafts: _common_pb2.DraftPayload
    timings: _common_pb2.Timings
    free_blocks: int
    def __init__(self, drafts: _Optional[_Union[_common_pb2.DraftPayload, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., free_blocks: _Optional[int] = ...) -> None: ...

class ProposeStreamRequest(_message.Message):
    __slots__ = ("propose", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    propose: ProposeRequest
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, propose: _Optional[_Union[ProposeRequest, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ProposeStreamResponse(_message.Message):
    __slots__ = ("propose", "status")
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    propose: ProposeResponse
    status: _common_pb2.CallStatus
    def __init__(self, propose: _Optional[_Union[ProposeResponse, _Mapping]] = ..., status: _Optional[_Union[_common_pb2.CallStatus, _Mapping]] = ...) -> None: ...

class DraftServiceReleaseRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftServiceReleaseResponse(_message.Message):
    __slots__ = ("free_slots", "free_blocks")
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    free_slots: int
    free_blocks: int
    def __init__(self, free_slots: _Optional[int] = ..., free_blocks: _Optional[int] = ...) -> None: ...

class DraftServiceLeaseRequest(_message.Message):
    __slots__ = ("owner", "epoch", "give_up")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GIVE_UP_FIELD_NUMBER: _ClassVar[int]
    owner: str
    epoch: int
    give_up: bool
    def __init__(self, owner: _Optional[str] = ..., epoch: _Optional[int] = ..., give_up: _Optional[bool] = ...) -> None: ...

class DraftServiceLeaseResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: _common_pb2.Lease
    def __init__(self, lease: _Optional[_Union[_common_pb2.Lease, _Mapping]] = ...) -> None: ...
