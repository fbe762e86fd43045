"""ipdp: differentially private model training by input perturbation, streamed through Kafka.

``from ipdp import load_model`` is the one name exported here; it is imported on first use, so
``import ipdp`` (which every command and role pays for) loads nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ipdp.model import load_model

__all__ = ["load_model"]


def __getattr__(name: str):
    if name == "load_model":
        from ipdp.model import load_model

        return load_model
    raise AttributeError(f"module 'ipdp' has no attribute {name!r}")
