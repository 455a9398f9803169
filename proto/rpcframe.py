"""The master's framed fast path: the hot per-batch calls as protobuf over plain TCP.

gRPC stays the master's API (every call exists there). A gRPC round trip
between two Python processes costs ~0.6 ms on a 2-vCPU machine, a framed one
on uvloop ~0.02 ms, and a single-key get pays one metadata round trip, so
the calls every get and put makes (GetReplicas, Exists, PutStart, PutEnd,
PutRevoke, Remove) also travel over this framing, carrying the very same
request and response messages to the very same handlers. Clients learn the
endpoint from `Hello` and fall back to gRPC when it is off or unreachable.

    request   magic:u16 method:u16 request_id:u32 payload_len:u32  + serialized request message
    response  magic:u16 method:u16 request_id:u32 payload_len:u32  + serialized response message

All integers little-endian. Responses come in request order. A frame the
master cannot trust (bad magic, unknown method, a payload over the master's
`max_message_size`, an undecodable message) gets a response with method 0 and
a UTF-8 reason, and the connection is closed. A connection refused at accept
(the master's `max_connections`) gets that response with request id 0 before
any request is read; clients never use request id 0.

When the master requires credentials (kvtier.master.auth), a connection's
first frame is AUTH_METHOD with the client's token (UTF-8) as payload; it is
answered with AUTH_METHOD and an empty payload, and a wrong token, or any
other frame first, gets the method-0 error and the close.
"""

from __future__ import annotations

import struct

from kvtier.proto import master_pb2 as pb

MAGIC = 0x4D4B  # b"KM" little-endian
HEADER = struct.Struct("<HHII")
# Largest request or response message on either door to the master (gRPC or this framing):
# batches of 10,000+ keys of up to 1 KiB exceed gRPC's 4 MiB default.
MESSAGE_LIMIT = 256 << 20
MAX_PAYLOAD = MESSAGE_LIMIT
ERROR_METHOD = 0
AUTH_METHOD = 0xFFFE
MAX_TOKEN = 512

# method id -> (RPC name, request type, response type). Ids are wire contract: never reuse one.
METHODS: dict[int, tuple[str, type, type]] = {
    1: ("GetReplicas", pb.KeysRequest, pb.GetReplicasResponse),
    2: ("Exists", pb.ExistsRequest, pb.ExistsResponse),
    3: ("PutStart", pb.PutStartRequest, pb.PutStartResponse),
    4: ("PutEnd", pb.PutEndRequest, pb.KeyStatusResponse),
    5: ("PutRevoke", pb.PutRevokeRequest, pb.KeyStatusResponse),
    6: ("Remove", pb.KeysRequest, pb.RemoveResponse),
    # Segments' commit feed (kvtier.segment_server.commit_link): a long poll, answered once notices
    # are queued or its wait_ms passed; the acknowledgement PutEnd waits for rides on the next one.
    7: ("PollCommits", pb.PollCommitsRequest, pb.PollCommitsResponse),
    # A client's PutEnd relayed by the segment it wrote to (the data plane's COMMIT frame): the
    # segment's own notices of the call come back in the answer (kvtier.segment_server.commit_relay).
    8: ("RelayPutEnd", pb.RelayPutEndRequest, pb.RelayPutEndResponse),
}
METHOD_IDS = {name: method for method, (name, _, _) in METHODS.items()}
