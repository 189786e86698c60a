import random

import pytest

from textkit import semver


class TestParse:
    def test_full_version(self):
        v = semver.Version.parse("1.2.3-alpha.1+build.5")
        assert (v.major, v.minor, v.patch) == (1, 2, 3)
        assert v.prerelease == ("alpha", "1")
        assert v.build == ("build", "5")

    @pytest.mark.parametrize("text", ["1.0.0", "0.0.1", "10.20.30", "1.0.0-rc.1+exp.sha.5114f85"])
    def test_str_round_trip(self, text):
        assert str(semver.Version.parse(text)) == text

    def test_leading_v(self):
        assert str(semver.Version.parse("v2.0.1")) == "2.0.1"

    @pytest.mark.parametrize(
        "text", ["1", "1.2", "1.2.3.4", "01.2.3", "1.2.3-", "1.2.3-01", "a.b.c", "1.2.3+", ""]
    )
    def test_rejects_invalid(self, text):
        with pytest.raises(ValueError):
            semver.Version.parse(text)


class TestPrecedence:
    def test_spec_ordering(self):
        ordered = [
            "1.0.0-alpha",
            "1.0.0-alpha.1",
            "1.0.0-alpha.beta",
            "1.0.0-beta",
            "1.0.0-beta.2",
            "1.0.0-beta.11",
            "1.0.0-rc.1",
            "1.0.0",
            "1.0.1",
            "1.1.0",
            "2.0.0",
        ]
        versions = [semver.Version.parse(text) for text in ordered]
        shuffled = versions[:]
        random.Random(0).shuffle(shuffled)
        assert [str(v) for v in sorted(shuffled)] == ordered

    def test_build_metadata_ignored(self):
        a, b = semver.Version.parse("1.0.0+a"), semver.Version.parse("1.0.0+b")
        assert a == b
        assert hash(a) == hash(b)

    def test_numeric_parts_compare_numerically(self):
        assert semver.Version.parse("1.10.0") > semver.Version.parse("1.9.0")

    def test_not_equal_to_strings(self):
        assert semver.Version.parse("1.0.0") != "1.0.0"

    def test_is_prerelease(self):
        assert semver.Version.parse("1.0.0-rc.1").is_prerelease
        assert not semver.Version.parse("1.0.0").is_prerelease


class TestBump:
    @pytest.mark.parametrize(
        "text, part, expected",
        [
            ("1.2.3", "major", "2.0.0"),
            ("1.2.3", "minor", "1.3.0"),
            ("1.2.3", "patch", "1.2.4"),
            ("1.2.3-rc.1+b7", "patch", "1.2.3"),
            ("0.9.9-beta", "minor", "0.10.0"),
        ],
    )
    def test_bump(self, text, part, expected):
        assert str(semver.Version.parse(text).bump(part)) == expected

    def test_rejects_unknown_part(self):
        with pytest.raises(ValueError):
            semver.Version.parse("1.0.0").bump("build")
