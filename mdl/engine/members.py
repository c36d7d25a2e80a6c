"""How many members train at once (``mdl.members_per_fit``): the word the config and the engine share, free of torch so
that the config checks that read it run before torch is imported."""

from __future__ import annotations

AUTO = "auto"  # mdl.members_per_fit=auto: as many as fit in the device's memory (mdl.engine.memory)
