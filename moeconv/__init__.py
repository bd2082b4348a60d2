"""moeconv: convert quantized MoE checkpoints into the layouts serving kernels read, once, offline, verified.

The public API is three functions mirroring the CLI (see moeconv.api):

    import moeconv
    print(moeconv.inspect("org/model"))
    report = moeconv.convert("org/model", "out/", backend="triton")
    assert moeconv.verify("out/").ok

They are loaded on first use, so `import moeconv` and `moeconv --help` do not import torch. No module
of the package has their names (the work behind them is moeconv.inspection, moeconv.conversion and
moeconv.verification), so `moeconv.convert` is always the function and every module imports as itself.
"""

from moeconv._version import __version__

_API = ("convert", "inspect", "verify")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from moeconv import api

        return getattr(api, name)
    raise AttributeError(f"module 'moeconv' has no attribute {name!r}")
