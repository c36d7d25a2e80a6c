"""docs/paper.md's job counts and GPU-hours, made by the cost tool (``python -m mdl.sweeps.cost``), so that the docs
and the tool say one bill.

    python scripts/paper_costs.py           # rewrite the table's last two columns, the total and the example line
    python scripts/paper_costs.py --check   # exit 1, naming each difference, when docs/paper.md disagrees

Each table row names its presets (``+experiment=paper/<name>``, or ``paper/<name>`` for a second one in the row); each
preset is priced as ``python -m mdl.sweeps.cost +experiment=paper/<name>`` prices it (mdl.sweeps.cost.estimate).
"""

from __future__ import annotations

import argparse
import re
import sys
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "paper.md"
EXAMPLE_PRESET = "appendix_c"  # the preset of the example output in "Cost before running"
PRESETS = re.compile(r"paper/([a-z0-9_]+)`")
ROW = re.compile(r"^(\| [^|]+ \| [^|]+ \| )([^|]+)( \| )([^|]+)( \|)$")


@lru_cache(maxsize=None)
def cost(preset: str) -> tuple[int, float, str]:
    """(jobs, GPU-hours, the estimate's printed line) of one paper preset."""
    sys.path.insert(0, str(REPO))
    from hydra import initialize_config_dir

    from mdl.sweeps.cost import CONF_DIR, composed_sweep, cost_report, estimate

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        master, table = composed_sweep([f"+experiment=paper/{preset}"])
        est = estimate(master, table)
        line = next(x for x in cost_report(master, table, est).splitlines() if x.startswith("estimated cost:"))
    return len(est.jobs), est.gpu_s / 3600, line


def gpu_hours(hours: float) -> str:
    """GPU-hours as the table prints them: whole hours, one decimal below 10."""
    return f"{hours:.1f}" if hours < 10 else f"{hours:.0f}"


def rendered(text: str) -> str:
    """docs/paper.md with the tool's numbers in the table, its total and the example line."""
    lines, total_jobs, total_hours = [], 0, 0.0
    for line in text.splitlines():
        match = ROW.match(line)
        presets = PRESETS.findall(line) if match else []
        if presets:
            costs = [cost(p) for p in presets]
            total_jobs += sum(c[0] for c in costs)
            total_hours += sum(c[1] for c in costs)
            jobs = " + ".join(str(c[0]) for c in costs)
            hours = " + ".join(gpu_hours(c[1]) for c in costs)
            line = f"{match.group(1)}{jobs}{match.group(3)}{hours}{match.group(5)}"
        lines.append(line)
    text = "\n".join(lines) + "\n"
    text = re.sub(
        r"All of it is \d+ jobs and about [\d,]+ GPU-hours",
        f"All of it is {total_jobs} jobs and about {round(total_hours, -1):,.0f} GPU-hours",
        text,
    )
    return re.sub(r"(?m)^    estimated cost: .*$", "    " + cost(EXAMPLE_PRESET)[2].split(";")[0] + "; ...", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the docs disagree")
    args = parser.parse_args(argv)
    text = DOCS.read_text()
    new = rendered(text)
    if args.check:
        changed = [(a, b) for a, b in zip(text.splitlines(), new.splitlines()) if a != b]
        for old, line in changed:
            print(f"docs/paper.md says:\n  {old}\nthe cost tool says:\n  {line}")
        if changed:
            print("run: python scripts/paper_costs.py")
        return 1 if changed else 0
    DOCS.write_text(new)
    print(f"{DOCS}: {'rewritten' if new != text else 'already the tool’s numbers'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
