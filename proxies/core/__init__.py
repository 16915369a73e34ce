"""Shared runtime: knows nothing about any model."""
