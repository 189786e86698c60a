"""The built-in rule table: every family's rules in one tuple, in report order."""

from __future__ import annotations

from etude.monitor.rules.artifacts import ARTIFACT_RULES
from etude.monitor.rules.base import Rule
from etude.monitor.rules.grader import GRADER_RULES
from etude.monitor.rules.installed import INSTALLED_RULES
from etude.monitor.rules.network import NETWORK_RULES
from etude.monitor.rules.probing import PROBING_RULES
from etude.monitor.rules.provenance import PROVENANCE_RULES
from etude.monitor.rules.tampering import TAMPERING_RULES
from etude.monitor.rules.vcs import VCS_RULES

BUILTIN_RULES: tuple[Rule, ...] = (
    *ARTIFACT_RULES,
    *VCS_RULES,
    *INSTALLED_RULES,
    *NETWORK_RULES,
    *TAMPERING_RULES,
    *GRADER_RULES,
    *PROBING_RULES,
    *PROVENANCE_RULES,
)
TEXT_RULES: tuple[Rule, ...] = tuple(r for r in BUILTIN_RULES if not r.is_provenance)
"""The rules that read the text of calls and observations alone (no ``prov_*`` target)."""
