"""Pallas kernels for jaxinfer. Imports only jax and numpy (ARCHITECTURE.md doors)."""
