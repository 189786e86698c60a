import itertools

import pytest

from textkit import distance


def reference_levenshtein(a, b):
    # Full-matrix recursion, written independently of the library's two-row version.
    rows = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a) + 1):
        rows[i][0] = i
    for j in range(len(b) + 1):
        rows[0][j] = j
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            rows[i][j] = min(rows[i - 1][j] + 1, rows[i][j - 1] + 1, rows[i - 1][j - 1] + cost)
    return rows[len(a)][len(b)]


class TestLevenshtein:
    @pytest.mark.parametrize(
        "a, b, expected",
        [
            ("kitten", "sitting", 3),
            ("flaw", "lawn", 2),
            ("", "abc", 3),
            ("abc", "", 3),
            ("same", "same", 0),
            ("gumbo", "gambol", 2),
        ],
    )
    def test_known_values(self, a, b, expected):
        assert distance.levenshtein(a, b) == expected

    def test_symmetric_and_matches_reference(self):
        words = ["", "a", "ab", "ba", "abc", "acb", "kitten", "sitting", "mitten"]
        for a, b in itertools.product(words, repeat=2):
            expected = reference_levenshtein(a, b)
            assert distance.levenshtein(a, b) == expected
            assert distance.levenshtein(b, a) == expected

    def test_works_on_lists(self):
        assert distance.levenshtein(["a", "b", "c"], ["a", "c"]) == 1

    @pytest.mark.parametrize("bound, expected", [(0, 1), (1, 2), (2, 3), (3, 3), (10, 3)])
    def test_max_distance_bound(self, bound, expected):
        assert distance.levenshtein("kitten", "sitting", max_distance=bound) == expected

    def test_max_distance_length_gap(self):
        assert distance.levenshtein("a", "abcdefgh", max_distance=2) == 3

    def test_rejects_negative_bound(self):
        with pytest.raises(ValueError):
            distance.levenshtein("a", "b", max_distance=-1)


class TestHamming:
    @pytest.mark.parametrize(
        "a, b, expected",
        [("karolin", "kathrin", 3), ("1011101", "1001001", 2), ("", "", 0), ("abc", "abc", 0)],
    )
    def test_known_values(self, a, b, expected):
        assert distance.hamming(a, b) == expected

    def test_sequences(self):
        assert distance.hamming([1, 2, 3], [1, 0, 3]) == 1

    def test_rejects_unequal_lengths(self):
        with pytest.raises(ValueError):
            distance.hamming("abc", "ab")
