"""textkit: small, dependency-free helpers for text and data.

Each submodule stands alone; import the one you need::

    from textkit import case
    case.snake_case("HTTPServerError")  # 'http_server_error'

Submodules: ``case`` (identifier styles, slugs), ``wrap`` (line wrapping, justification,
truncation), ``roman`` (Roman numerals), ``codec`` (base-N integers, run-length encoding),
``distance`` (edit distances), ``containers`` (LRU cache, ring buffer), ``semver`` (semantic
versions), ``ini`` (INI files) and ``template`` (``{{ placeholder }}`` rendering).
"""

__version__ = "1.4.0"
