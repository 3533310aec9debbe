"""Ragged paged attention: prefill chunks and decode tokens of many requests in one call."""
