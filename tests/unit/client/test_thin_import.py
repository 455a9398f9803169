"""Importing the client must stay light enough for an engine process: no server code, no heavy deps."""

import json
import subprocess
import sys

FORBIDDEN_TOP_LEVEL = {"uvloop", "numpy", "prometheus_client", "torch", "redis"}
FORBIDDEN_KVTIER = {"kvtier.master", "kvtier.segment_server", "kvtier.bench", "kvtier.cli"}


def test_importing_the_client_pulls_in_only_its_declared_dependencies():
    code = "import json, sys; from kvtier.client import Client, Status; print(json.dumps(sorted(sys.modules)))"
    modules = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout))
    assert not {m.split(".")[0] for m in modules} & FORBIDDEN_TOP_LEVEL
    assert not {m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_KVTIER)}
    assert {"grpc", "google.protobuf", "crc32c"} <= modules
