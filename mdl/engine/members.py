"""How much trains at once (members per fit, the share of memory a pack's data fill): the words and checks the config
and the engine share, free of torch so that the config checks that read them run before torch is imported."""

from __future__ import annotations

from typing import Any

AUTO = "auto"  # mdl.members_per_fit=auto: as many as fit in the device's memory (mdl.engine.memory)


def check_pack_data_fraction(fraction: Any) -> float:
    """``mdl.pack_data_fraction``, a share of the memory in (0, 1]; checked for every run before its data load
    (mdl.run.config_checks), so what a packed sweep would refuse after hours is refused at once everywhere."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:  # nan too
        raise ValueError(
            f"mdl.pack_data_fraction={fraction!r}: give a share of the memory in (0, 1] "
            f"(the most a pack of hydra/launcher=packed fills with data at once), e.g. mdl.pack_data_fraction=0.5"
        )
    return float(fraction)
