"""parse_size, format_size and parse_hostport."""

from __future__ import annotations

import pytest

from kvtier.common.units import format_size, parse_hostport, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        ("4096b", 4096),
        ("1k", 1000),
        ("1KB", 1000),
        ("1KiB", 1024),
        ("512MiB", 512 << 20),
        ("512mib", 512 << 20),
        ("4GiB", 4 << 30),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 3 << 29),
        ("2T", 2 * 1000**4),
        ("1TiB", 1 << 40),
        ("  8 MiB  ", 8 << 20),
        (0, 0),
        (12345, 12345),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "   ", "MiB", "lots", "12XB", "-1", "-1GiB", "1e3", "1,000", "0x10", "1.5.5GiB", "4 GiB extra", ".5G"]
)
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_parse_size_rejects_negative_ints():
    with pytest.raises(ValueError, match="negative"):
        parse_size(-1)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (512 << 20, "512.0 MiB"),
        (3 << 29, "1.5 GiB"),
        (1 << 40, "1.0 TiB"),
        (1 << 50, "1024.0 TiB"),
    ],
)
def test_format_size(n, expected):
    assert format_size(n) == expected


@pytest.mark.parametrize("n", [1, 4096, 512 << 20, 4 << 30, 1 << 40])
def test_format_then_parse_round_trips_binary_units(n):
    assert parse_size(format_size(n).replace(" ", "")) == n


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:50051", ("127.0.0.1", 50051)),
        ("localhost:0", ("localhost", 0)),
        ("host.example:65535", ("host.example", 65535)),
        (":8080", ("127.0.0.1", 8080)),
        ("[::1]:80", ("::1", 80)),
        ("[fe80::1%eth0]:9000", ("fe80::1%eth0", 9000)),
        ("[::]:0", ("::", 0)),
    ],
)
def test_parse_hostport(text, expected):
    assert parse_hostport(text) == expected


def test_parse_hostport_default_host():
    assert parse_hostport(":1", default_host="0.0.0.0") == ("0.0.0.0", 1)


@pytest.mark.parametrize(
    "text", ["", "localhost", "host:", "host:65536", "host:-1", "host:http", "host: 80", "[::1]", "1.2.3.4:8o"]
)
def test_parse_hostport_rejects(text):
    with pytest.raises(ValueError, match="invalid address"):
        parse_hostport(text)
