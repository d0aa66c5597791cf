from minedraft.proto.minedraft.v1 import common_pb2 as _common_pb2
from minedraft.proto.minedraft.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetServiceGetInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.WorkerInfo
    def __init__(self, info: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ...) -> None: ...

class TargetServiceSetupChannelRequest(_message.Message):
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

class TargetServiceSetupChannelResponse(_message.Message):
    __slots__ = ("handshake",)
    HANDSHAKE_FIELD_NUMBER: _ClassVar[int]
    handshake: bytes
    def __init__(self, handshake: _Optional[bytes] = ...) -> None: ...

class TargetServicePrepareRequest(_message.Message):
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

class TargetServicePrepareResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetServicePrefillRequest(_message.Message):
    __slots__ = ("sequences", "release_seq_ids")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[_common_pb2.SequenceSpec]
    release_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequences: _Optional[_Iterable[_Union[_common_pb2.SequenceSpec, _Mapping]]] = ..., release_seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TargetServicePrefillResponse(_message.Message):
    __slots__ = ("results", "timings", "free_blocks", "to_draft")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TO_DRAFT_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SequenceResult]
    timings: _common_pb2.Timings
    free_blocks: int
    to_draft: _common_pb2.TargetPayload
    def __init__(self, results: _Optional[_Iterable[_Union[SequenceResult, _Mapping]]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., free_blocks: _Optional[int] = ..., to_draft: _Optional[_Union[_common_pb2.TargetPayload, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("step_id", "batch_id", "seq_ids", "drafts", "num_draft_tokens", "release_seq_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    batch_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    drafts: _common_pb2.DraftPayload
    num_draft_tokens: int
    release_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., batch_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., drafts: _Optional[_Union[_common_pb2.DraftPayload, _Mapping]] = ..., num_draft_tokens: _Optional[int] = ..., release_seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results", "timings", "free_blocks", "to_draft")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TO_DRAFT_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SequenceResult]
    timings: _common_pb2.Timings
    free_blocks: int
    to_draft: _common_pb2.TargetPayload
    def __init__(self, results: _Optional[_Iterable[_Union[SequenceResult, _Mapping]]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., free_blocks: _Optional[int] = ..., to_draft: _Optional[_Union[_common_pb2.TargetPayload, _Mapping]] = ...) -> None: ...

class VerifyStreamRequest(_message.Message):
    __slots__ = ("verify", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    verify: VerifyRequest
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, verify: _Optional[_Union[VerifyRequest, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class VerifyStreamResponse(_message.Message):
    __slots__ = ("verify", "status")
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    verify: VerifyResponse
    status: _common_pb2.CallStatus
    def __init__(self, verify: _Optional[_Union[VerifyResponse, _Mapping]] = ..., status: _Optional[_Union[_common_pb2.CallStatus, _Mapping]] = ...) -> None: ...

class SequenceResult(_message.Message):
    __slots__ = ("seq_id", "token_ids", "num_accepted", "finish_reason", "cached_prompt_tokens", "logprobs", "prompt_logprobs", "num_verified_drafts")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    finish_reason: _generation_pb2.FinishReason
    cached_prompt_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    num_verified_drafts: int
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., cached_prompt_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., num_verified_drafts: _Optional[int] = ...) -> None: ...

class TargetServiceReleaseRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TargetServiceReleaseResponse(_message.Message):
    __slots__ = ("free_slots", "free_blocks")
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    free_slots: int
    free_blocks: int
    def __init__(self, free_slots: _Optional[int] = ..., free_blocks: _Optional[int] = ...) -> None: ...

class TargetServiceLeaseRequest(_message.Message):
    __slots__ = ("owner", "epoch", "give_up")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GIVE_UP_FIELD_NUMBER: _ClassVar[int]
    owner: str
    epoch: int
    give_up: bool
    def __init__(self, owner: _Optional[str] = ..., epoch: _Optional[int] = ..., give_up: _Optional[bool] = ...) -> None: ...

class TargetServiceLeaseResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: _common_pb2.Lease
    def __init__(self, lease: _Optional[_Union[_common_pb2.Lease, _Mapping]] = ...) -> None: ...
