"""The bucket table: padding picks the next size up; warm-up covers every selectable shape."""
import itertools

import pytest

from jaxinfer.buckets import BucketError, BucketTable
from jaxinfer.runtime.batcher import SeqWork, pack


def test_select_pads_up_and_all_buckets_cover_it():
  t = BucketTable(token_sizes=(4, 16, 64), request_sizes=(2, 8), page_sizes=(4, 16))
  warm = set(t.all_buckets())
  for n_tok, n_req, pages, q in itertools.product(range(1, 65, 7), range(1, 9), (1, 5, 16),
                                                  (1, 3, 16)):
    if q > n_tok or n_req > n_tok:
      continue
    b = t.select(n_tok, n_req, pages, q)
    assert b.num_tokens >= n_tok and b.num_requests >= n_req and b.pages_per_request >= pages
    assert b.max_query_len >= min(q, b.num_tokens)
    assert b in warm
  assert t.select(5, 1, 1, 1).num_tokens == 16


def test_pack_is_padded_and_never_truncates():
  t = BucketTable(token_sizes=(8,), request_sizes=(2,), page_sizes=(2,))
  step = pack([SeqWork([1, 2, 3], 0, [5]), SeqWork([9], 6, [6, 7])], t, page_size=4, num_pages=10)
  a = step.arrays
  assert step.padding_tokens == 4 and a["token_ids"].shape == (8,)
  assert a["write_page"].tolist() == [5, 5, 5, 7, 10, 10, 10, 10]  # padding -> dropped page
  assert a["write_offset"][:4].tolist() == [0, 1, 2, 2]
  assert a["logits_idx"].tolist() == [2, 3]
  with pytest.raises(BucketError, match="tokens per step=9"):
    pack([SeqWork(list(range(9)), 0, [1, 2, 3])], t, page_size=4, num_pages=10)
