"""The Mooncake compat layer's pure parts: Status -> ErrorCode, setup's settings, ReplicateConfig."""

import json
import subprocess
import sys

import pytest

from kvtier.client.compat.mooncake import (
    ErrorCode,
    MooncakeDistributedStore,
    ReplicateConfig,
    SoftPinAction,
    to_error_code,
)
from kvtier.proto.status import Status


def test_every_failure_status_maps_to_a_mooncake_failure_code():
    for status in Status:
        code = to_error_code(int(status))
        assert code in ErrorCode._value2member_map_
        assert (code == 0) == (status == Status.OK), status.name
    assert to_error_code(-9999) == ErrorCode.INTERNAL_ERROR  # a Status this layer does not know yet
    assert to_error_code(4096) == 4096  # byte counts pass through
    assert to_error_code(int(Status.NOT_FOUND)) == ErrorCode.OBJECT_NOT_FOUND
    assert to_error_code(int(Status.NO_SPACE)) == ErrorCode.NO_AVAILABLE_HANDLE


def test_setup_settings_from_both_forms():
    positional = MooncakeDistributedStore._settings(("h", "meta", 1024, "16MiB", "tcp", "", "m:1"), {})
    assert positional["global_segment_size"] == 1024 and positional["local_buffer_size"] == 16 << 20
    assert positional["master_server_addr"] == "m:1" and positional["tenant_id"] == ""
    by_dict = MooncakeDistributedStore._settings(
        ({"master_server_address": "m:2", "global_segment_size": "4GB", "tenant_id": "t", "ipc_socket_path": "x"},), {}
    )
    assert by_dict["master_server_addr"] == "m:2" and by_dict["global_segment_size"] == 4 * 1000**3
    assert by_dict["tenant_id"] == "t"
    with pytest.raises(ValueError, match="unknown setup key"):
        MooncakeDistributedStore._settings(({"nope": 1},), {})
    with pytest.raises(ValueError):
        MooncakeDistributedStore._settings(({"local_buffer_size": "-1"},), {})
    with pytest.raises(TypeError):
        MooncakeDistributedStore._settings(tuple(range(9)), {})
    with_engine = MooncakeDistributedStore._settings(("h", "meta", 1024, 1024, "tcp", "", "m:1", object()), {})
    assert "engine" not in with_engine


def test_replicate_config_placement():
    assert ReplicateConfig().placement() == {"replicas": 1}
    hard = ReplicateConfig(replica_num=2, with_hard_pin=True, preferred_segments=["seg1"])
    assert hard.placement() == {"replicas": 2, "pin": "hard", "preferred_segment": "seg1"}
    soft = ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE, soft_pin_ttl_ms=1500)
    assert soft.placement() == {"replicas": 1, "pin": "soft", "pin_ttl": 1.5}
    with pytest.raises(ValueError):
        ReplicateConfig(replica_num=0).placement()


def test_the_compat_layer_keeps_the_client_thin():
    code = (
        "import json, sys; from kvtier.client.compat.mooncake import MooncakeDistributedStore;"
        " print(json.dumps(sorted(sys.modules)))"
    )
    modules = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout))
    assert not {m.split(".")[0] for m in modules} & {"torch", "numpy", "uvloop", "prometheus_client"}
