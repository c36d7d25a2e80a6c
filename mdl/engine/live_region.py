"""The one live region on a terminal: redrawn in place, erased when it ends, every log line printed above it.

A region redrawn in place moves the cursor up by the height it drew last. Anything else written to the
terminal meanwhile breaks that count: Hydra's stream handler holds the real stdout, so its lines would be
overwritten by the next redraw, parts of earlier frames would stay on screen, and the next line would begin right
after the region's last character. So while a region is live, every logging handler that writes to the
terminal writes through the region's console, which prints above the region; when the fit ends the region
is erased and the lines printed meanwhile stay. Off a terminal (a log file, CI, Slurm) there is no region.
"""

from __future__ import annotations

import io
import logging
import sys
from contextlib import ExitStack, contextmanager
from functools import lru_cache
from typing import Any, Iterator

from rich.console import Console
from rich.live import Live
from rich.text import Text


@lru_cache(maxsize=1)
def terminal_console() -> Console:
    """One console for the region and the log lines it carries: rich keeps them apart only on one console."""
    return Console()  # stdout, looked up at each write (so pytest's capture or a redirect still applies)


def on_terminal() -> bool:
    """Whether stdout is a terminal, the one place a region redrawn in place reads right. Asked of stdout itself:
    rich counts FORCE_COLOR as a terminal, and a CI log or a Slurm file would fill with redrawn frames."""
    try:
        tty = sys.stdout.isatty()
    except (AttributeError, ValueError):  # no stdout, or a closed one
        return False
    console = terminal_console()
    return tty and console.is_terminal and not console.is_dumb_terminal


class ConsoleLines(io.TextIOBase):
    """A stream that prints each complete line through a console: above its live region, if one is live."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.partial = ""

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            self._print(line)
        return len(text)

    def flush(self) -> None:
        if self.partial:
            self._print(self.partial)
            self.partial = ""

    def isatty(self) -> bool:
        return self.console.is_terminal

    def _print(self, line: str) -> None:
        # soft_wrap: the terminal wraps the line, so it reads (and copies) as the log file has it
        self.console.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)


def _writes_to_terminal(handler: logging.Handler) -> bool:
    """A stream handler (not a file's) whose stream is a terminal: its lines would cut through a live region."""
    if not isinstance(handler, logging.StreamHandler) or isinstance(handler, logging.FileHandler):
        return False
    try:
        return bool(handler.stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def terminal_handlers() -> list[logging.StreamHandler]:
    """Every logging handler that writes to the terminal (Hydra's on the root logger, and any other)."""
    loggers = [
        logging.getLogger(),
        *(lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)),
    ]
    found: dict[int, logging.StreamHandler] = {}
    for logger in loggers:
        for handler in logger.handlers:
            if _writes_to_terminal(handler):
                found.setdefault(id(handler), handler)  # type: ignore[arg-type]
    return list(found.values())


def _swap(handler: logging.StreamHandler, stream: Any) -> Any:
    """The handler's stream, replaced by ``stream``; None for a handler that cannot change streams (``lastResort``)."""
    try:
        return handler.setStream(stream)
    except AttributeError:  # a stream fixed by a read-only property
        return None


@contextmanager
def logs_through(console: Console) -> Iterator[None]:
    """The terminal's logging handlers write through ``console`` while inside, to their own streams after."""
    stream = ConsoleLines(console)
    swapped = [
        (handler, original) for handler in terminal_handlers() if (original := _swap(handler, stream)) is not None
    ]
    try:
        yield
    finally:
        for handler, original in reversed(swapped):
            handler.setStream(original)
        stream.flush()


class LiveRegion:
    """A renderable redrawn in place on the terminal until ``stop``, then erased; nothing off a terminal."""

    def __init__(self, wanted: bool | None = None) -> None:
        self.wanted = on_terminal() if wanted is None else wanted
        self.live: Live | None = None
        self.scope = ExitStack()

    @property
    def on(self) -> bool:
        return self.live is not None

    def start(self, renderable: Any) -> None:
        if not self.wanted or self.live is not None:
            return
        console = terminal_console()
        self.live = Live(
            renderable, console=console, auto_refresh=False, transient=True, redirect_stdout=True, redirect_stderr=True
        )
        try:
            self.scope.enter_context(logs_through(console))
            self.scope.enter_context(self.live)  # draws the first frame
        except BaseException:
            self.live = None
            self.scope.close()  # the handlers back on their own streams
            raise

    def update(self, renderable: Any) -> None:
        if self.live is not None:
            self.live.update(renderable, refresh=True)

    def stop(self) -> None:
        if self.live is None:
            return
        # A region taller than the screen is cropped while live, but rich draws the last frame whole before
        # erasing it; the part that scrolled away would stay. An empty last frame leaves nothing behind.
        self.live.update(Text(""))
        self.live = None
        self.scope.close()
