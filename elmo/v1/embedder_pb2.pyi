from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]

class Overflow(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OVERFLOW_DEFAULT: _ClassVar[Overflow]
    OVERFLOW_REJECT: _ClassVar[Overflow]
    OVERFLOW_TRUNCATE: _ClassVar[Overflow]
    OVERFLOW_WINDOW: _ClassVar[Overflow]

class VersionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERSION_STATE_UNSPECIFIED: _ClassVar[VersionState]
    VERSION_LOADING: _ClassVar[VersionState]
    VERSION_READY: _ClassVar[VersionState]
    VERSION_UNLOADING: _ClassVar[VersionState]
    VERSION_UNLOADED: _ClassVar[VersionState]
    VERSION_FAILED: _ClassVar[VersionState]
FLOAT32: DType
FLOAT16: DType
OVERFLOW_DEFAULT: Overflow
OVERFLOW_REJECT: Overflow
OVERFLOW_TRUNCATE: Overflow
OVERFLOW_WINDOW: Overflow
VERSION_STATE_UNSPECIFIED: VersionState
VERSION_LOADING: VersionState
VERSION_READY: VersionState
VERSION_UNLOADING: VersionState
VERSION_UNLOADED: VersionState
VERSION_FAILED: VersionState

class Tokens(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class Input(_message.Message):
    __slots__ = ("text", "tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: Tokens
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("inputs", "layers", "task", "omit_layers", "dtype", "model", "request_id", "overflow")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    OMIT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[Input]
    layers: _containers.RepeatedScalarFieldContainer[int]
    task: str
    omit_layers: bool
    dtype: DType
    model: str
    request_id: str
    overflow: Overflow
    def __init__(self, inputs: _Optional[_Iterable[_Union[Input, _Mapping]]] = ..., layers: _Optional[_Iterable[int]] = ..., task: _Optional[str] = ..., omit_layers: _Optional[bool] = ..., dtype: _Optional[_Union[DType, str]] = ..., model: _Optional[str] = ..., request_id: _Optional[str] = ..., overflow: _Optional[_Union[Overflow, str]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("shape", "dtype", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Span(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("tokens", "offsets", "layers", "mix", "truncated_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    MIX_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    offsets: _containers.RepeatedCompositeFieldContainer[Span]
    layers: Tensor
    mix: Tensor
    truncated_tokens: int
    def __init__(self, tokens: _Optional[_Iterable[str]] = ..., offsets: _Optional[_Iterable[_Union[Span, _Mapping]]] = ..., layers: _Optional[_Union[Tensor, _Mapping]] = ..., mix: _Optional[_Union[Tensor, _Mapping]] = ..., truncated_tokens: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_ms", "inference_ms", "total_ms", "batch_sentences", "batch_tokens")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SENTENCES_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    inference_ms: float
    total_ms: float
    batch_sentences: int
    batch_tokens: int
    def __init__(self, queue_ms: _Optional[float] = ..., inference_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., batch_sentences: _Optional[int] = ..., batch_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "model", "timing", "layers", "request_id", "model_version", "task_stale")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TASK_STALE_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    model: str
    timing: Timing
    layers: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    model_version: int
    task_stale: bool
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., model: _Optional[str] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., layers: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ..., model_version: _Optional[int] = ..., task_stale: _Optional[bool] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("texts", "model")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    model: str
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ...) -> None: ...

class TokenizedText(_message.Message):
    __slots__ = ("tokens", "offsets")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    offsets: _containers.RepeatedCompositeFieldContainer[Span]
    def __init__(self, tokens: _Optional[_Iterable[str]] = ..., offsets: _Optional[_Iterable[_Union[Span, _Mapping]]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedCompositeFieldContainer[TokenizedText]
    def __init__(self, texts: _Optional[_Iterable[_Union[TokenizedText, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_inputs", "max_tokens_per_sentence", "max_tokens_per_request", "max_message_bytes", "max_response_bytes", "max_pooled_inputs", "max_pooled_tokens")
    MAX_INPUTS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_SENTENCE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_POOLED_INPUTS_FIELD_NUMBER: _ClassVar[int]
    MAX_POOLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_inputs: int
    max_tokens_per_sentence: int
    max_tokens_per_request: int
    max_message_bytes: int
    max_response_bytes: int
    max_pooled_inputs: int
    max_pooled_tokens: int
    def __init__(self, max_inputs: _Optional[int] = ..., max_tokens_per_sentence: _Optional[int] = ..., max_tokens_per_request: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_response_bytes: _Optional[int] = ..., max_pooled_inputs: _Optional[int] = ..., max_pooled_tokens: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "version", "n_layers", "dim", "max_tokens_per_sentence", "tasks", "execution_provider", "limits", "stale_tasks", "model_version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_SENTENCE_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    STALE_TASKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    n_layers: int
    dim: int
    max_tokens_per_sentence: int
    tasks: _containers.RepeatedScalarFieldContainer[str]
    execution_provider: str
    limits: Limits
    stale_tasks: _containers.RepeatedScalarFieldContainer[str]
    model_version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., n_layers: _Optional[int] = ..., dim: _Optional[int] = ..., max_tokens_per_sentence: _Optional[int] = ..., tasks: _Optional[_Iterable[str]] = ..., execution_provider: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., stale_tasks: _Optional[_Iterable[str]] = ..., model_version: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "statuses")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedScalarFieldContainer[str]
    statuses: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    def __init__(self, models: _Optional[_Iterable[str]] = ..., statuses: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ...) -> None: ...

class VersionStatus(_message.Message):
    __slots__ = ("version", "state", "reason", "serving", "memory_bytes", "in_flight")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    version: int
    state: VersionState
    reason: str
    serving: bool
    memory_bytes: int
    in_flight: int
    def __init__(self, version: _Optional[int] = ..., state: _Optional[_Union[VersionState, str]] = ..., reason: _Optional[str] = ..., serving: _Optional[bool] = ..., memory_bytes: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("name", "versions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    versions: _containers.RepeatedCompositeFieldContainer[VersionStatus]
    def __init__(self, name: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[VersionStatus, _Mapping]]] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class RepositoryIndexRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RepositoryIndexResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ...) -> None: ...
