"""moeconv: convert quantized MoE checkpoints into the layouts serving kernels read, once, offline, verified.

The public API is three functions mirroring the CLI (see moeconv.api):

    import moeconv
    print(moeconv.inspect("org/model"))
    report = moeconv.convert("org/model", "out/", backend="triton")
    assert moeconv.verify("out/").ok

They are loaded on first use, so `import moeconv` and `moeconv --help` do not import torch. The
names are also those of the modules moeconv.inspect / moeconv.convert / moeconv.verify; as package
attributes they always mean the functions (import the modules by their full name, as the package
itself does).
"""

import sys
import types

from moeconv._version import __version__

_API = ("convert", "inspect", "verify")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from moeconv import api

        return getattr(api, name)
    raise AttributeError(f"module 'moeconv' has no attribute {name!r}")


class _Package(types.ModuleType):
    """Importing the submodule `moeconv.convert` would set the package attribute `convert` to the
    module; keep it for the function (the module stays in sys.modules)."""

    def __setattr__(self, name: str, value) -> None:
        if name in _API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
