"""scripts/beside_original.py: its statistics (no scipy) and its refusal of an incomplete copy of the original."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
from beside_original import fisher_exact, load_original, welch_t  # noqa: E402


def test_fisher_exact_is_scipys_two_sided_p() -> None:
    """scipy.stats.fisher_exact([[a, n - a], [c, m - c]]).pvalue, written down from scipy 1.17.1."""
    assert fisher_exact(13, 32, 20, 32) == pytest.approx(0.13283974175090157, rel=1e-12)
    assert fisher_exact(13, 32, 27, 32) == pytest.approx(0.0006283292655219137, rel=1e-12)
    assert fisher_exact(0, 32, 0, 32) == 1.0


def test_welch_t() -> None:
    assert welch_t([1.0, 2.0, 3.0], [2.0, 3.0, 4.0]) == pytest.approx(1 / (2 / 3) ** 0.5)


def test_an_incomplete_original_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mdl").mkdir()
    (tmp_path / "mdl" / "probe.py").write_text("")
    with pytest.raises(SystemExit, match="mdl/sweep.py, mdl/mlp_probe.py, mdl/math.py missing"):
        load_original(tmp_path)
