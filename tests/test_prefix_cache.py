"""PrefixCache: matching, locking, insertion, eviction policies, host tier, snapshots."""
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.runtime.pages import PageManager
from jaxinfer.runtime.prefix_cache import PrefixCache

KEY = ("m", "", "bf16")


def _run_request(pm, cache, rid, tokens, key=KEY):
  """Admit with a cache hit, 'compute' the rest, finish, insert, free. Returns the match."""
  m = cache.match(key, tokens, max_tokens=len(tokens) - 1)
  cache.lock(m.nodes)
  assert pm.add_sequence(rid, m.device_pages, len(m.device_pages) * pm.page_size,
                         reserve_tokens=len(tokens))
  pm.grow(rid, len(tokens))
  cache.insert(key, tokens, pm.page_table(rid))
  cache.unlock(m.nodes)
  pm.free(rid)
  return m


def test_longest_prefix_at_page_granularity():
  pm = PageManager(32, 4)
  cache = PrefixCache(pm)
  sys_prompt = list(range(100, 110))  # 10 tokens: 2 full pages + 2
  _run_request(pm, cache, "a", sys_prompt + [1, 2, 3])
  m = _run_request(pm, cache, "b", sys_prompt + [7, 8, 9, 9])
  assert m.num_tokens == 8 and m.device_tokens == 8  # the partial third page is not shared
  m = cache.match(KEY, [100, 101, 102, 5, 6, 7, 8, 9])
  assert m.num_tokens == 0  # reuse stops at the first differing token (8.3.3)
  assert cache.match(("m", "lora1", "bf16"), sys_prompt).num_tokens == 0  # other adapter
  assert cache.match(("m", "", "q8_0"), sys_prompt).num_tokens == 0  # other KV format
  pm.check_invariants(cache.owned_refs())


def test_locked_nodes_are_not_evicted_and_lru_order():
  pm = PageManager(16, 4)
  cache = PrefixCache(pm)
  _run_request(pm, cache, "a", list(range(0, 9)))
  _run_request(pm, cache, "b", list(range(50, 59)))
  held = cache.match(KEY, list(range(50, 59)))
  cache.lock(held.nodes)
  assert cache.evict(10) == 2  # only a's two pages: b's are locked
  assert cache.match(KEY, list(range(0, 9))).num_tokens == 0
  cache.unlock(held.nodes)
  assert cache.evict(1) == 1  # leaf first: the deeper page of b goes
  assert cache.match(KEY, list(range(50, 59))).num_tokens == 4
  pm.check_invariants(cache.owned_refs())


def test_host_tier_offload_and_fetch():
  pm = PageManager(8, 4)
  cache = PrefixCache(pm, host_pages=4)
  toks = list(range(20, 29))
  _run_request(pm, cache, "a", toks)
  assert cache.evict(2) == 2
  assert sorted(s for _, s in cache.pending_offloads) == [2, 3]
  m = cache.match(KEY, toks, max_tokens=8)
  assert m.device_tokens == 0 and m.host_tokens == 8
  copies = cache.fetch(m.nodes)
  assert len(copies) == 2 and cache.num_host_pages == 0
  assert cache.match(KEY, toks, max_tokens=8).device_tokens == 8
  assert cache.stats.device_hit_tokens == 8 and cache.stats.host_hit_tokens == 8
  pm.check_invariants(cache.owned_refs())


def test_value_policy_keeps_the_long_prefix():
  """8.3.4: per MiB, one long hot prefix can beat short ones (super-linear prefill)."""
  pm = PageManager(64, 4)
  cache = PrefixCache(pm, eviction="value", recompute_time=lambda n: n + 0.01 * n * n)
  long = list(range(1000, 1032))  # 8 pages
  short = list(range(2000, 2008))  # 2 pages
  for i in range(3):
    _run_request(pm, cache, f"l{i}", long + [i])
  _run_request(pm, cache, "s", short + [1])
  cache.evict(2)
  assert cache.match(KEY, long).num_tokens == 32
  assert cache.match(KEY, short).num_tokens == 0


def test_snapshot_restore_and_recompute():
  """8.3.3: a match up to 10,752 with snapshots every 4096 restores 8192, recomputes 2560."""
  pm = PageManager(800, 16)
  cache = PrefixCache(pm, snapshot_interval=4096)
  toks = list(range(10752 + 5))
  _run_request(pm, cache, "a", toks)
  m = cache.match(KEY, toks, max_tokens=10752)
  assert m.num_tokens == 10752 and m.restore_tokens == 8192 and m.recompute_tokens == 2560


OPS = st.lists(st.tuples(st.sampled_from(["req", "evict", "lock", "unlock", "fetch"]),
                         st.integers(0, 3), st.integers(1, 30)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS, st.sampled_from(["lru", "value"]), st.sampled_from([0, 3]))
def test_property_cache_and_pages_stay_consistent(ops, policy, host):
  pm = PageManager(24, 4)
  cache = PrefixCache(pm, eviction=policy, host_pages=host)
  prefixes = [list(range(100 * i, 100 * i + 12)) for i in range(4)]
  held = []
  for k, (op, i, n) in enumerate(ops):
    tokens = prefixes[i] + list(range(500 + k, 500 + k + n % 7))
    if op == "req":
      m = cache.match(KEY, tokens, max_tokens=len(tokens) - 1)
      m_dev = []
      for nd in m.nodes:
        if not nd.on_device:
          break
        m_dev.append(nd)
      need = pm.pages_for(len(tokens)) - len(m_dev)
      if need > pm.num_available:
        cache.evict(need - pm.num_available)
      cache.lock(m_dev)
      if pm.add_sequence(k, [nd.page for nd in m_dev], len(m_dev) * 4,
                         reserve_tokens=len(tokens)):
        pm.grow(k, len(tokens))
        cache.insert(KEY, tokens, pm.page_table(k))
        pm.free(k)
      cache.unlock(m_dev)
    elif op == "evict":
      cache.evict(n % 5)
    elif op == "lock":
      m = cache.match(KEY, prefixes[i], record=False)
      cache.lock(m.nodes)
      held.append(m.nodes)
    elif op == "unlock" and held:
      cache.unlock(held.pop())
    elif op == "fetch":
      m = cache.match(KEY, prefixes[i], record=False)
      cache.fetch(m.nodes)
    pm.check_invariants(cache.owned_refs())
    assert cache.num_host_pages <= host


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["req", "hold", "release", "touch", "evict",
                                               "fetch"]),
                              st.integers(0, 5), st.integers(1, 3)), min_size=5, max_size=60),
       host_pages=st.sampled_from([0, 3]))
def test_lru_eviction_kept_across_calls_picks_what_a_scan_picks(ops, host_pages):
  """The LRU candidates kept between evictions give, victim by victim, the least recently
  used unlocked device leaf (the deepest among equals) that a scan of the whole tree
  finds, whatever requests, locks, lookups and host fetches came between."""
  pm = PageManager(24, 4)
  cache = PrefixCache(pm, host_pages=host_pages)
  prefixes = [list(range(100 * k, 100 * k + 8)) for k in range(3)]
  held, n = [], 0
  for op, a, b in ops:
    tokens = prefixes[a % 3] + [1000 + a * 10 + j for j in range(4 * b + 1)]
    if op == "req" and pm.num_available >= 8:
      n += 1
      _run_request(pm, cache, f"r{n}", tokens)
    elif op == "hold":
      m = cache.match(KEY, tokens)
      cache.lock(m.nodes)
      held.append(m.nodes)
    elif op == "release" and held:
      cache.unlock(held.pop(a % len(held)))
    elif op == "touch":
      cache.match(KEY, tokens)
    elif op == "fetch":
      m = cache.match(KEY, tokens)
      cache.fetch([x for x in m.nodes if not x.on_device])
    elif op == "evict":
      for _ in range(b):
        leaves = [x for x in cache._nodes() if cache._device_evictable(x)]
        if not leaves:
          assert cache.evict(1) == 0
          break
        want = min(leaves, key=lambda x: (cache._rank(x), id(x)))
        assert cache.evict(1) == 1
        assert not want.on_device
    pm.check_invariants(cache.owned_refs())
