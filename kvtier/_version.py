"""The one place kvtier's version is written: the packaging metadata reads it from here."""

__version__ = "0.1.0"
