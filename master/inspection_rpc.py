"""Request plumbing of the read-only inspection RPCs (`ListKeys`, `StatKeys`): parse, call
kvtier.master.inspection, build the response.

Kept out of kvtier.master.servicer only for size: `HANDLERS` is installed on
`MasterHandlers` there, through the same `_rpc` wrapper as every other handler
(request and failure counts, latency histogram, leader/recovery gate: both are
data calls, refused with UNAVAILABLE by a standby or a recovering master).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvtier.master.inspection import list_keys, stat_keys
from kvtier.proto import master_pb2 as pb
from kvtier.proto.keys import check_namespace
from kvtier.proto.status import Status


def ListKeys(handlers: Any, request: pb.ListKeysRequest) -> pb.ListKeysResponse:
    r = request
    page = list_keys(handlers.state, check_namespace(r.namespace), r.prefix, r.start_after, r.limit, r.include_pending)
    entries = [pb.KeyEntry(**asdict(entry)) for entry in page.entries]
    return pb.ListKeysResponse(status=Status.OK, entries=entries, next_start_after=page.next_start_after)


def StatKeys(handlers: Any, request: pb.KeysRequest) -> pb.StatKeysResponse:
    namespace = check_namespace(request.namespace)
    if rejected := handlers._too_many(request.keys, pb.StatKeysResponse):
        return rejected
    statuses, infos = stat_keys(handlers.state, namespace, request.keys)
    objects = [pb.ObjectInfo(**asdict(info)) if info else pb.ObjectInfo() for info in infos]
    return pb.StatKeysResponse(status=Status.OK, statuses=statuses, objects=objects)


# RPC name -> (response type, handler taking the MasterHandlers and the request)
HANDLERS = {"ListKeys": (pb.ListKeysResponse, ListKeys), "StatKeys": (pb.StatKeysResponse, StatKeys)}
