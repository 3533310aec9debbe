"""Grammar compilation and token bitmasks over llguidance.

Why llguidance (`tools/bench_sampling.py` measures it against outlines-core on this
project's 20 JSON Schemas at SmolLM2's 49,152-token vocabulary; the README has the
table): it compiles JSON Schema, regular expressions and context-free grammars (Lark,
and llama.cpp's GBNF) lazily — no DFA over the whole vocabulary up front, so a schema
with wide numeric ranges or bounded arrays compiles in milliseconds — and it fills
masks for a batch in parallel with the GIL released. It pulls no torch (xgrammar
depends on torch and triton; outlines-core handles regular languages only).

Constraint kinds (SamplingParams fields, at most one per request, vLLM's names):
json_schema (a JSON Schema), json_object (any JSON object), regex, grammar (Lark or
GBNF text), choice (one of a list of strings).
"""
from __future__ import annotations

import collections
import json
import threading
from typing import List, Optional, Sequence, Tuple

import numpy as np

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
PROBE_TOKENS = 8  # tokens a new grammar is walked at validation


class ConstraintError(ValueError):
  """A constraint that cannot be served: it does not compile, admits no string, or trips
  the grammar library's limits. The message names the kind and the problem."""


def _first_line(text: str) -> str:
  return (text or "").strip().splitlines()[0] if (text or "").strip() else "no message"


def mask_words(vocab_size: int) -> int:
  """int32 words per packed bitmask row: bit t of word t // 32 is token t."""
  return (vocab_size + 31) // 32


def unconstrained_rows(n: int, vocab_size: int) -> np.ndarray:
  """[n, words] int32 of all ones: every token allowed (free requests, padding rows)."""
  return np.full((n, mask_words(vocab_size)), -1, np.int32)


def _grammar_text(kind: str, spec) -> str:
  """The llguidance grammar for one constraint (not yet validated)."""
  import llguidance
  M = llguidance.LLMatcher
  if kind == "json_schema":
    try:
      return M.grammar_from_json_schema(spec)
    except ValueError as e:
      raise ConstraintError(f"invalid json_schema: not a JSON object: {e}") from None
  if kind == "json_object":
    return M.grammar_from_json_schema('{"type": "object"}')
  if kind == "regex":
    return M.grammar_from_regex(spec)
  if kind == "choice":  # one regex lexeme: a Lark alternative per option would put every
    # option in one parser row, and the library caps a row's items (2,000 by default)
    return M.grammar_from_lark("start: /" + "|".join(_regex_literal(c) for c in spec) + "/")
  if kind == "grammar":
    try:
      return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark
    except ValueError as e:
      raise ConstraintError(f"invalid grammar: neither Lark nor GBNF: {e}") from None
  raise ValueError(f"unknown constraint kind {kind!r}; choose one of {KINDS}")


def _regex_literal(text: str) -> str:
  """`text` as a regex that matches exactly it, safe inside a Lark /.../ terminal: every
  ASCII character that is not a letter or digit is written as a \\x{..} escape."""
  return "".join(f"\\x{{{ord(c):02X}}}" if c.isascii() and not c.isalnum() else c
                 for c in text)


def check_constraint(kind: str, spec) -> None:
  """Does the constraint compile? ValueError naming the problem. Needs no tokenizer (the
  CLI checks its flags with it before the model loads)."""
  import llguidance
  err = llguidance.LLMatcher.validate_grammar(_grammar_text(kind, spec))
  if err:
    raise ConstraintError(f"invalid {kind}: {err.strip()}")


class GrammarMatcher:
  """One request's position in its grammar: which tokens may come next."""

  def __init__(self, matcher, kind: str):
    self._m = matcher
    self.kind = kind

  def advance(self, token: int) -> Optional[str]:
    """Consume an emitted token. Returns None, "stop" when the grammar is complete (it
    allows nothing but the end of the text), or an error message."""
    if not self._m.consume_token(int(token)):
      return f"token {token} breaks the {self.kind} constraint: {self._m.get_error()}"
    if self._m.is_stopped():
      return "stop"
    return None

  def valid_prefix(self, tokens: Sequence[int]) -> int:
    """How many leading tokens of a draft the grammar accepts (state unchanged)."""
    return self._m.validate_tokens(list(tokens)) if tokens else 0

  @property
  def error(self) -> Optional[str]:
    return self._m.get_error() if self._m.is_error() else None


class GrammarCompiler:
  """Compiles constraints for one tokenizer; caches compiled grammars (LRU) so repeated
  schemas (the usual case: one tool schema, many requests) cost one compile."""

  def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
               cache_size: int = 256, num_threads: Optional[int] = None):
    import llguidance
    if tokenizer is None or not hasattr(tokenizer, "backend"):
      raise ValueError("structured output needs the model's tokenizer (a tokenizers backend)")
    self.vocab_size = vocab_size
    self.words = mask_words(vocab_size)
    self._eos = tuple(int(t) for t in eos_token_ids)
    self._tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                       eos_token=list(eos_token_ids))
    self._executor = llguidance.LLExecutor(num_threads)
    self._cache: "collections.OrderedDict[Tuple[str, str], str]" = collections.OrderedDict()
    self._cache_size = cache_size
    self._lock = threading.Lock()  # the server validates on request threads

  def compile(self, kind: str, spec) -> str:
    """Compile and validate; ValueError naming the constraint and the problem."""
    key = (kind, spec if isinstance(spec, str) else json.dumps(spec))
    with self._lock:
      hit = self._cache.get(key)
      if hit is not None:
        self._cache.move_to_end(key)
        return hit
    import llguidance
    g = _grammar_text(kind, spec)
    err = llguidance.LLMatcher.validate_grammar(g, self._tok)
    if err:
      raise ConstraintError(f"invalid {kind}: {err.strip()}")
    self._probe(kind, g)
    with self._lock:
      self._cache[key] = g
      while len(self._cache) > self._cache_size:
        self._cache.popitem(last=False)
    return g

  def _probe(self, kind: str, grammar: str) -> None:
    """Refuse, before a request is accepted, a grammar that admits no string (the parser
    stops at once without accepting) or that trips the library's limits within its first
    PROBE_TOKENS tokens (walking the lowest allowed non-end token each step)."""
    import llguidance
    m = llguidance.LLMatcher(self._tok, grammar, log_level=0)
    mask = np.zeros((1, self.words), np.int32)
    empty = ConstraintError(f"{kind} admits no string: nothing that matches it can be "
                            "generated")
    for step in range(PROBE_TOKENS):
      self._executor.unsafe_compute_mask_ptr([(m, 0)], mask.ctypes.data, self.words * 4, 1)
      if step == 0 and m.is_stopped() and not m.is_accepting() and (
          not m.is_error() or "NoExtension" in m.get_error()):  # stopped before any byte
        raise empty
      if m.is_error():
        raise ConstraintError(f"{kind} cannot be served: after {step} tokens the grammar "
                              f"library fails with: {_first_line(m.get_error())}")
      allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
      nxt = [int(t) for t in allowed[:len(self._eos) + 1] if int(t) not in self._eos]
      if m.is_stopped() or not nxt:
        return  # complete: only the end is left
      m.consume_token(nxt[0])
    if m.is_error():
      raise ConstraintError(f"{kind} cannot be served: after {PROBE_TOKENS} tokens the "
                            f"grammar library fails with: {_first_line(m.get_error())}")

  def matcher(self, kind: str, spec) -> GrammarMatcher:
    import llguidance
    m = llguidance.LLMatcher(self._tok, self.compile(kind, spec), log_level=0)
    if m.is_error():
      raise ConstraintError(f"invalid {kind}: {m.get_error()}")
    return GrammarMatcher(m, kind)

  def fill(self, rows: List[Tuple[GrammarMatcher, int, List[int]]], out: np.ndarray) -> None:
    """Fill out[row] (and out[row + 1 + j] after draft token j) for each (matcher, row,
    drafts), in parallel across requests; other rows of `out` are left as they are."""
    assert out.dtype == np.int32 and out.shape[1] == self.words and out.flags["C_CONTIGUOUS"]
    plain = [(g._m, i) for g, i, d in rows if not d]
    drafted = [(g._m, i, list(d)) for g, i, d in rows if d]
    if plain:
      self._executor.unsafe_compute_mask_ptr(plain, out.ctypes.data, self.words * 4,
                                             out.shape[0])
    if drafted:
      self._executor.unsafe_compute_mask_ptr_with_draft_token(
          drafted, out.ctypes.data, self.words * 4, out.shape[0])
