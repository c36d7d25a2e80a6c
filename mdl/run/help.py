"""``python launch.py --help``: the groups a user chooses from, a line each with their options, the presets with
their first comment line, and the keys most runs set; and shell completion of presets in subfolders
(``+experiment=paper/<TAB>``). Light (no torch): launch.py prints the help (``print_help``) before Hydra starts, and
Hydra answers a completion query before any job starts; conf/hydra/help/mdl.yaml renders the same text through a
resolver wherever Hydra's own help runs.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
GROUPS = {  # the groups a user chooses from, in the order a run is described; the others are internal
    "data": "the data set: digits is embedded, the others need their files (docs/models-and-data.md)",
    "eraser": "what is erased: none (control), leace (means), qleace, alf_qleace, gradient (+ covariances)",
    "model": "the network, muP-scaled, at width x depth; model.options.* per model (mlp: activation)",
    "optimizer": "schedule-free AdamW with muP learning rates; optimizer.lr at the base width",
    "loss": "the training objective (code lengths are always cross-entropy)",
    "trainer": "default (fp32) or gpu (bf16, channels-last, compile); trainer.patience, trainer.kwargs.*",
    "mdl": "the prequential blocks (num_blocks, first_block), paper_loss, members_per_fit",
    "protocol": "the training loop: sound (ours) or original (the paper's code; docs/differences-from-original.md)",
    "probes": "max-ent probes at every epoch of the final fit",
    "logger": "csv (built in), wandb, tensorboard (pip install -e '.[tensorboard]'), [csv,wandb], null",
    "callbacks": "Lightning callbacks in every fit",
    "report": "the report every multirun (-m) ends with",
    "debug": "fast: a smoke of any config; profile: under the profiler; overfit: can it fit one batch?",
    "hydra/launcher": "where a sweep's jobs run (basic: one after another here; slurm; packed: one fit per pack)",
}
INTERNAL_GROUPS = ("cost", "paths", "experiment")  # experiment: the presets, listed apart
KEYS = (
    "seed=0  data_seed=0  width=128  depth=2  device=auto|cpu|cuda",
    "tags=[a,b]  skip_if_done=true  print_config=overrides|full|false",
    "optimizer.lr=LR (default: the data set's, below)",
)
WIDTH = 110  # characters a line of the help takes at most


def is_internal(option: str) -> bool:
    """Files a preset or group includes but a user does not choose: ``_base``, ``paper/common``, ``paper/common_smoke``."""
    name = option.rsplit("/", 1)[-1].rsplit("=", 1)[-1]
    return name.startswith("_") or name.startswith("common")


def group_options(group: str) -> list[str]:
    """The options Hydra offers for ``group`` (config files and the plugins' stored configs), internal ones left out."""
    try:
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.object_type import ObjectType

        options = GlobalHydra.instance().config_loader().get_group_options(group, results_filter=ObjectType.CONFIG)
    except (ValueError, AttributeError):  # Hydra not initialised (a test, a script): the files
        options = [p.stem for p in (CONF_DIR / group).glob("*.yaml")]
    return sorted(o for o in options if not is_internal(o))


def first_comment(path: Path) -> str:
    """A config file's first comment line after ``# @package``: what it is."""
    for line in path.read_text().splitlines():
        text = line.strip()
        if text.startswith("#") and not text.startswith("# @package"):
            return text.lstrip("# ").strip()
        if text and not text.startswith("#"):
            break
    return ""


def presets() -> list[tuple[str, str]]:
    """(name for +experiment=, description) of every preset but the smoke versions (one per paper preset)."""
    root = CONF_DIR / "experiment"
    names = sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))
    return [(n, first_comment(root / f"{n}.yaml")) for n in names if not is_internal(n) and not n.endswith("/smoke")]


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def defaults() -> dict[str, str]:
    """Each group's default option, from conf/config.yaml's defaults list."""
    from omegaconf import OmegaConf

    entries = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml").defaults)
    return {str(k): str(v) for e in entries if isinstance(e, dict) for k, v in e.items()}


def default_lrs() -> str:
    """The data sets' default learning rates as conf/optimizer sets them (``digits 0.003, cifar10 0.0005, ...``)."""
    from omegaconf import OmegaConf

    table = OmegaConf.load(CONF_DIR / "optimizer" / "schedulefree_adamw.yaml").lr_by_data
    return ", ".join(f"{source} {lr:g}" for source, lr in table.items())


def help_text() -> str:
    """The whole --help screen."""
    lines = [
        "python launch.py [group=option ...] [key=value ...]       one run",
        "python launch.py -m eraser=none,leace seed=0,1,2 [...]     a sweep (every combination), then its report",
        "",
        "Groups (group=option, * the default):",
    ]
    chosen = defaults()
    for group, what in GROUPS.items():
        options = [f"{o}*" if chosen.get(group) == o else o for o in group_options(group)]
        lines += [f"  {group.ljust(15)}{what}", f"  {'':15}{', '.join(options) or '-'}"]
    lines += [
        "",
        "Keys most runs set:",
        *(f"  {k}" for k in KEYS),
        *textwrap.wrap(f"optimizer.lr_by_data: {default_lrs()}", WIDTH, initial_indent="  ", subsequent_indent="    "),
        "",
        "Presets (+experiment=NAME; paper/NAME/smoke: the same sweep, tiny, on digits in minutes on a CPU):",
    ]
    entries = presets()
    pad = max(len(n) for n, _ in entries)
    lines += [f"  {n.ljust(pad)}  {clip(d, WIDTH - pad - 4)}" for n, d in entries]
    lines += [
        "",
        "Any key can be set (model.options.activation=gelu); python launch.py --cfg job prints them all.",
        "Docs: README.md and docs/. Hydra's own flags: python launch.py --hydra-help.",
        'Tab completion (bash): eval "$(python launch.py -sc install=bash)"',
    ]
    return "\n".join(lines)


def print_help() -> None:
    """``python launch.py --help``, printed by launch.py rather than by Hydra's app_help, which first lists every
    option of every config group (two hundred loads of the config repository: 3 s on a quiet machine, 6 s under load)
    for template fields this help does not show. Hydra is initialised on conf/ all the same, so the options its
    plugins store (hydra/launcher=submitit_slurm) are listed as Hydra lists them."""
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        print(help_text(), flush=True)


def complete_nested_options() -> None:
    """Hydra completes a group's own options (``+experiment=lr_search``) but not those in its subfolders
    (``+experiment=paper/table16``): offer those too, as paths, folders ending in ``/``; internal ones left out."""
    from hydra.core.object_type import ObjectType
    from hydra.plugins.completion_plugin import CompletionPlugin

    original = CompletionPlugin._query_config_groups

    def query(self: Any, word: str, config_name: str | None, words: list[str]) -> tuple[list[str], bool]:
        """Hydra's completion of ``group=value``, plus the configs and folders in ``value``'s subfolder, so
        nested presets complete one path segment at a time like files."""
        matched, exact = original(self, word, config_name, words)
        sign = word[:1] if word[:1] in "+~" else ""
        group, eq, value = word[len(sign) :].partition("=")
        if not eq:
            return matched, exact
        folder = value.rpartition("/")[0]
        where = f"{group}/{folder}" if folder else group
        found = []
        for kind, end in ((ObjectType.CONFIG, ""), (ObjectType.GROUP, "/")):
            for name in self.config_loader.get_group_options(
                where, results_filter=kind, config_name=config_name, overrides=words
            ):
                found.append(f"{sign}{group}={folder + '/' if folder else ''}{name}{end}")
        kept = [m for m in dict.fromkeys([*matched, *found]) if m.startswith(word) and not is_internal(m.rstrip("/"))]
        return kept, exact

    CompletionPlugin._query_config_groups = query
