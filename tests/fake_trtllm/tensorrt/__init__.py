"""Fake ``tensorrt``: only the version the manifest records."""
__version__ = "10.13.3.9"
