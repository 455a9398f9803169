"""The committed protobuf/gRPC modules match what protoc generates from the .proto files."""

from __future__ import annotations

import shutil

import pytest

from kvtier.proto import generate


def test_generated_modules_are_current():
    assert generate.main(["--check"]) == 0


def _copy_proto_tree(dst, suffixes=(".proto", ".py", ".pyi")):
    for path in generate.PROTO_DIR.rglob("*"):
        if path.suffix in suffixes and "__pycache__" not in path.parts:
            target = dst / path.relative_to(generate.PROTO_DIR)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)


@pytest.mark.parametrize("module", ["status_pb2.py", "etcd/rpc_pb2_grpc.py"])
def test_check_reports_a_stale_module_without_touching_it(tmp_path, monkeypatch, capsys, module):
    _copy_proto_tree(tmp_path)
    stale = tmp_path / module
    stale.write_text(stale.read_text() + "\n# edited by hand\n")
    before = stale.read_bytes()
    monkeypatch.setattr(generate, "PROTO_DIR", tmp_path)
    assert generate.main(["--check"]) == 1
    assert module in capsys.readouterr().err
    assert stale.read_bytes() == before


def test_check_reports_a_missing_module(tmp_path, monkeypatch):
    _copy_proto_tree(tmp_path, suffixes=(".proto",))
    monkeypatch.setattr(generate, "PROTO_DIR", tmp_path)
    assert generate.main(["--check"]) == 1
    assert not any(tmp_path.rglob("*_pb2*"))


@pytest.mark.parametrize(
    "name", ["status_pb2", "master_pb2", "master_pb2_grpc", "etcd.kv_pb2", "etcd.rpc_pb2", "etcd.rpc_pb2_grpc"]
)
def test_generated_modules_import_as_kvtier_proto(name):
    module = __import__(f"kvtier.proto.{name}", fromlist=["_"])
    assert module.__name__ == f"kvtier.proto.{name}"
