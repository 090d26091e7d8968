"""Whether a stop policy reads the companion model's signals (the one check the engine and the policy builder share)."""
from __future__ import annotations

from data_gen.features import COMPANION_COLUMNS
from predictors.base import StopPolicy

__all__ = ["needs_companion"]


def needs_companion(policy: StopPolicy) -> bool:
    """True for policies that read companion columns: SV, and learned predictors given companion inputs."""
    return policy.kind == "sv" or any(c in COMPANION_COLUMNS for c in policy.required_columns)
