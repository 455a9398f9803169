"""Engine adapter tests: they need the engine environment (`make test-engines`: torch CPU, the
engines installed without their dependencies). Elsewhere this directory is not collected."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("torch") is None:  # the main environment: nothing here can import
    collect_ignore_glob = ["*"]
