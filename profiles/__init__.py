"""Machine profiles measured on real machines (package data)."""
