"""Dependency floors: one table, equal to pyproject.toml's, checked at import with a clear message."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata

import pytest

from conftest import REPO
from models import dependencies
from models.dependencies import MINIMUM_VERSIONS, check_dependencies, version_tuple


def test_floors_equal_pyproject() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {m.group(1): m.group(2) for d in deps if (m := re.match(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", d))}
    for name, floor in MINIMUM_VERSIONS.items():
        assert floors.get(name) == floor, name


def test_installed_stack_passes() -> None:
    check_dependencies()


def test_old_timm_gets_one_clear_message(monkeypatch) -> None:
    real = metadata.version
    monkeypatch.setattr(dependencies.metadata, "version", lambda name: "1.0.29" if name == "timm" else real(name))
    with pytest.raises(ImportError, match=r'timm 1.0.29 is installed, needs >= 1.0.31.*pip install -U "timm>=1.0.31"'):
        check_dependencies()


def test_versions_compare_numerically() -> None:
    assert version_tuple("2.11.0+cu130") == (2, 11, 0)
    assert version_tuple("1.0.9") < version_tuple("1.0.31")
