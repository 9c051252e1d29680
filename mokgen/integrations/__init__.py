"""Adapters that put mokgen under other libraries' models."""
