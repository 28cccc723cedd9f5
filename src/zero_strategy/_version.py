"""The package's version, in a leaf module: checkpoints record it without importing the package."""

__version__ = "0.1.0"
