"""Pallas kernels for jaxinfer. Imports only jax and numpy (tests/test_doors.py)."""
