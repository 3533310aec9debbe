"""Incremental detokenisation: text deltas from a growing list of token ids.

Used by the HTTP server's streams, `LLM.stream` and the CLI's `--stream`. Two rules:
- never emit half a character: a token that ends inside a multi-byte UTF-8 sequence
  decodes to U+FFFD until the next token completes it, so such text waits;
- never emit text that may still turn out to be (the start of) a stop string: the
  engine cuts the output at the first stop string, so a streamed client must not have
  seen it. The longest tail of the text that is a prefix of some stop string is held
  back until the next token decides it.

Each new token is decoded within a short window of the tokens before it (the text of
window + new tokens minus the text of the window), so the host work per token stays
constant instead of growing with the output, and tokenizers that treat a leading space
specially (SentencePiece) still join words correctly.
"""
from __future__ import annotations

from typing import Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:

  def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
    self.tokenizer = tokenizer
    self.stop = tuple(stop)
    self.skip_special_tokens = skip_special_tokens
    self.ids: list = []
    self._prefix = 0  # window start: context for decoding the unread tokens
    self._read = 0  # tokens whose text is in self.text
    self.text = ""  # all decoded text so far (complete characters only)
    self.emitted = 0  # characters of self.text already handed out

  def _decode(self, ids) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

  def _held_back(self) -> int:
    """Characters at the end of the text that could begin a stop string."""
    best = 0
    for s in self.stop:
      for k in range(min(len(s) - 1, len(self.text) - self.emitted), best, -1):
        if self.text.endswith(s[:k]):
          best = k
          break
    return best

  def push(self, token_ids: Sequence[int]) -> str:
    """Add tokens; return the text that became safe to show (possibly "")."""
    self.ids.extend(int(t) for t in token_ids)
    if self._read < len(self.ids):
      before = self._decode(self.ids[self._prefix:self._read])
      after = self._decode(self.ids[self._prefix:])
      if len(after) > len(before) and not after.endswith(_REPLACEMENT):
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
    end = len(self.text) - self._held_back()
    for stop in self.stop:  # a whole stop string: nothing from its start on is shown
      i = self.text.find(stop, max(self.emitted - len(stop) + 1, 0))
      if i >= 0:
        end = min(end, i)
    if end <= self.emitted:
      return ""
    out = self.text[self.emitted:end]
    self.emitted = end
    return out

  def finish(self, final_text: str) -> str:
    """The rest of the output once the request ended. `final_text` is the engine's text
    of the whole output (cut at a stop string if one matched); what was emitted is always
    a prefix of it, and the remainder is returned."""
    shown = self.text[:self.emitted]
    if not final_text.startswith(shown):  # a tokenizer whose windowed decode differs
      return ""
    self.emitted = len(final_text)
    self.text = final_text
    return final_text[len(shown):]
