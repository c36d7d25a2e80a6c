"""Write the sweep report (``python -m mdl.report``) when a multirun ends, from the Hydra config.

Why: a preset that reproduces a paper table should leave the table, and its comparison with the
paper's numbers, in the sweep directory without a second command. Registered by
``conf/report/default.yaml`` (group ``report``), whose options live in the callback's own node,
``hydra.callbacks.report`` (so they are bookkeeping, never part of a run's config or its hash):

    enabled      write <sweep dir>/report after the last job (false: do nothing)
    compare_to   a shipped paper table (mdl/paper_values/<name>.csv) compared whatever the data set;
                 null: only the tables of the runs' own data set
    images       Figure 1 rows (0: no Figure 1, no data loading)
    print_claims also print the report's claims section (mdl.report.claims) on the console

An unknown ``compare_to`` stops the sweep before any job starts (``on_multirun_start``), like
``mdl.sweeps.checks``. A report that fails after the jobs ran is logged as an error and leaves
the results alone: ``python -m mdl.report <sweep dir>`` can be run again by hand.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class ReportAfterMultirun(Callback):
    def __init__(
        self, enabled: bool = True, compare_to: str | None = None, images: int = 4, print_claims: bool = False
    ) -> None:
        self.enabled = bool(enabled)
        self.compare_to = compare_to or None
        self.images = int(images)
        self.print_claims = bool(print_claims)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from mdl.report.paper import available_tables

        if self.enabled and self.compare_to and self.compare_to not in available_tables():
            raise SystemExit(
                f"hydra.callbacks.report.compare_to={self.compare_to!r}: no such paper table; shipped: "
                f"{', '.join(available_tables())} (or null: compare with the runs' own data set)"
            )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.enabled:
            return
        from mdl.report.build import build_report, print_claims

        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            path = build_report([sweep_dir], sweep_dir / "report", n_images=self.images, compare_to=self.compare_to)
        except Exception as err:  # noqa: BLE001 - the runs are done; the report can be redone by hand
            log.error("report not written (%s: %s); run: python -m mdl.report %s", type(err).__name__, err, sweep_dir)
            return
        log.info("report: %s", path)
        if self.print_claims:
            print_claims([str(sweep_dir)], [], False, None)
