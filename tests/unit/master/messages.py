"""Hypothesis strategies for arbitrary protobuf messages of the master's API, built from descriptors.

`messages(message_type)` draws any value of every field: integers over the
field's whole range with its extremes and the small numbers that name real
segments, epochs and ids; strings from a pool of names the tables know (so a
draw reaches past validation), arbitrary text, NUL bytes, or huge; enum
fields with unknown values (proto3 enums are open); repeated fields of
independent lengths, so parallel arrays often disagree; nested messages a
few levels deep. Shared by the handler and fast-path fuzz tests.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from kvtier.proto import master_pb2 as pb

# Names the fuzzed tables hold, so random requests also reach the logic behind validation.
KNOWN_STRINGS = ["default", "ns", "k0", "k1", "k2", "k", "seg0", "seg1", "inst", "unit", "", "*", "ns\x00k0"]

Hints = dict[str, st.SearchStrategy]

_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_ENUM: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_FIXED32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_UINT64: (0, (1 << 64) - 1),
    FieldDescriptor.TYPE_FIXED64: (0, (1 << 64) - 1),
}


def integers(low: int, high: int) -> st.SearchStrategy[int]:
    special = [v for v in (0, 1, 2, 3, 64, 4096, 1 << 20, low, high, high // 2, -1) if low <= v <= high]
    return st.one_of(st.sampled_from(special), st.integers(0, min(high, 1 << 24)), st.integers(low, high))


def strings() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(KNOWN_STRINGS),
        st.text(max_size=40),
        st.text(alphabet=st.sampled_from("ab\x00/\udcff\u00e9-"), max_size=8).filter(_encodable),
        st.sampled_from(["x" * 1025, "k" * 100_000, "\x00" * 64]),  # over the key limit, huge, all NUL
    ).filter(_encodable)


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate: protobuf refuses it before any master sees it
        return False
    return True


def _scalar(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    kind = field.type
    if kind in _RANGES:
        low, high = _RANGES[kind]
        if kind == FieldDescriptor.TYPE_ENUM:
            known = [v.number for v in field.enum_type.values]
            return st.one_of(st.sampled_from(known), integers(low, high))
        return integers(low, high)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.floats(allow_nan=True, allow_infinity=True, width=32 if kind == FieldDescriptor.TYPE_FLOAT else 64)
    if kind == FieldDescriptor.TYPE_STRING:
        return strings()
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FieldDescriptor.TYPE_MESSAGE:
        return _message(field.message_type, depth + 1)
    raise AssertionError(f"unhandled protobuf field type {kind} of {field.full_name}")


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _message(descriptor: Descriptor, depth: int = 0, hints: Hints | None = None) -> st.SearchStrategy[dict]:
    """A dict of field name -> value for `descriptor` (fields left out keep their defaults): its
    repeated fields of independent lengths, or all of one length (parallel arrays that agree)."""
    if depth > 2:
        return st.just({})
    hints = hints or {}

    def fields(length: int | None) -> st.SearchStrategy[dict]:
        size = {"max_size": 6} if length is None else {"min_size": length, "max_size": length}
        required, optional = {}, {}
        for field in descriptor.fields:
            generic = _scalar(field, depth)
            hint = hints.get(field.name)
            if _is_map(field):
                key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
                optional[field.name] = st.dictionaries(_scalar(key, depth), _scalar(value, depth), max_size=3)
            elif hint is None:
                optional[field.name] = st.lists(generic, **size) if field.is_repeated else generic
            elif field.is_repeated:  # all hinted, or hinted and arbitrary elements mixed
                required[field.name] = st.one_of(st.lists(hint, **size), st.lists(st.one_of(hint, generic), **size))
            else:
                required[field.name] = st.one_of(hint, generic)
        return st.fixed_dictionaries(required, optional=optional)

    return st.one_of(fields(None), st.integers(1, 4).flatmap(fields))


def _build(message_type: type[Message], values: dict) -> Message:
    message = message_type()
    _fill(message, values)
    return message


def _fill(message: Message, values: dict) -> None:
    descriptor = message.DESCRIPTOR
    for name, value in values.items():
        field = descriptor.fields_by_name[name]
        if _is_map(field):
            target = getattr(message, name)
            for key, item in value.items():
                if field.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE:
                    _fill(target[key], item)
                else:
                    target[key] = item
        elif field.is_repeated:
            target = getattr(message, name)
            for item in value:
                if field.type == FieldDescriptor.TYPE_MESSAGE:
                    _fill(target.add(), item)
                else:
                    target.append(item)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            _fill(getattr(message, name), value)
        else:
            setattr(message, name, value)


def messages(message_type: type[Message], hints: Hints | None = None) -> st.SearchStrategy[Message]:
    """Any message of `message_type`, as described in the module docstring. `hints`: field name ->
    a strategy drawn from about half the time (for a repeated field: its elements), so that
    requests name the segments, epochs and keys the tables hold."""
    return _message(message_type.DESCRIPTOR, hints=hints).map(lambda values: _build(message_type, values))


SERVICE = pb.DESCRIPTOR.services_by_name["Master"]


def request_type(rpc: str) -> type[Message]:
    return getattr(pb, SERVICE.methods_by_name[rpc].input_type.name)


def response_type(rpc: str) -> type[Message]:
    return getattr(pb, SERVICE.methods_by_name[rpc].output_type.name)
