"""eagle3-datagen: exact-token training data for speculative-decoding draft models."""

__all__ = ["__version__"]

__version__ = "0.1.0"
