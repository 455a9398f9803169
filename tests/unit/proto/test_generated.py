"""The committed protobuf/gRPC modules match what protoc generates from the .proto files."""

from __future__ import annotations

import shutil

import pytest

from kvtier.proto import generate


def test_generated_modules_are_current():
    assert generate.main(["--check"]) == 0


def test_check_reports_a_stale_module_without_touching_it(tmp_path, monkeypatch, capsys):
    for path in generate.PROTO_DIR.iterdir():
        if path.suffix in (".proto", ".py", ".pyi"):
            shutil.copy(path, tmp_path / path.name)
    stale = tmp_path / "status_pb2.py"
    stale.write_text(stale.read_text() + "\n# edited by hand\n")
    before = stale.read_bytes()
    monkeypatch.setattr(generate, "PROTO_DIR", tmp_path)
    assert generate.main(["--check"]) == 1
    assert "status_pb2.py" in capsys.readouterr().err
    assert stale.read_bytes() == before


def test_check_reports_a_missing_module(tmp_path, monkeypatch):
    for name in generate.PROTO_FILES:
        shutil.copy(generate.PROTO_DIR / name, tmp_path / name)
    monkeypatch.setattr(generate, "PROTO_DIR", tmp_path)
    assert generate.main(["--check"]) == 1
    assert not any(tmp_path.glob("*_pb2*"))


@pytest.mark.parametrize("name", ["status_pb2", "master_pb2", "master_pb2_grpc"])
def test_generated_modules_import_as_kvtier_proto(name):
    module = __import__(f"kvtier.proto.{name}", fromlist=["_"])
    assert module.__name__ == f"kvtier.proto.{name}"
