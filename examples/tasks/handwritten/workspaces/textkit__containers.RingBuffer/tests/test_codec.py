import pytest

from textkit import codec


class TestToBase:
    @pytest.mark.parametrize(
        "number, base, expected",
        [(255, 16, "ff"), (5, 2, "101"), (0, 7, "0"), (35, 36, "z"), (61, 62, "Z"), (62, 62, "10")],
    )
    def test_known_values(self, number, base, expected):
        assert codec.to_base(number, base) == expected

    def test_negative(self):
        assert codec.to_base(-10, 2) == "-1010"

    def test_custom_alphabet(self):
        assert codec.to_base(5, 3, alphabet="xyz") == "yz"

    def test_agrees_with_int_parsing(self):
        for number in range(-300, 300, 7):
            for base in (2, 8, 10, 16, 36):
                assert int(codec.to_base(number, base), base) == number

    @pytest.mark.parametrize("base", [0, 1, 63])
    def test_rejects_bad_base(self, base):
        with pytest.raises(ValueError):
            codec.to_base(10, base)

    def test_rejects_alphabet_with_repeats(self):
        with pytest.raises(ValueError):
            codec.to_base(10, 3, alphabet="aab")


class TestFromBase:
    @pytest.mark.parametrize(
        "text, base, expected",
        [
            ("ff", 16, 255),
            ("101", 2, 5),
            ("-1010", 2, -10),
            ("+z", 36, 35),
            pytest.param(" 10 ", 62, 62, id="whitespace"),
        ],
    )
    def test_known_values(self, text, base, expected):
        assert codec.from_base(text, base) == expected

    def test_case_sensitive_digits(self):
        assert codec.from_base("a", 62) == 10
        assert codec.from_base("A", 62) == 36

    @pytest.mark.parametrize("text, base", [("12", 2), ("g", 16), ("", 10), ("-", 10), ("A", 16)])
    def test_rejects_invalid_digits(self, text, base):
        with pytest.raises(ValueError):
            codec.from_base(text, base)

    def test_round_trip_base_62(self):
        for number in (0, 1, 61, 62, 3843, 10**18, -(10**12)):
            assert codec.from_base(codec.to_base(number, 62), 62) == number


class TestRunLength:
    def test_encode_string(self):
        assert codec.rle_encode("aaabcc") == [("a", 3), ("b", 1), ("c", 2)]

    def test_encode_list(self):
        assert codec.rle_encode([1, 1, None, None, 1]) == [(1, 2), (None, 2), (1, 1)]

    def test_encode_empty(self):
        assert codec.rle_encode("") == []

    def test_encode_accepts_iterators(self):
        assert codec.rle_encode(iter("xxy")) == [("x", 2), ("y", 1)]

    def test_decode(self):
        assert codec.rle_decode([("a", 3), ("b", 1)]) == ["a", "a", "a", "b"]

    @pytest.mark.parametrize("text", ["", "a", "aaaa", "abcabc", "112223333_4"])
    def test_round_trip(self, text):
        assert "".join(codec.rle_decode(codec.rle_encode(text))) == text

    @pytest.mark.parametrize(
        "runs", [[("a", 0)], [("a", -2)], [("a", 1.5)], [("a", True)], [("a",)]]
    )
    def test_decode_rejects_bad_runs(self, runs):
        with pytest.raises(ValueError):
            codec.rle_decode(runs)
