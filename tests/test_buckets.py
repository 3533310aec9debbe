"""The bucket table: padding picks the next size up; warm-up covers every selectable shape."""
import itertools

import pytest

from jaxinfer.buckets import BucketError, BucketTable
from jaxinfer.runtime.batcher import SeqWork, pack


def test_select_pads_up_and_all_buckets_cover_it():
  t = BucketTable(token_sizes=(4, 16, 64), request_sizes=(2, 8), page_sizes=(4, 16))
  warm = set(t.all_buckets())
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
    assert b in warm, b
  assert t.select(5, 1, 1).num_tokens == 16
  # 5 decodes + 3 prefills fit 8 slots, but 5 + 4 padded prefill slots would not: every
  # slot becomes prefill-capable.
  b = t.select(20, 5, 4, 8, 3)
  assert (b.num_requests, b.prefill_slots) == (8, 8) and b in warm


def test_all_buckets_cover_query_sizes_above_small_token_sizes():
  """A query size larger than a token size runs as Q = T there (select caps it); warm-up
  must compile those shapes too, or a measured run pays for the compile mid-trace."""
  t = BucketTable(token_sizes=(16, 64, 256), request_sizes=(16,), page_sizes=(16,),
                  query_sizes=(256,), prefill_slot_sizes=(1, 2, 16))
  warm = set(t.all_buckets())
  for n_tok, n_pre in itertools.product((5, 20, 90, 200), (1, 2, 3)):
    b = t.select(n_tok + 4, 4, 8, n_tok // n_pre + 1, n_pre)
    assert b in warm, b
  assert len(warm) == 3 * 4  # per token size: decode + three prefill-slot counts


def test_pack_is_padded_and_never_truncates():
  t = BucketTable(token_sizes=(8,), request_sizes=(2,), page_sizes=(2,))
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
