"""`Client.put_tensor` / `get_tensor` (kvtier.client.tensors) against real servers: dtype and shape
travel with the bytes and are checked on read; a mismatch is an error, never a reinterpreted tensor.

Needs torch (the engines' environment); tests/engines/conftest.py skips this directory without it.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.client import TensorMismatchError
from kvtier.client.tensors import decode_header, encode_header

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool, torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
def test_tensors_round_trip_with_dtype_and_shape(cluster, dtype):
    client = cluster.client()
    source = (torch.arange(2 * 3 * 5) % 7).reshape(2, 3, 5).to(dtype)
    client.put_tensor(f"t/{dtype}", source)
    back = client.get_tensor(f"t/{dtype}", dtype=dtype, shape=(2, 3, 5))
    assert back.dtype == dtype and back.shape == (2, 3, 5)
    assert torch.equal(back, source)
    back.add_(1) if dtype != torch.bool else back.logical_not_()  # the result is the caller's own, writable
    assert not torch.equal(client.get_tensor(f"t/{dtype}"), back)


def test_scalars_empty_and_non_contiguous_tensors(cluster):
    client = cluster.client()
    client.put_tensor("scalar", torch.tensor(3.5))
    assert client.get_tensor("scalar").item() == 3.5 and client.get_tensor("scalar").shape == ()
    client.put_tensor("empty", torch.empty(0, 4, dtype=torch.int32))
    empty = client.get_tensor("empty")
    assert empty.shape == (0, 4) and empty.dtype == torch.int32
    wide = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    client.put_tensor("transposed", wide.t())
    assert torch.equal(client.get_tensor("transposed"), wide.t().contiguous())
    assert client.get_tensor("absent") is None


def test_a_mismatch_is_an_error_never_a_reinterpreted_tensor(cluster):
    client = cluster.client()
    client.put_tensor("kv", torch.ones(4, 8, dtype=torch.float16))
    with pytest.raises(TensorMismatchError, match="float16 tensor, not float32"):
        client.get_tensor("kv", dtype=torch.float32)  # same byte count as (4, 4) float32: refused
    with pytest.raises(TensorMismatchError, match=r"shape \[4, 8\], not \[8, 4\]"):
        client.get_tensor("kv", shape=(8, 4))
    client.put("raw", b"\x00" * 64)
    with pytest.raises(TensorMismatchError, match="not a kvtier tensor object"):
        client.get_tensor("raw")
    # A header whose shape does not match the bytes that follow it (a truncated or foreign object).
    client.put("short", encode_header("float32", (4, 4)) + b"\x00" * 60)
    with pytest.raises(TensorMismatchError, match="60 data bytes"):
        client.get_tensor("short")
    client.put("alien", encode_header("no_such_dtype", (1,)) + b"\x00" * 4)
    with pytest.raises(TensorMismatchError, match="unknown to this torch"):
        client.get_tensor("alien")


def test_put_tensor_refuses_what_it_cannot_store_faithfully(cluster):
    client = cluster.client()
    with pytest.raises(TypeError):
        client.put_tensor("list", [1, 2, 3])
    meta = torch.empty(2, device="meta")
    with pytest.raises(ValueError, match="CPU tensors"):
        client.put_tensor("meta", meta)
    assert not client.exists("list") and not client.exists("meta")


def test_header_layout_is_aligned_and_self_describing():
    header = encode_header("bfloat16", (3, 1, 7))
    assert len(header) % 16 == 0
    assert decode_header(header + bytes(42)) == ("bfloat16", (3, 1, 7), len(header))
