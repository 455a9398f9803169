"""The `kvtier` command: operator tooling (ops subcommands, `kvtier top`, `kvtier up`, benchmarks).

Built on the client library's public calls and imported by nothing: the library, the servers and the
shared runtime never depend on it.
"""
