"""Concept erasers on plain tensors: ``fit_eraser(name, x, y)``, ``eraser(x[, y])``, ``load_eraser``.

Pure torch; imports nothing else of this project.
"""

from erasure.base import Eraser, available_erasers, fit_eraser, load_eraser, register_eraser
from erasure.covariance_power import CovariancePower, fit_covariance_power, load_covariance_power
from erasure.diagnostics import erasure_report, moment_gaps
from erasure.moments import ClassMoments, class_moments

# The shipped erasers' modules are imported when their name is first used (erasure.base.SHIPPED).

__all__ = [
    "ClassMoments",
    "CovariancePower",
    "Eraser",
    "available_erasers",
    "class_moments",
    "erasure_report",
    "fit_covariance_power",
    "fit_eraser",
    "load_covariance_power",
    "load_eraser",
    "moment_gaps",
    "register_eraser",
]
