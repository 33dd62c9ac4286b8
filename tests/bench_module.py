"""Loads a bench script of benches/ as a module, for the tests of its checks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

BENCHES = Path(__file__).resolve().parents[1] / "benches"


def load_bench(name: str) -> Any:
    """benches/NAME.py as module NAME (registered: dataclasses look their module up),
    with benches/ on the path while it loads (the benches import soak's server start)."""
    sys.path.insert(0, str(BENCHES))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHES / f"{name}.py")
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCHES))
