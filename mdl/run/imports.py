"""Importing the training code once per process, so that the garbage collector does not keep paying for it.

Light on purpose (no torch): launch.py and the packed launcher import it before the heavy imports."""

from __future__ import annotations

import gc
import re
import sys
from contextlib import contextmanager
from typing import Iterator

_frozen = False  # this process froze once (gc.get_freeze_count walks the ~536k frozen objects: 48 ms a call)


@contextmanager
def imports_frozen() -> Iterator[None]:
    """Import the training code inside this block: the cyclic garbage collector is paused meanwhile, the import's
    garbage is then collected once, and every object still alive moves to the collector's permanent generation
    (``gc.freeze``), once per process. torch, lightning, torchmetrics and sympy leave about half a million
    long-lived objects (0.3 s per full collection on 2 cores) that every full collection during training, and the
    one at exit, would otherwise walk again: the default run took 10.0 s with them, 7.7 s frozen on 2 cores
    (3 alternating runs each; the numbers are the same). torchmetrics' optional extras stay out of the import
    (``torchmetrics_extras_hidden``). Later jobs of a sweep in this process freeze nothing
    more: their garbage is collected as usual. The collector's own on/off state is restored."""
    global _frozen
    if _frozen:
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torchmetrics_extras_hidden():
            yield
    finally:
        gc.collect()  # the import's own garbage (about 14k cycles, ~38 MiB) is freed, not frozen for good
        gc.freeze()
        _frozen = True
        if was_enabled:
            gc.enable()


# torchmetrics, which lightning imports whole, imports scipy.signal, torchvision.models (and with it torch._dynamo)
# and matplotlib.pyplot at its own import when they are installed, for metrics and plots this framework never uses.
HIDDEN_FROM_TORCHMETRICS = frozenset({"scipy", "torchvision", "matplotlib"})
_hiding = False


@contextmanager
def torchmetrics_extras_hidden() -> Iterator[None]:
    """Import lightning (and with it torchmetrics) inside this block: lightning_utilities' availability checks, which
    torchmetrics consults at its import, answer "not installed" for ``HIDDEN_FROM_TORCHMETRICS`` meanwhile, so
    torchmetrics skips them. After the block every check answers the truth again (a ``RequirementCache`` asked meanwhile,
    e.g. lightning's own ``_TORCHVISION_AVAILABLE``, forgets its answer and asks again when next used), and the packages
    import as usual wherever this framework uses them (figures, torchvision's models and data sets). A no-op once
    torchmetrics is imported, or where lightning_utilities lacks the two checks."""
    global _hiding
    try:
        from lightning_utilities.core import imports as checks
    except ImportError:
        yield
        return
    if "torchmetrics" in sys.modules or not hasattr(checks.RequirementCache, "_check_requirement"):
        yield
        return
    available, check = checks.package_available, checks.RequirementCache._check_requirement
    answered: list[checks.RequirementCache] = []  # told "not installed" meanwhile: they ask again afterwards

    def package_available(name: str) -> bool:
        return not (_hiding and name in HIDDEN_FROM_TORCHMETRICS) and available(name)

    def check_requirement(self: checks.RequirementCache) -> None:
        if _hiding and re.split(r"[<>=!~\[;\s]", self.requirement or "")[0] in HIDDEN_FROM_TORCHMETRICS:
            self.available, self.message = False, f"{self.requirement!r} hidden from torchmetrics' import"
            answered.append(self)
            return
        check(self)

    checks.package_available, checks.RequirementCache._check_requirement = package_available, check_requirement
    _hiding = True
    try:
        yield
    finally:
        _hiding = False
        checks.package_available, checks.RequirementCache._check_requirement = available, check
        for requirement in answered:
            del requirement.available  # RequirementCache._check_available asks again when it has no answer
