"""Request parsing that turns undecodable bytes into a clear INVALID_ARGUMENT instead of gRPC's bare INTERNAL.

Python protobuf rejects a ``string`` field holding invalid UTF-8 while parsing, before any servicer code runs;
gRPC would then answer INTERNAL "Exception deserializing request!". Here the deserializer catches the failure and
re-reads the bytes with a *lenient twin* of the message type (same field numbers, every ``string`` field declared
``bytes``, built once in a private descriptor pool) to name the exact field and byte that is wrong:
``inputs[2].tokens.tokens[0] is not valid UTF-8 (byte 0xff at offset 3)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message


@dataclass(frozen=True)
class UndecodableRequest:
    """Stands in for a request that failed to parse; the servicer answers INVALID_ARGUMENT with ``message``."""

    message: str


def lenient_parser(message_cls: type[Message]):
    """A deserializer for ``message_cls`` that returns :class:`UndecodableRequest` instead of raising."""

    def parse(data: bytes) -> Message | UndecodableRequest:
        try:
            return message_cls.FromString(data)
        except DecodeError:
            return UndecodableRequest(explain_decode_failure(message_cls, data))

    return parse


def explain_decode_failure(message_cls: type[Message], data: bytes) -> str:
    name = message_cls.DESCRIPTOR.full_name
    try:
        twin = _lenient_twin(message_cls.DESCRIPTOR.file.name, name).FromString(data)
    except DecodeError:
        return f"request is not a valid {name} message (malformed protobuf, {len(data)} bytes)"
    problem = _first_bad_utf8(twin, message_cls.DESCRIPTOR, "")
    if problem is None:  # parsed leniently but not strictly: should not happen, say what we know
        return f"request is not a valid {name} message"
    return f"{problem}; strings must be UTF-8 encoded"


@cache
def _lenient_twin(file_name: str, full_name: str) -> type[Message]:
    """Build (once) a copy of the proto file whose string fields are bytes, and return the twin of ``full_name``."""
    original = descriptor_pool.Default().FindFileByName(file_name)
    pool = descriptor_pool.DescriptorPool()
    for dependency in original.dependencies:
        pool.Add(_file_proto(dependency))
    proto = _file_proto(original)
    for message in proto.message_type:
        _strings_to_bytes(message)
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(full_name))


def _file_proto(file_descriptor) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    file_descriptor.CopyToProto(proto)
    return proto


def _strings_to_bytes(message: descriptor_pb2.DescriptorProto) -> None:
    for field in message.field:
        if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
            field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    for nested in message.nested_type:
        _strings_to_bytes(nested)


def _first_bad_utf8(message: Message, strict_descriptor, path: str) -> str | None:
    """Walk the lenient message along the strict descriptor; return 'field.path is not valid UTF-8 (...)'."""
    for field in strict_descriptor.fields:
        value = getattr(message, field.name)
        repeated = field.is_repeated
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if repeated:
                children = [(f"{path}{field.name}[{i}]", v) for i, v in enumerate(value)]
            elif message.HasField(field.name):
                children = [(f"{path}{field.name}", value)]
            else:
                children = []
            for child_path, child in children:
                found = _first_bad_utf8(child, field.message_type, child_path + ".")
                if found:
                    return found
        elif field.type == FieldDescriptor.TYPE_STRING:
            values = (
                [(f"{path}{field.name}[{i}]", v) for i, v in enumerate(value)]
                if repeated
                else [(f"{path}{field.name}", value)]
            )
            for value_path, raw in values:
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    return f"{value_path} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
    return None


__all__ = ["UndecodableRequest", "explain_decode_failure", "lenient_parser"]
