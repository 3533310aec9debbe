"""Structured output: grammar compilation and per-step token bitmasks (host side).

A constrained request (SamplingParams json_schema / json_object / regex / grammar /
choice) carries a grammar matcher; before each step the engine fills one packed bitmask
row per logits row ([S, ceil(V/32)] int32, bit t of a row = token t allowed), and the
jitted step masks the logits with it before sampling and speculative verification.
Imports no JAX.
"""
from jaxinfer.structured.grammar import (KINDS, ConstraintError, GrammarCompiler,
                                         GrammarMatcher, check_constraint, mask_words,
                                         unconstrained_rows)

__all__ = ["KINDS", "ConstraintError", "GrammarCompiler", "GrammarMatcher", "check_constraint",
           "mask_words", "unconstrained_rows"]
