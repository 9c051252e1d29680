"""The package version: the wheel's, and part of every kernel's cache key (compiler/build.py)."""
__version__ = "0.1.0"
