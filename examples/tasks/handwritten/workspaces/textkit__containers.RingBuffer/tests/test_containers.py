import pytest

from textkit import containers


class TestLRUCache:
    def test_get_and_put(self):
        cache = containers.LRUCache(2)
        cache.put("a", 1)
        assert cache.get("a") == 1
        assert cache.get("missing", "fallback") == "fallback"

    def test_evicts_least_recently_used(self):
        cache = containers.LRUCache(2)
        cache.put("a", 1)
        cache.put("b", 2)
        cache.get("a")
        cache.put("c", 3)
        assert "b" not in cache
        assert cache.keys() == ["a", "c"]
        assert cache.evictions == 1

    def test_put_existing_key_refreshes_without_eviction(self):
        cache = containers.LRUCache(2)
        cache.put("a", 1)
        cache.put("b", 2)
        cache.put("a", 10)
        cache.put("c", 3)
        assert cache.keys() == ["a", "c"]
        assert cache.get("a") == 10

    def test_contains_does_not_refresh(self):
        cache = containers.LRUCache(2)
        cache.put("a", 1)
        cache.put("b", 2)
        assert "a" in cache
        cache.put("c", 3)
        assert "a" not in cache

    def test_counters_and_clear(self):
        cache = containers.LRUCache(1)
        cache.put("a", 1)
        cache.get("a")
        cache.get("b")
        cache.put("b", 2)
        assert (cache.hits, cache.misses, cache.evictions, len(cache)) == (1, 1, 1, 1)
        cache.clear()
        assert (cache.hits, cache.misses, cache.evictions, len(cache)) == (0, 0, 0, 0)

    def test_never_exceeds_capacity(self):
        cache = containers.LRUCache(3)
        for i in range(50):
            cache.put(i % 7, i)
            assert len(cache) <= 3

    def test_rejects_zero_capacity(self):
        with pytest.raises(ValueError):
            containers.LRUCache(0)


class TestRingBuffer:
    def test_append_until_full(self):
        ring = containers.RingBuffer(3)
        assert ring.append(1) is None
        ring.append(2)
        assert not ring.is_full()
        ring.append(3)
        assert ring.is_full()
        assert list(ring) == [1, 2, 3]

    def test_overwrites_oldest(self):
        ring = containers.RingBuffer(3, [1, 2, 3])
        assert ring.append(4) == 1
        assert list(ring) == [2, 3, 4]
        assert len(ring) == 3

    @pytest.mark.parametrize("index, expected", [(0, 3), (1, 4), (2, 5), (-1, 5), (-3, 3)])
    def test_indexing_after_wraparound(self, index, expected):
        ring = containers.RingBuffer(3, range(6))
        assert ring[index] == expected

    @pytest.mark.parametrize("index", [3, -4])
    def test_index_out_of_range(self, index):
        ring = containers.RingBuffer(3, range(6))
        with pytest.raises(IndexError):
            ring[index]

    def test_popleft(self):
        ring = containers.RingBuffer(2, "abc")
        assert ring.popleft() == "b"
        ring.append("d")
        assert list(ring) == ["c", "d"]
        assert ring.popleft() == "c"
        assert ring.popleft() == "d"
        with pytest.raises(IndexError):
            ring.popleft()

    def test_matches_bounded_deque(self):
        from collections import deque

        ring = containers.RingBuffer(4)
        reference = deque(maxlen=4)
        for i in range(25):
            ring.append(i)
            reference.append(i)
            if i % 5 == 4:
                assert ring.popleft() == reference.popleft()
            assert list(ring) == list(reference)

    def test_rejects_zero_capacity(self):
        with pytest.raises(ValueError):
            containers.RingBuffer(0)
