"""The package's version, importable without the package's lazy entry points."""

__version__ = "0.1.0"
