"""Compatibility with other tools' APIs, one package per tool; the core speaks only its own names."""
