import pytest

from textkit import roman

KNOWN = [
    (1, "I"),
    (4, "IV"),
    (9, "IX"),
    (14, "XIV"),
    (40, "XL"),
    (90, "XC"),
    (400, "CD"),
    (1994, "MCMXCIV"),
    (2024, "MMXXIV"),
    (3999, "MMMCMXCIX"),
]


@pytest.mark.parametrize("number, numeral", KNOWN)
def test_to_roman_known_values(number, numeral):
    assert roman.to_roman(number) == numeral


@pytest.mark.parametrize("number", [0, -1, 4000])
def test_to_roman_out_of_range(number):
    with pytest.raises(ValueError):
        roman.to_roman(number)


@pytest.mark.parametrize("value", [1.0, "12", True])
def test_to_roman_rejects_non_int(value):
    with pytest.raises(TypeError):
        roman.to_roman(value)


@pytest.mark.parametrize("number, numeral", KNOWN)
def test_from_roman_known_values(number, numeral):
    assert roman.from_roman(numeral) == number


def test_from_roman_lower_case_and_whitespace():
    assert roman.from_roman("  mcmxciv ") == 1994


@pytest.mark.parametrize("numeral", ["", "IIII", "IC", "VX", "MMMM", "XIIV", "ABC"])
def test_from_roman_rejects_non_canonical(numeral):
    with pytest.raises(ValueError):
        roman.from_roman(numeral)


def test_round_trip_every_value():
    for number in range(1, roman.MAX_ROMAN + 1):
        assert roman.from_roman(roman.to_roman(number)) == number
