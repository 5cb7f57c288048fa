"""Kernel sources by backend (package data, read with importlib.resources)."""
