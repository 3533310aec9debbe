"""The one table of padded shapes (8.2.4: XLA's answer to captured CUDA graphs).

Every jitted step runs at a shape taken from this table: tokens per step (T), request
slots per step (R), pages per request (P), prefill slots (Rp: the last Rp request slots
may carry up to Q new tokens; the others carry one, a decode) and Q. Logits rows are one
per request slot (S = R). Splitting the slots keeps a mixed step (many decodes + one
prefill chunk) from paying R x Q attention work. Padding looks the next size up with
`bisect`; asking past the largest size raises `BucketError` — nothing is ever truncated.

Decode-only steps (every request one token) have a ladder of their own, `decode_sizes`:
such a step runs at T = R = the next decode size, so one user's decode step multiplies one
row, not the smallest token bucket's 16. Steps that carry a prefill chunk use the token and
request ladders. The default table: decode sizes 1, 2, 4, ... up to the largest request
size; token and request ladders of powers of four; one tier of pages per request, since
the attention backends read only the pages a request holds whatever the table's width.
`jaxinfer.bucket_plan` builds
other ladders (powers of two, linear, exact) and fits one to a trace; `to_json` /
`from_json` carry a table between the planner, the engine, `LLM` and the CLI.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
from typing import Iterator, Tuple, Union


class BucketError(ValueError):
  """A step needs a shape larger than the largest bucket."""


def geometric(lo: int, hi: int, ratio: int) -> Tuple[int, ...]:
  """lo, lo*ratio, lo*ratio^2, ... below hi, then hi (the largest size is always hi)."""
  if not (isinstance(ratio, int) and ratio >= 2):
    raise ValueError(f"ratio must be an integer >= 2, got {ratio!r}")
  lo = max(1, min(lo, hi))
  out, x = [], lo
  while x < hi:
    out.append(x)
    x *= ratio
  out.append(hi)
  return tuple(sorted(set(out)))


_FIELDS = ("token_sizes", "request_sizes", "page_table_sizes", "query_sizes",
           "prefill_slot_sizes", "decode_sizes")
_OPTIONAL = ("query_sizes", "decode_sizes")  # may be empty


@dataclasses.dataclass(frozen=True)
class Bucket:
  num_tokens: int  # T
  num_requests: int  # R
  pages_per_request: int  # P
  max_query_len: int  # Q
  num_logits: int  # S
  prefill_slots: int = 0  # Rp

  @property
  def attn_shape(self):
    return (self.max_query_len, self.prefill_slots)


@dataclasses.dataclass(frozen=True)
class BucketTable:
  token_sizes: Tuple[int, ...]
  request_sizes: Tuple[int, ...]
  page_table_sizes: Tuple[int, ...]  # page-table widths: pages per request (page_size is
  # tokens per page everywhere else)
  query_sizes: Tuple[int, ...] = ()  # default: (1,) + token sizes
  prefill_slot_sizes: Tuple[int, ...] = ()  # default: powers of two up to max requests
  # decode-only steps run at T = R = the next of these (empty: they use the token and
  # request ladders like any step)
  decode_sizes: Tuple[int, ...] = ()

  def __post_init__(self):
    for name in _FIELDS:  # types first: the defaults below read request_sizes
      raw = getattr(self, name)
      if not isinstance(raw, (tuple, list)) or not all(
          isinstance(x, int) and not isinstance(x, bool) for x in raw):
        raise ValueError(f"{name} must be a list of integers, got {raw!r}")
    if not self.prefill_slot_sizes and self.request_sizes:
      object.__setattr__(self, "prefill_slot_sizes",
                         geometric(1, max(self.request_sizes), 2))
    for name in _FIELDS:
      v = tuple(sorted(set(getattr(self, name))))
      if any(x <= 0 for x in v):
        raise ValueError(f"{name} must be positive, got {v}")
      if not v and name not in _OPTIONAL:
        raise ValueError(f"{name} must not be empty")
      object.__setattr__(self, name, v)
    if not self.query_sizes:
      object.__setattr__(self, "query_sizes", tuple(sorted({1, *self.token_sizes})))
    if self.prefill_slot_sizes[-1] > self.request_sizes[-1]:
      raise ValueError(f"prefill_slot_sizes {self.prefill_slot_sizes} exceed the largest "
                       f"request size {self.request_sizes[-1]}")
    top = min(self.request_sizes[-1], self.token_sizes[-1])
    if self.decode_sizes and self.decode_sizes[-1] > top:
      raise ValueError(f"decode_sizes {self.decode_sizes} exceed the largest step of one-token "
                       f"requests, {top} (min of the largest token and request sizes)")

  @classmethod
  def default(cls, max_tokens: int = 256, max_requests: int = 64, max_pages: int = 128,
              min_tokens: int = 16, ratio: int = 4) -> "BucketTable":
    """The small default: token sizes min_tokens, x ratio, ... up to max_tokens; request
    sizes 1, ratio, ... up to max_requests; prefill-slot sizes 1, 2, 4, 8 and the request
    sizes; query sizes 1 + the token sizes; decode sizes 1, 2, 4, ... up to
    min(max_requests, max_tokens); one page tier (max_pages). 256 x 64 x any pages: 82
    shapes."""
    req = geometric(1, max_requests, ratio)
    # A chunked step usually carries one or two prefill works (a prompt's tail and the
    # next prompt's head); every prefill slot costs Q query rows of attention, so the
    # small counts run at their own size rather than padded to `ratio`.
    slots = tuple(sorted(set(geometric(1, min(8, max_requests), 2)) | set(req)))
    return cls(token_sizes=geometric(min_tokens, max_tokens, ratio), request_sizes=req,
               page_table_sizes=(max_pages,), prefill_slot_sizes=slots,
               decode_sizes=geometric(1, min(max_requests, max_tokens), 2))

  def to_json(self) -> dict:
    return {name: list(getattr(self, name)) for name in _FIELDS}

  @classmethod
  def from_json(cls, src: Union[str, dict]) -> "BucketTable":
    """A table from a dict of the five size lists or a JSON file holding one (as written
    by tools/bucket_plan.py); unknown keys are an error, nothing is guessed."""
    if isinstance(src, str):
      with open(src) as f:
        src = json.load(f)
      if isinstance(src, dict) and "table" in src:  # a planner report holds it there
        src = src["table"]
    if not isinstance(src, dict):
      raise ValueError(f"a bucket table must be a JSON object, got {type(src).__name__}")
    unknown = sorted(set(src) - set(_FIELDS))
    if unknown:
      raise ValueError(f"unknown bucket table fields {unknown}; expected {list(_FIELDS)}")
    missing = [k for k in _FIELDS[:3] if k not in src]  # the others have defaults
    if missing:
      raise ValueError(f"bucket table misses {missing}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in src.items()})

  @staticmethod
  def _pick(sizes, n, what):
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
      raise BucketError(f"{what}={n} exceeds the largest bucket {sizes[-1]}")
    return sizes[i]

  def pad_tokens(self, n: int) -> int:
    """The token bucket a step of n tokens runs at (BucketError past the largest)."""
    return self._pick(self.token_sizes, n, "tokens per step")

  @property
  def max_tokens(self) -> int:
    return self.token_sizes[-1]

  @property
  def max_requests(self) -> int:
    return self.request_sizes[-1]

  @property
  def max_pages(self) -> int:
    return self.page_table_sizes[-1]

  def select(self, num_tokens: int, num_decode: int, max_pages: int,
             max_query_len: int = 1, num_prefill: int = 0, num_logits: int = 0) -> Bucket:
    """num_decode one-token requests plus num_prefill requests of up to max_query_len.
    Logits rows are one per request slot (S = R) unless a step verifies drafts and needs
    more (S = T). A decode-only step (no prefill, one logits row per request) runs at
    T = R = its decode size when the table has a decode ladder."""
    def pages() -> int:  # picked after the token size: that error is reported first
      return self._pick(self.page_table_sizes, max(max_pages, 1), "pages per request")

    if (self.decode_sizes and not num_prefill and num_tokens == num_decode
        and num_logits <= num_decode):
      D = self._pick(self.decode_sizes, num_decode, "decode requests per step")
      return Bucket(num_tokens=D, num_requests=D, pages_per_request=pages(), max_query_len=1,
                    num_logits=D, prefill_slots=0)
    T = self._pick(self.token_sizes, num_tokens, "tokens per step")
    if num_prefill:
      Q = min(self._pick(self.query_sizes, max_query_len, "query tokens per request"), T)
      Rp = self._pick(self.prefill_slot_sizes, num_prefill, "prefill requests per step")
      if num_decode + Rp > self.request_sizes[-1]:
        # Padding the prefill slots would overflow: every slot takes up to Q tokens.
        Rp = self._pick(self.prefill_slot_sizes, num_decode + num_prefill, "requests per step")
        num_decode = 0
    else:
      Q, Rp = 1, 0
    R = self._pick(self.request_sizes, num_decode + Rp, "requests per step")
    return Bucket(num_tokens=T, num_requests=R, pages_per_request=pages(), max_query_len=Q,
                  num_logits=R if num_logits <= R else T, prefill_slots=Rp)

  def all_buckets(self, verify: bool = False) -> Iterator[Bucket]:
    """Exactly the shapes `select` can return for a step that fits the table (the warm-up
    set): nothing reachable is missed and nothing unreachable is compiled. verify: also the
    shapes of speculative verify steps (logits at every token, S = T).

    A step is d one-token works plus p works of 2..q tokens each (n tokens in all, so
    d + q + 2(p - 1) <= n <= d + p q, and d + p <= the largest request size). `select`
    depends on n and q only through their buckets, so one (d, p) pair, one query bucket
    and one token bucket is reachable when those n-intervals meet."""
    seen = set()
    out = []

    def add(b: Bucket) -> None:
      if b not in seen:
        seen.add(b)
        out.append(b)

    maxR, maxT = self.max_requests, self.max_tokens
    t_lo = (0,) + self.token_sizes[:-1]
    q_ranges = [(max(lo + 1, 2), min(hi, maxT)) for lo, hi in
                zip((0,) + self.query_sizes[:-1], self.query_sizes)]
    q_ranges = [(lo, hi) for lo, hi in q_ranges if lo <= hi]
    for P in self.page_table_sizes:
      for d in range(1, min(maxR, maxT) + 1):  # decode-only steps: n = d
        add(self.select(d, d, P))
      for p in range(1, maxR + 1):
        for d in range(0, maxR - p + 1):
          for qlo, qhi in q_ranges:
            for tlo, thi in zip(t_lo, self.token_sizes):
              n_lo = max(tlo + 1, d + qlo + 2 * (p - 1))
              if n_lo > min(thi, d + p * qhi):
                continue
              # the largest q of the range keeps n's interval widest; any q gives one Q
              q = max(qlo, min(qhi, n_lo - d - 2 * (p - 1)))
              b = self.select(n_lo, d, P, q, p)
              add(b)
              if verify and b.num_tokens > b.num_requests:
                add(dataclasses.replace(b, num_logits=b.num_tokens))
    return iter(out)
