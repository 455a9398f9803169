"""Mooncake's test_put_get_tensor.py, ported: the tensor calls of kvtier.client.compat.mooncake
against real servers (torch: the engines' environment)."""

from __future__ import annotations

import logging

import torch

from kvtier.client.compat.mooncake import MooncakeDistributedStore


def test_put_get_tensor(cluster):
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 3200 << 20, 512 << 20, "tcp", "", cluster.master_address) == 0
    cases = {
        "test_tensor_float": (torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float32), "float32"),
        "test_tensor_int": (torch.tensor([1, 2, 3, 4], dtype=torch.int32), "int32"),
        "test_tensor_bool": (torch.tensor([True, False, False, True]), "bool"),
        "test_tensor_rand": (torch.rand(1000, dtype=torch.float32), "float32"),
    }
    for key, (tensor, dtype_name) in cases.items():
        assert store.put_tensor(key, tensor) == 0
        retrieved = store.get_tensor(key, dtype_name)
        assert retrieved is not None and retrieved.dtype == tensor.dtype
        assert tuple(retrieved.shape) == tuple(tensor.shape)
        assert torch.equal(tensor, retrieved)
    # kvtier's addition: a dtype other than the stored one is a miss, never reinterpreted bytes
    assert store.get_tensor("test_tensor_int", "float32") is None
    assert store.get_tensor("absent") is None
    assert store.batch_put_tensor(["b0", "b1"], [torch.zeros(3), torch.ones(2, 2)]) == [0, 0]
    got = store.batch_get_tensor(["b0", "b1", "absent"])
    assert torch.equal(got[0], torch.zeros(3)) and torch.equal(got[1], torch.ones(2, 2)) and got[2] is None
    for key in cases:
        assert store.remove(key) == 0
    assert store.close() == 0


def test_an_unknown_dtype_name_is_a_miss_named_in_the_warning(cluster, caplog):
    """The warning said "unknown dtype name None": the name looked up replaced the one given."""
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 3200 << 20, 512 << 20, "tcp", "", cluster.master_address) == 0
    assert store.put_tensor("t", torch.zeros(2)) == 0
    with caplog.at_level(logging.WARNING):
        assert store.get_tensor("t", "nosuchtype") is None
    assert "unknown dtype name 'nosuchtype'" in caplog.text
    assert store.close() == 0
