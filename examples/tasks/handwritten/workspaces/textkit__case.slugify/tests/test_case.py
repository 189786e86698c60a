import pytest

from textkit import case


@pytest.mark.parametrize(
    "text, expected",
    [
        ("HelloWorld", "hello_world"),
        ("helloWorld", "hello_world"),
        ("HTTPServerError", "http_server_error"),
        ("already_snake", "already_snake"),
        ("kebab-case-input", "kebab_case_input"),
        ("version2Name", "version2_name"),
        pytest.param("  spaced   out  ", "spaced_out", id="whitespace"),
    ],
)
def test_snake_case(text, expected):
    assert case.snake_case(text) == expected


def test_snake_case_of_punctuation_only_is_empty():
    assert case.snake_case("--__--") == ""


@pytest.mark.parametrize(
    "text, expected",
    [
        ("parseJSONResponse", "parse-json-response"),
        pytest.param("Some Title Here", "some-title-here", id="title-words"),
        ("snake_to_kebab", "snake-to-kebab"),
        ("HTTP2Server", "http2-server"),
    ],
)
def test_kebab_case(text, expected):
    assert case.kebab_case(text) == expected


class TestCamelCase:
    @pytest.mark.parametrize(
        "text, expected",
        [
            ("user_id", "userId"),
            pytest.param("HTTP server", "httpServer", id="acronym-word"),
            ("make-it-so", "makeItSo"),
            ("alreadyCamel", "alreadyCamel"),
        ],
    )
    def test_lower_camel(self, text, expected):
        assert case.camel_case(text) == expected

    def test_pascal_case(self):
        assert case.camel_case("user id", upper_first=True) == "UserId"

    def test_single_word(self):
        assert case.camel_case("Word") == "word"
        assert case.camel_case("word", upper_first=True) == "Word"

    def test_empty(self):
        assert case.camel_case("") == ""
        assert case.camel_case("!!!", upper_first=True) == ""


class TestSlugify:
    def test_basic(self):
        assert case.slugify("Hello, World!") == "hello-world"

    @pytest.mark.parametrize(
        "text, expected",
        [
            pytest.param("Cr\u00e8me Br\u00fbl\u00e9e", "creme-brulee", id="french"),
            pytest.param("Stra\u00dfe", "strasse", id="sharp-s"),
            pytest.param("\u00c6sir \u00f8l", "aesir-ol", id="nordic"),
            pytest.param("\u0141\u00f3d\u017a", "lodz", id="polish"),
        ],
    )
    def test_folds_accents(self, text, expected):
        assert case.slugify(text) == expected

    def test_custom_separator(self):
        assert case.slugify("Hello World Again", separator="_") == "hello_world_again"

    def test_max_length_cuts_at_word_boundary(self):
        assert case.slugify("The quick brown fox", max_length=12) == "the-quick"
        assert case.slugify("The quick brown fox", max_length=15) == "the-quick-brown"

    def test_max_length_cuts_long_word_hard(self):
        assert case.slugify("Supercalifragilistic", max_length=5) == "super"

    def test_nothing_left(self):
        assert case.slugify("!!! ???") == ""

    @pytest.mark.parametrize(
        "kwargs", [{"separator": ""}, {"max_length": 0}], ids=["empty-separator", "zero-max-length"]
    )
    def test_rejects_bad_arguments(self, kwargs):
        with pytest.raises(ValueError):
            case.slugify("text", **kwargs)
