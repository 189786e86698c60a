import pytest

from textkit import template


class User:
    def __init__(self, name, roles):
        self.name = name
        self.roles = roles


class TestRender:
    def test_simple(self):
        assert template.render("Hello, {{name}}!", {"name": "Ada"}) == "Hello, Ada!"

    def test_whitespace_inside_braces(self):
        assert template.render("{{   name   }}", {"name": "x"}) == "x"

    def test_dotted_lookup_through_dicts_attributes_and_lists(self):
        context = {"user": User("ada", ["admin", "dev"]), "meta": {"count": 3}}
        out = template.render("{{ user.name }} {{ user.roles.1 }} {{ meta.count }}", context)
        assert out == "ada dev 3"

    @pytest.mark.parametrize(
        "source, expected",
        [
            ("{{ name | upper }}", "  ADA LOVELACE "),
            ("{{ name | strip | title }}", "Ada Lovelace"),
            ("{{ name|strip|length }}", "12"),
        ],
        ids=["upper", "strip-title", "strip-length"],
    )
    def test_filters(self, source, expected):
        assert template.render(source, {"name": "  ada lovelace "}) == expected

    def test_escaped_placeholder(self):
        assert template.render(r"\{{ name }} is {{ name }}", {"name": "x"}) == "{{ name }} is x"

    def test_missing_strict(self):
        with pytest.raises(KeyError, match="user.email"):
            template.render("{{ user.email }}", {"user": {"name": "ada"}})

    def test_missing_lenient(self):
        assert template.render("[{{ nope }}]", {}, strict=False) == "[]"

    def test_unknown_filter(self):
        with pytest.raises(ValueError, match="reverse"):
            template.render("{{ name | reverse }}", {"name": "x"})


class TestFindPlaceholders:
    def test_order_and_uniqueness(self):
        assert template.find_placeholders("{{ b }} {{ a }} {{ b }}") == ["b", "a"]

    def test_filters_not_part_of_name(self):
        assert template.find_placeholders("{{ user.name | upper }}") == ["user.name"]

    def test_skips_escaped(self):
        assert template.find_placeholders(r"\{{ hidden }} {{ shown }}") == ["shown"]

    def test_none(self):
        assert template.find_placeholders("no placeholders { here }") == []
