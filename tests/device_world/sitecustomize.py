"""Makes the modules named in INTERP_HIDE_MODULES (comma list) not installed, for the CPU test of
benchmarks/device.sh: put this folder on PYTHONPATH and the process sees a machine without them
(find_spec returns None, import raises ModuleNotFoundError), like the lent GPU machine without vLLM."""
import os
import sys

_HIDDEN = {m for m in os.environ.get("INTERP_HIDE_MODULES", "").split(",") if m}


class _Hide:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in _HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by tests/device_world)", name=name)
        return None


if _HIDDEN:
    sys.meta_path.insert(0, _Hide())
