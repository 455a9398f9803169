"""Shared runtime of every kvtier process: config files and units, logs, metrics, etcd, discovery.

Depends on the contract (`kvtier.proto`) only; the master, the segment server, the client and the
command build on it. Nothing here defines a wire format: those live in `kvtier.proto`.
"""
