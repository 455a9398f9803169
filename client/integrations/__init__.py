"""Engine adapters: SGLang HiCache, LMCache, vLLM offloading (docs/integrations.md).

Each adapter imports its engine lazily (only when the engine loads it), so the
core client stays thin. They share `identity` (the namespace a deployment's
blocks live in) and `common` (settings, the off switch, failure accounting).
"""
