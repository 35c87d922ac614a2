"""What the tests of the fusion fit check a profile's entries by, written out apart from the library's code."""
from __future__ import annotations

import numpy as np


def held_out_wins(fit: dict) -> bool:
    """Whether the rule beat the fixed fusion on the domains each was fitted without: the worst one's gain over the
    first stage alone no lower, and the mean gain higher."""
    held = fit["held_out"].values()
    gains = {k: np.array([h[k] - h["first_stage_alone"] for h in held]) for k in ("adaptive", "fixed")}
    return gains["adaptive"].min() >= gains["fixed"].min() and gains["adaptive"].mean() > gains["fixed"].mean()
