import pytest

from textkit import ini

SAMPLE = """\
; global settings
name = textkit

[server]
host = example.org
port: 8080
# ignored
motd = welcome
    to the server

[paths]
data = /var/lib/textkit
"""


class TestParse:
    def test_sample(self):
        assert ini.parse_ini(SAMPLE) == {
            "": {"name": "textkit"},
            "server": {"host": "example.org", "port": "8080", "motd": "welcome\nto the server"},
            "paths": {"data": "/var/lib/textkit"},
        }

    def test_first_separator_splits(self):
        assert ini.parse_ini("url = http://x.org/?a=1")[""] == {"url": "http://x.org/?a=1"}

    def test_repeated_section_merges(self):
        text = "[a]\nx = 1\n[b]\ny = 2\n[a]\nz = 3\n"
        assert ini.parse_ini(text) == {"a": {"x": "1", "z": "3"}, "b": {"y": "2"}}

    def test_empty_value(self):
        assert ini.parse_ini("[s]\nkey =\n") == {"s": {"key": ""}}

    @pytest.mark.parametrize(
        "text, line",
        [
            ("[s]\njust words\n", 2),
            ("[s]\na = 1\na = 2\n", 3),
            ("  indented = first\n", 1),
            ("[s]\n= value\n", 2),
        ],
        ids=["not-a-pair", "duplicate-key", "orphan-continuation", "empty-key"],
    )
    def test_errors_name_the_line(self, text, line):
        with pytest.raises(ini.IniError) as info:
            ini.parse_ini(text)
        assert info.value.line == line
        assert f"line {line}" in str(info.value)


class TestDump:
    def test_dump(self):
        data = {"server": {"host": "example.org", "port": 8080}}
        assert ini.dump_ini(data) == "[server]\nhost = example.org\nport = 8080\n"

    def test_default_section_first(self):
        text = ini.dump_ini({"s": {"a": "1"}, "": {"top": "yes"}})
        assert text == "top = yes\n\n[s]\na = 1\n"

    def test_round_trip(self):
        data = ini.parse_ini(SAMPLE)
        assert ini.parse_ini(ini.dump_ini(data)) == data

    @pytest.mark.parametrize(
        "data",
        [
            {"s": {"a=b": "1"}},
            {"s": {"": "1"}},
            {"s]": {"a": "1"}},
            {"s": {"a": " padded"}},
            {"s": {"a": "one\n\ntwo"}},
            {"s": {"a": "one\n# two"}},
        ],
    )
    def test_rejects_unwritable(self, data):
        with pytest.raises(ValueError):
            ini.dump_ini(data)
