"""prism-serve."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("prism-serve")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+unknown"
