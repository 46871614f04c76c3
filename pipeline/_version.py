"""The library's version: one definition, for `pipeline.__version__` and for the
instrumentation scopes of every tracer and meter (imported by layers without importing the
package root's public surface)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
