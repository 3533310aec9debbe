"""The bucket table: padding picks the next size up; warm-up covers every selectable shape."""
import itertools

import pytest

from jaxinfer.buckets import BucketError, BucketTable
from jaxinfer.runtime.batcher import SeqWork, pack


def _reachable(t, pages=(1,)):
  """Brute force: the bucket of every step that fits the table (d one-token works, p works
  of 2..q tokens, n tokens in all)."""
  out = set()
  for P in pages:
    for d in range(1, t.max_requests + 1):
      if d <= t.max_tokens:
        out.add(t.select(d, d, P))
    for d, p in itertools.product(range(t.max_requests + 1), range(1, t.max_requests + 1)):
      if d + p > t.max_requests:
        continue
      for q in range(2, t.max_tokens + 1):
        for n in range(d + q + 2 * (p - 1), min(t.max_tokens, d + p * q) + 1):
          out.add(t.select(n, d, P, q, p))
  return out


@pytest.mark.parametrize("table", [
    BucketTable(token_sizes=(4, 8, 32), request_sizes=(2, 6), page_table_sizes=(4, 16)),
    BucketTable(token_sizes=(8, 32), request_sizes=(1, 4, 8), page_table_sizes=(4,),
                query_sizes=(1, 4, 32), prefill_slot_sizes=(1, 8)),
    BucketTable(token_sizes=(16, 24), request_sizes=(16,), page_table_sizes=(2,),
                query_sizes=(24,), prefill_slot_sizes=(1, 2, 16)),
    BucketTable(token_sizes=(8, 32), request_sizes=(1, 4, 8), page_table_sizes=(4, 8),
                decode_sizes=(1, 2, 4, 8)),
    BucketTable.default(32, 8, 4)])
def test_all_buckets_is_exactly_what_select_can_return(table):
  """Warm-up compiles every shape a step can run at (a miss compiles mid-run) and none that
  no step can (each costs a compile, ~1.5 s here)."""
  warm = list(table.all_buckets())
  assert len(warm) == len(set(warm))
  assert set(warm) == _reachable(table, table.page_table_sizes)


def test_select_pads_up():
  t = BucketTable(token_sizes=(4, 16, 64), request_sizes=(2, 8), page_table_sizes=(4, 16))
  for n_tok, n_dec, n_pre, pages, q in itertools.product(range(1, 65, 7), range(0, 7), (0, 1, 2),
                                                         (1, 5, 16), (2, 3, 16)):
    if n_dec + n_pre == 0 or n_dec + n_pre * q > n_tok:
      continue
    b = t.select(n_tok, n_dec, pages, q if n_pre else 1, n_pre)
    assert b.num_tokens >= n_tok and b.pages_per_request >= pages
    if b.prefill_slots == b.num_requests:
      assert b.num_requests >= n_dec + n_pre
    else:
      assert b.num_requests - b.prefill_slots >= n_dec and b.prefill_slots >= n_pre
    if n_pre:
      assert b.max_query_len >= min(q, b.num_tokens)
  assert t.select(5, 1, 1).num_tokens == 16
  # 5 decodes + 3 prefills fit 8 slots, but 5 + 4 padded prefill slots would not: every
  # slot becomes prefill-capable.
  b = t.select(20, 5, 4, 8, 3)
  assert (b.num_requests, b.prefill_slots) == (8, 8) and b in set(t.all_buckets())


def test_verify_shapes_add_logits_at_every_token():
  t = BucketTable(token_sizes=(8, 32), request_sizes=(4,), page_table_sizes=(4,))
  plain, ver = set(t.all_buckets()), set(t.all_buckets(verify=True))
  assert plain < ver
  for b in ver - plain:
    assert b.num_logits == b.num_tokens > b.num_requests and b.prefill_slots
  # a verify step of 2 requests x (1 + 4 drafts): 10 logits rows > 4 slots -> S = T
  assert t.select(10, 0, 2, 5, 2, num_logits=10) in ver


def test_pack_is_padded_and_never_truncates():
  t = BucketTable(token_sizes=(8,), request_sizes=(2,), page_table_sizes=(2,))
  step = pack([SeqWork([1, 2, 3], 0, [5]), SeqWork([9], 6, [6, 7])], t, page_size=4, num_pages=10)
  a = step.arrays
  assert step.padding_tokens == 4 and a["token_ids"].shape == (8,)
  assert a["write_page"].tolist() == [5, 5, 5, 7, 10, 10, 10, 10]  # padding -> dropped page
  assert a["write_offset"][:4].tolist() == [0, 1, 2, 2]
  assert a["logits_idx"].tolist() == [2, 3]
  # The decode work takes slot 0, the 3-token prefill work the last (prefill) slot.
  assert step.bucket.prefill_slots == 1
  assert a["query_len"].tolist() == [1, 3] and a["query_start"].tolist() == [3, 0]
  with pytest.raises(BucketError, match="tokens per step=9"):
    pack([SeqWork(list(range(9)), 0, [1, 2, 3])], t, page_size=4, num_pages=10)


def test_decode_only_steps_run_at_their_own_size():
  """With a decode ladder a step of d one-token requests runs at T = R = the next decode
  size (one user's step multiplies one row, not the token ladder's smallest 16); a step
  that carries a prefill chunk still takes the token and request ladders."""
  t = BucketTable.default(256, 64, 32)
  assert t.decode_sizes == (1, 2, 4, 8, 16, 32, 64)
  for d, want in ((1, 1), (2, 2), (3, 4), (5, 8), (17, 32), (64, 64)):
    b = t.select(d, d, 3, num_logits=d)
    assert (b.num_tokens, b.num_requests, b.num_logits, b.prefill_slots) == (want, want, want, 0)
  mixed = t.select(20, 3, 3, 17, 1)  # 3 decodes + one 17-token chunk
  assert (mixed.num_tokens, mixed.num_requests, mixed.prefill_slots) == (64, 4, 1)
  verify = t.select(6, 2, 3, 3, 0, num_logits=6)  # drafts: more logits rows than requests
  assert verify.num_tokens == 16
  # a table without a ladder (as older JSON files hold) pads decode to its token ladder
  old = BucketTable.from_json({k: v for k, v in t.to_json().items() if k != "decode_sizes"})
  assert old.decode_sizes == () and old.select(1, 1, 3).num_tokens == 16
  assert BucketTable.from_json(t.to_json()) == t
  with pytest.raises(ValueError, match="decode_sizes"):
    BucketTable(token_sizes=(8,), request_sizes=(4,), page_table_sizes=(2,), decode_sizes=(8,))


def test_pack_runs_one_decode_at_one_row():
  t = BucketTable.default(256, 64, 32)
  step = pack([SeqWork([5], 40, list(range(3)))], t, page_size=16, num_pages=8)
  assert step.bucket.num_tokens == 1 and step.padding_tokens == 0
  assert step.arrays["token_ids"].tolist() == [5] and step.arrays["positions"].tolist() == [40]
