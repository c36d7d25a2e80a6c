"""The oldest versions of the libraries this framework is verified with, checked at import.

A cluster with an older stack gets one message listing what to upgrade, instead of a TypeError
deep inside timm. The floors are the versions the test suites passed with (CI installs the newest;
the GPU suite ran on torch 2.11, torchvision 0.26, lightning 2.6.6): timm 1.0.31 is the first
whose Swin V2 rounds odd token grids up (timm pads them), which 8x8 inputs need; older versions
build a 0x0 stage. pyproject.toml repeats these floors (a test keeps the two equal).
"""

from __future__ import annotations

import re
from importlib import metadata

MINIMUM_VERSIONS = {
    "torch": "2.11",
    "torchvision": "0.26",
    "lightning": "2.6",
    "timm": "1.0.31",
    "hydra-core": "1.3.2",
    "omegaconf": "2.3",
    "mup": "1.0",
    "schedulefree": "1.4",
}


def version_tuple(version: str) -> tuple[int, ...]:
    """'2.11.0+cu130' -> (2, 11, 0); pre-release and local suffixes are ignored."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def outdated() -> list[str]:
    """'name installed X, needs >= Y' for every package below its floor (or missing)."""
    problems = []
    for name, floor in MINIMUM_VERSIONS.items():
        version = installed_version(name)
        if version is None:
            problems.append(f"{name} is not installed (needs >= {floor})")
        elif version_tuple(version) < version_tuple(floor):
            problems.append(f"{name} {version} is installed, needs >= {floor}")
    return problems


def check_dependencies() -> None:
    problems = outdated()
    if problems:
        upgrade = " ".join(
            f'"{name}>={MINIMUM_VERSIONS[name]}"'
            for name in MINIMUM_VERSIONS
            if any(p.startswith(name + " ") for p in problems)
        )
        raise ImportError(
            "this framework needs newer libraries: "
            + "; ".join(problems)
            + f". Upgrade with: pip install -U {upgrade} (or reinstall with pip install -e .)"
        )
