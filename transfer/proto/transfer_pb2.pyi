from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_INCOMPATIBLE: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_NO_CAPACITY: _ClassVar[ErrorCode]
    ERROR_CODE_UNKNOWN_REQUEST: _ClassVar[ErrorCode]
    ERROR_CODE_CHECKSUM_MISMATCH: _ClassVar[ErrorCode]
    ERROR_CODE_PEER_RESTARTED: _ClassVar[ErrorCode]
    ERROR_CODE_UNREACHABLE: _ClassVar[ErrorCode]
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_INCOMPATIBLE: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_NO_CAPACITY: ErrorCode
ERROR_CODE_UNKNOWN_REQUEST: ErrorCode
ERROR_CODE_CHECKSUM_MISMATCH: ErrorCode
ERROR_CODE_PEER_RESTARTED: ErrorCode
ERROR_CODE_UNREACHABLE: ErrorCode

class Region(_message.Message):
    __slots__ = ("name", "addr", "length", "device")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    name: str
    addr: int
    length: int
    device: str
    def __init__(self, name: _Optional[str] = ..., addr: _Optional[int] = ..., length: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class AgentInfo(_message.Message):
    __slots__ = ("backend", "endpoint", "metadata", "regions")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    endpoint: str
    metadata: bytes
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, backend: _Optional[str] = ..., endpoint: _Optional[str] = ..., metadata: _Optional[bytes] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("agent", "layout_json", "tp_size", "tp_rank", "compat_hash", "request_id")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    agent: AgentInfo
    layout_json: str
    tp_size: int
    tp_rank: int
    compat_hash: str
    request_id: str
    def __init__(self, agent: _Optional[_Union[AgentInfo, _Mapping]] = ..., layout_json: _Optional[str] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., compat_hash: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("ok", "error", "code", "agent", "layout_json", "tp_size", "tp_rank", "compat_hash", "instance_id")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    code: ErrorCode
    agent: AgentInfo
    layout_json: str
    tp_size: int
    tp_rank: int
    compat_hash: str
    instance_id: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., code: _Optional[_Union[ErrorCode, str]] = ..., agent: _Optional[_Union[AgentInfo, _Mapping]] = ..., layout_json: _Optional[str] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., compat_hash: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_tokens", "lease_seconds", "instance_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    lease_seconds: float
    instance_id: str
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., instance_id: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("ok", "error", "code", "block_ids", "slot_id", "lease_deadline_unix", "attempt")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    code: ErrorCode
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slot_id: int
    lease_deadline_unix: float
    attempt: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., code: _Optional[_Union[ErrorCode, str]] = ..., block_ids: _Optional[_Iterable[int]] = ..., slot_id: _Optional[int] = ..., lease_deadline_unix: _Optional[float] = ..., attempt: _Optional[int] = ...) -> None: ...

class TransferReadyRequest(_message.Message):
    __slots__ = ("request_id", "from_rank", "first_token_id", "num_tokens", "checksums", "attempt")
    class ChecksumsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    from_rank: int
    first_token_id: int
    num_tokens: int
    checksums: _containers.ScalarMap[str, str]
    attempt: int
    def __init__(self, request_id: _Optional[str] = ..., from_rank: _Optional[int] = ..., first_token_id: _Optional[int] = ..., num_tokens: _Optional[int] = ..., checksums: _Optional[_Mapping[str, str]] = ..., attempt: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("ok", "error", "code")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    code: ErrorCode
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., code: _Optional[_Union[ErrorCode, str]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("request_ids", "sender")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    sender: str
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., sender: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("ok", "error", "code", "unknown_request_ids", "instance_id")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    code: ErrorCode
    unknown_request_ids: _containers.RepeatedScalarFieldContainer[str]
    instance_id: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., code: _Optional[_Union[ErrorCode, str]] = ..., unknown_request_ids: _Optional[_Iterable[str]] = ..., instance_id: _Optional[str] = ...) -> None: ...
