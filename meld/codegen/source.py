"""What every kernel family's code generation shares: the templates shipped as package data, and the
limits of the target that size a family's static configuration."""
from __future__ import annotations

from importlib import resources

SMEM_PER_CTA_MAX = 227 * 1024   # opt-in dynamic shared memory per CTA on sm_90


def template(name: str) -> str:
    """The text of `templates/<name>` (package data: read through importlib.resources, so it works from a
    wheel or a zip as from a checkout)."""
    return resources.files("meld.codegen").joinpath("templates", name).read_text()
