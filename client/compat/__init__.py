"""Drop-in APIs of other KV-cache stores on top of kvtier's `Client` (docs/integrations.md).

`kvtier.client.compat.mooncake`: Mooncake Store's Python interface.
"""
