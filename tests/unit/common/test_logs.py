"""Structured key=value log lines: events split from their pairs, values quoted, one line, request ids."""

from __future__ import annotations

import json
import logging
import re

import pytest

from kvtier.common.logs import KeyValueFormatter, quote, request_id, split_message

_FIELD = re.compile(r'([\w.]+)=("(?:[^"\\]|\\.)*"|\S*)')


def parse(line: str) -> dict[str, str]:
    """A logfmt line back into fields (JSON-quoted values decoded)."""
    fields = {}
    for key, raw in _FIELD.findall(line):
        fields[key] = json.loads(raw) if raw.startswith('"') else raw
    return fields


def _record(message: str, *args, level=logging.INFO, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("kvtier.test", level, __file__, 1, message, args, exc_info)


@pytest.mark.parametrize(
    ("message", "event", "pairs"),
    [
        ("master stopping", "master stopping", []),
        ("segment mounted id=3 name=a b", "segment mounted", [("id", "3"), ("name", "a b")]),
        ("slow rpc method=PutEnd seconds=0.512", "slow rpc", [("method", "PutEnd"), ("seconds", "0.512")]),
        (
            "offload failed segment_id=2 status=NO_SPACE: offload paused 5s",
            "offload failed",
            [("segment_id", "2"), ("status", "NO_SPACE: offload paused 5s")],
        ),
        ("key=v", "", [("key", "v")]),
        ("a == b but not=", "a == b but", [("not", "")]),
    ],
)
def test_split_message(message, event, pairs):
    assert split_message(message) == (event, pairs)


@pytest.mark.parametrize("value", ["plain", "", "two words", 'q"uote', "a=b", "line\nbreak", "back\\slash", "tab\t"])
def test_quote_round_trips_through_a_logfmt_parser(value):
    assert parse(f"k={quote(value)}") == {"k": value}


def test_a_line_carries_level_component_request_id_and_pairs():
    formatter = KeyValueFormatter("segment")
    token = request_id.set(0x5F3A9C010000002A)
    try:
        line = formatter.format(_record("range error peer=%s detail=%s", "127.0.0.1:5", "offset 9 beyond 8"))
    finally:
        request_id.reset(token)
    fields = parse(line)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", fields["ts"])
    assert fields["level"] == "info" and fields["component"] == "segment" and fields["logger"] == "kvtier.test"
    assert fields["rid"] == "5f3a9c01-0000002a"
    assert fields["msg"] == "range error"
    assert fields["peer"] == "127.0.0.1:5" and fields["detail"] == "offset 9 beyond 8"
    # Outside a request there is no rid field at all.
    assert "rid" not in parse(formatter.format(_record("idle")))


def test_a_traceback_stays_on_one_line():
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        import sys

        record = _record("rpc failed method=%s", "Remove", level=logging.ERROR, exc_info=sys.exc_info())
    line = KeyValueFormatter("master").format(record)
    assert "\n" not in line
    fields = parse(line)
    assert fields["level"] == "error" and fields["method"] == "Remove"
    assert "Traceback" in fields["exc"] and "ValueError: boom\nsecond line" in fields["exc"]


def test_structured_fields_are_never_split():
    record = _record("request refused")
    record.fields = {"status": "INVALID_RANGE", "detail": "range offset=4096 length=64 outside region of 4096"}
    fields = parse(KeyValueFormatter("segment").format(record))
    assert fields["msg"] == "request refused"
    assert fields["detail"] == "range offset=4096 length=64 outside region of 4096"
    assert "offset" not in fields and "length" not in fields
