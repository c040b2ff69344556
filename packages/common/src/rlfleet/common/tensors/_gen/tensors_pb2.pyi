from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorChunk(_message.Message):
    __slots__ = ("key", "name", "dtype", "shape", "offset", "total_bytes", "crc32", "end_of_stream", "tensor_count", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    END_OF_STREAM_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: str
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    total_bytes: int
    crc32: int
    end_of_stream: bool
    tensor_count: int
    data: bytes
    def __init__(self, key: _Optional[str] = ..., name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., crc32: _Optional[int] = ..., end_of_stream: _Optional[bool] = ..., tensor_count: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutSummary(_message.Message):
    __slots__ = ("key", "nbytes", "tensor_count")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    key: str
    nbytes: int
    tensor_count: int
    def __init__(self, key: _Optional[str] = ..., nbytes: _Optional[int] = ..., tensor_count: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key", "names", "max_chunk_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    names: _containers.RepeatedScalarFieldContainer[str]
    max_chunk_bytes: int
    def __init__(self, key: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class StatReply(_message.Message):
    __slots__ = ("used_bytes", "capacity_bytes", "key_count", "tensors", "expires_in_s", "max_message_bytes")
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEY_COUNT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    used_bytes: int
    capacity_bytes: int
    key_count: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    expires_in_s: float
    max_message_bytes: int
    def __init__(self, used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., key_count: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., expires_in_s: _Optional[float] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...
