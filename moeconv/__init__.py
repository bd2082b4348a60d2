"""moeconv: convert quantized MoE checkpoints into the layouts serving kernels read, once, offline, verified.

The public API is three functions mirroring the CLI (see moeconv.api):

    import moeconv
    print(moeconv.inspect("org/model"))
    report = moeconv.convert("org/model", "out/", backend="triton")
    assert moeconv.verify("out/").ok

(The names shadow the modules moeconv.inspect / moeconv.convert / moeconv.verify as attributes of
the package; import from those modules by their full name, as the package itself does.)
"""

__version__ = "0.1.0"

from moeconv.api import convert, inspect, verify  # noqa: E402

__all__ = ["__version__", "convert", "inspect", "verify"]
