"""What a newcomer walks through when following one run: the project files a run enters, the functions it runs and
the classes of ours it builds (the carriers a run's settings pass through), from ``python launch.py`` to results.json.

    python benchmarks/walk_one_run.py [--repo DIR] [hydra overrides...]

Runs ``launch.py`` of ``--repo`` (default: this checkout; give another worktree to compare commits) in this process
under a profiler that records every call into the repository's own Python files (not the packages it uses), with
a fresh output folder and erasure cache, so the data are loaded, erased and trained as on a first run. Prints the
counts, then the files and the classes by name. Not a test: the numbers describe the code, they assert nothing.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

OURS = {"launch", "erasure", "models", "datamodules", "mdl", "hydra_plugins"}  # the repository's top-level modules


def walk(repo: Path, overrides: list[str]) -> tuple[Counter[str], set[tuple[str, str]], set[str], set[str]]:
    """Run launch.py of ``repo`` once; return (calls per project file, (file, function) pairs run, classes of ours
    built, files whose functions take the config itself as an argument)."""
    from omegaconf import DictConfig

    root = str(repo.resolve()) + os.sep
    venv = os.path.join(root, ".venv")
    files: Counter[str] = Counter()
    functions: set[tuple[str, str]] = set()
    classes: set[str] = set()
    config_files: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        this = frame.f_locals.get("self") if code.co_name == "__init__" else None
        if this is not None and type(this).__module__.split(".")[0] in OURS:  # dataclasses' __init__ too
            classes.add(f"{type(this).__module__}.{type(this).__qualname__}")
        path = code.co_filename
        if not path.startswith(root) or path.startswith(venv):
            return
        name = os.path.relpath(path, root)
        files[name] += 1
        functions.add((name, code.co_qualname))
        arguments = [frame.f_locals.get(a) for a in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]]
        if any(isinstance(a, DictConfig) for a in arguments):
            config_files.add(name)

    with tempfile.TemporaryDirectory() as out:
        sys.argv = [str(repo / "launch.py"), f"paths.output_root={out}", f"data.cache_dir={out}/cache", *overrides]
        sys.path.insert(0, str(repo))
        os.chdir(repo)
        sys.setprofile(profile)
        try:
            runpy.run_path(str(repo / "launch.py"), run_name="__main__")
        except SystemExit as end:
            if end.code not in (0, None):
                raise
        finally:
            sys.setprofile(None)
    return files, functions, classes, config_files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    args, overrides = parser.parse_known_args()
    files, functions, classes, config_files = walk(args.repo, overrides)
    print(
        f"{args.repo}: {len(files)} project files entered, {len(functions)} distinct functions run, "
        f"{len(classes)} project classes built, the config passed as an argument in {len(config_files)} files"
    )
    for name, calls in sorted(files.items()):
        print(f"  {name}: {calls} calls")
    print("classes built:", ", ".join(sorted(classes)))
    print("files given the config:", ", ".join(sorted(config_files)))


if __name__ == "__main__":
    main()
