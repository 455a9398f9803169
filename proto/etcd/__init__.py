"""Generated stubs for the subset of etcd's v3 gRPC API that master election uses.

`kv.proto` and `rpc.proto` are trimmed copies of etcd's own protos (field
numbers and package names unchanged); `kvtier.common.etcd_client` is the only
intended user of the generated modules.
"""
