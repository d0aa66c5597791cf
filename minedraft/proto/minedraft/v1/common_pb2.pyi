from minedraft.proto.minedraft.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SequenceSpec(_message.Message):
    __slots__ = ("seq_id", "prompt_token_ids", "params", "output_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _generation_pb2.SamplingParams
    output_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class DraftPayload(_message.Message):
    __slots__ = ("channel", "step_id", "slot", "batch_size", "num_tokens", "token_ids", "probs", "probs_shape", "probs_dtype", "selected")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    PROBS_SHAPE_FIELD_NUMBER: _ClassVar[int]
    PROBS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    channel: str
    step_id: int
    slot: int
    batch_size: int
    num_tokens: int
    token_ids: bytes
    probs: bytes
    probs_shape: _containers.RepeatedScalarFieldContainer[int]
    probs_dtype: str
    selected: bool
    def __init__(self, channel: _Optional[str] = ..., step_id: _Optional[int] = ..., slot: _Optional[int] = ..., batch_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., probs: _Optional[bytes] = ..., probs_shape: _Optional[_Iterable[int]] = ..., probs_dtype: _Optional[str] = ..., selected: _Optional[bool] = ...) -> None: ...

class TargetPayload(_message.Message):
    __slots__ = ("channel", "step_id", "slot", "rows", "tensors")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    channel: str
    step_id: int
    slot: int
    rows: int
    tensors: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    def __init__(self, channel: _Optional[str] = ..., step_id: _Optional[int] = ..., slot: _Optional[int] = ..., rows: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ...) -> None: ...

class NamedTensor(_message.Message):
    __slots__ = ("name", "shape", "dtype", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("compute_s", "channel_s", "queue_s", "start_unix_s", "end_unix_s")
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    compute_s: float
    channel_s: float
    queue_s: float
    start_unix_s: float
    end_unix_s: float
    def __init__(self, compute_s: _Optional[float] = ..., channel_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., start_unix_s: _Optional[float] = ..., end_unix_s: _Optional[float] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model", "device", "host_id", "num_slots", "max_model_len", "logits_size", "tokenizer_size", "tokenizer_hash", "eos_token_ids", "free_slots", "channels", "gpu_uuid", "gpu_uuids", "block_size", "num_blocks", "free_blocks", "prefix_caching", "reads_target_states")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    LOGITS_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    READS_TARGET_STATES_FIELD_NUMBER: _ClassVar[int]
    model: str
    device: str
    host_id: str
    num_slots: int
    max_model_len: int
    logits_size: int
    tokenizer_size: int
    tokenizer_hash: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    free_slots: int
    channels: _containers.RepeatedScalarFieldContainer[str]
    gpu_uuid: str
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    block_size: int
    num_blocks: int
    free_blocks: int
    prefix_caching: bool
    reads_target_states: bool
    def __init__(self, model: _Optional[str] = ..., device: _Optional[str] = ..., host_id: _Optional[str] = ..., num_slots: _Optional[int] = ..., max_model_len: _Optional[int] = ..., logits_size: _Optional[int] = ..., tokenizer_size: _Optional[int] = ..., tokenizer_hash: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., free_slots: _Optional[int] = ..., channels: _Optional[_Iterable[str]] = ..., gpu_uuid: _Optional[str] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., reads_target_states: _Optional[bool] = ...) -> None: ...

class CallStatus(_message.Message):
    __slots__ = ("code", "message", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("owner", "epoch", "ttl_s")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    owner: str
    epoch: int
    ttl_s: float
    def __init__(self, owner: _Optional[str] = ..., epoch: _Optional[int] = ..., ttl_s: _Optional[float] = ...) -> None: ...
