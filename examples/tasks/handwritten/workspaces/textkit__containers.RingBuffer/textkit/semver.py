"""Semantic versions (https://semver.org, version 2.0.0): parsing, precedence and bumping."""

from __future__ import annotations

import functools
import re

_VERSION_RE = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
)


def _prerelease_key(prerelease: tuple[str, ...]) -> tuple:
    # A release sorts after all of its pre-releases; numeric identifiers sort numerically and
    # before alphanumeric ones; a shorter list of equal identifiers sorts first (semver 11.4).
    if not prerelease:
        return (1,)
    parts = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in prerelease)
    return (0, parts)


@functools.total_ordering
class Version:
    """A semantic version ``MAJOR.MINOR.PATCH[-PRERELEASE][+BUILD]``.

    Versions compare by semver precedence: build metadata is ignored, so
    ``Version.parse("1.0.0+a") == Version.parse("1.0.0+b")``, and a pre-release sorts before its
    release (``1.0.0-alpha < 1.0.0-alpha.1 < 1.0.0-beta < 1.0.0``). ``str`` gives the canonical
    text back.

    >>> Version.parse("1.4.0-rc.1") < Version.parse("1.4.0")
    True
    >>> str(Version.parse("2.1.7").bump("minor"))
    '2.2.0'
    """

    __slots__ = ("major", "minor", "patch", "prerelease", "build")

    def __init__(
        self,
        major: int,
        minor: int = 0,
        patch: int = 0,
        prerelease: tuple[str, ...] = (),
        build: tuple[str, ...] = (),
    ) -> None:
        if min(major, minor, patch) < 0:
            raise ValueError(f"version numbers must be >= 0, got {major}.{minor}.{patch}")
        self.major = major
        self.minor = minor
        self.patch = patch
        self.prerelease = tuple(prerelease)
        self.build = tuple(build)

    @classmethod
    def parse(cls, text: str) -> Version:
        """Parse a version string; a leading ``v`` is allowed (``"v1.2.3"``).

        Raises ``ValueError`` for anything that is not a valid semantic version, including
        leading zeros in a number (``"01.2.3"``) or in a numeric pre-release identifier.
        """
        body = text.strip()
        if body[:1] in ("v", "V"):
            body = body[1:]
        match = _VERSION_RE.fullmatch(body)
        if match is None:
            raise ValueError(f"not a semantic version: {text!r}")
        major, minor, patch, pre, build = match.groups()
        prerelease = tuple(pre.split(".")) if pre else ()
        for ident in prerelease:
            if ident.isdigit() and len(ident) > 1 and ident[0] == "0":
                raise ValueError(f"numeric pre-release identifier {ident!r} has a leading zero")
        return cls(
            int(major),
            int(minor),
            int(patch),
            prerelease,
            tuple(build.split(".")) if build else (),
        )

    def bump(self, part: str) -> Version:
        """A new version with ``part`` ("major", "minor" or "patch") raised by one.

        Lower parts reset to zero and pre-release and build are dropped. Bumping the patch of a
        pre-release just drops the pre-release (``1.2.3-rc.1`` -> ``1.2.3``), as the release is
        the next version after it.
        """
        if part == "major":
            return Version(self.major + 1)
        if part == "minor":
            return Version(self.major, self.minor + 1)
        if part == "patch":
            if self.prerelease:
                return Version(self.major, self.minor, self.patch)
            return Version(self.major, self.minor, self.patch + 1)
        raise ValueError(f"part must be 'major', 'minor' or 'patch', got {part!r}")

    @property
    def is_prerelease(self) -> bool:
        """Whether this version carries a pre-release tag."""
        return bool(self.prerelease)

    def _precedence(self) -> tuple:
        return (self.major, self.minor, self.patch, _prerelease_key(self.prerelease))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Version):
            return NotImplemented
        return self._precedence() == other._precedence()

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Version):
            return NotImplemented
        return self._precedence() < other._precedence()

    def __hash__(self) -> int:
        return hash(self._precedence())

    def __str__(self) -> str:
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            text += "-" + ".".join(self.prerelease)
        if self.build:
            text += "+" + ".".join(self.build)
        return text

    def __repr__(self) -> str:
        return f"Version.parse({str(self)!r})"
