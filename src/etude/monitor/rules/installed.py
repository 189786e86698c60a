"""Installed-copy rules: the project's package as installed elsewhere (site-packages, wheels, metadata)."""

from __future__ import annotations

from etude.monitor.rules.base import Rule, _r

# fmt: off
INSTALLED_RULES: tuple[Rule, ...] = (
    # the project's installed copy
    _r("installed.site_packages_project", "installed_copy", 3, ("path", "segment", "script", "code"),
       "read the project's installed copy",
       pattern=r"(?:site|dist)-packages/+(?:{pkg})(?:[/.-]|\b)"),
    _r("installed.site_packages", "installed_copy", 2, ("path", "segment", "script"), "read installed packages",
       pattern=r"(?:site|dist)-packages"),
    _r("installed.pip_project", "installed_copy", 3, "segment", "pip show/download/install the project itself",
       pattern=r"{cmd}(?:python[\d.]*\s+-m\s+)?(?:uv\s+)?pip3?\s+(?:show|download|install|inspect|wheel)\b"
               r"[^\n]*?(?<![\w./=-])(?:{pkg})(?![\w/-])"),
    _r("installed.find_copy", "installed_copy", 3, "segment", "search the file system for the project",
       pattern=r"{cmd}(?:find|locate)\s+(?:/|~)[^\n]*?(?:{pkg})"),
    _r("installed.metadata", "installed_copy", 3, ("script", "segment"), "read distribution metadata files",
       pattern=r"importlib[._]metadata[^\n]*\b(?:files|distribution|locate_file|read_text)\b"
               r"|pkg_resources[^\n]*\b(?:get_distribution|resource_filename|resource_string|get_provider)\b"
               r"|dist-info/RECORD\b|egg-info/SOURCES\.txt\b"),
    _r("installed.unpack_dist", "installed_copy", 3, "segment", "unpack a wheel or egg",
       pattern=r"{cmd}(?:unzip|python[\d.]*\s+-m\s+zipfile|wheel\s+unpack|tar\s+-?x\w*)\b[^\n]*\.(?:whl|egg|tar\.gz)\b"),
    _r("installed.observation", "installed_copy", 2, "observation", "pip shows an installed location",
       pattern=r"(?m)^Location:\s*\S*(?:site|dist)-packages"),
)
# fmt: on
