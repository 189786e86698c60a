import pytest

from textkit import wrap


class TestWrap:
    def test_greedy_packing(self):
        assert wrap.wrap("the quick brown fox jumps over the lazy dog", 10) == [
            "the quick",
            "brown fox",
            "jumps over",
            "the lazy",
            "dog",
        ]

    def test_collapses_whitespace(self):
        assert wrap.wrap("  a\n\tb   c  ", 80) == ["a b c"]

    def test_splits_long_words(self):
        assert wrap.wrap("ab abcdefgh cd", 3) == ["ab", "abc", "def", "gh", "cd"]

    def test_exact_fit(self):
        assert wrap.wrap("abc def", 7) == ["abc def"]

    @pytest.mark.parametrize("text", ["", "   \n  "], ids=["empty", "blank"])
    def test_empty(self, text):
        assert wrap.wrap(text, 5) == []

    def test_lines_never_exceed_width(self):
        text = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor"
        for width in range(1, 30):
            lines = wrap.wrap(text, width)
            assert all(len(line) <= width for line in lines)
            assert "".join(lines).replace(" ", "") == text.replace(" ", "")

    def test_rejects_zero_width(self):
        with pytest.raises(ValueError):
            wrap.wrap("text", 0)


class TestJustify:
    def test_classic_example(self):
        assert wrap.justify("This is an example of text justification.", 16) == [
            "This    is    an",
            "example  of text",
            "justification.",
        ]

    def test_extra_spaces_go_left(self):
        assert wrap.justify("a b c d e", 8) == ["a  b c d", "e"]

    def test_single_word_line_not_padded(self):
        assert wrap.justify("averyveryverylongword and more", 10) == [
            "averyveryverylongword",
            "and more",
        ]

    def test_every_full_line_has_width(self):
        text = "what must be acknowledgment shall be a fine thing to have around here"
        lines = wrap.justify(text, 20)
        assert all(len(line) == 20 for line in lines[:-1])
        assert lines[-1] == " ".join(lines[-1].split())

    def test_empty(self):
        assert wrap.justify("", 10) == []

    def test_rejects_zero_width(self):
        with pytest.raises(ValueError):
            wrap.justify("text", 0)


class TestTruncate:
    def test_fits_unchanged(self):
        assert wrap.truncate("short text", 20) == "short text"

    def test_cuts_at_word_boundary(self):
        assert wrap.truncate("Hello brave new world", 15) == "Hello brave..."

    def test_custom_placeholder(self):
        assert wrap.truncate("one two three four", 12, placeholder=" [..]") == "one two [..]"

    def test_cuts_mid_word_when_first_word_too_long(self):
        assert wrap.truncate("incomprehensibilities abound", 10) == "incompr..."

    def test_collapses_whitespace(self):
        assert wrap.truncate("a   b\n c", 10) == "a b c"

    def test_rejects_placeholder_wider_than_width(self):
        with pytest.raises(ValueError):
            wrap.truncate("text", 2)
