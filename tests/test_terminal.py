"""What a person sees on a terminal: a run under a pseudo-terminal, its bytes fed to a terminal emulator, and the
final screen read back (scrollback included). The live table must be gone, every block line on screen."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from conftest import FITS, FAST, REPO, python_path

pyte = pytest.importorskip("pyte", reason="the terminal emulator of the dev extra (pip install -e '.[dev]')")

BOX = re.compile("[\u2500-\u257f]")  # rich's table borders
TABLE_TITLES = ("prequential members:", "one model training", "┃ member")


def _read_until_exit(master: int, proc: subprocess.Popen, timeout: float) -> bytes:
    """Everything the program writes to the terminal until it exits (the master reads EIO then)."""
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the last process holding the terminal has closed it
            break
        if not data:
            break
        chunks.append(data)
    else:
        proc.kill()
        pytest.fail(f"launch.py ran past {timeout} s under the pseudo-terminal")
    proc.wait(timeout=30)
    return b"".join(chunks)


def run_in_terminal(
    args: list[str], cwd: Path, cols: int = 120, rows: int = 30, timeout: float = 600
) -> tuple[int, bytes]:
    """launch.py with stdin, stdout and stderr on a fresh pseudo-terminal of ``cols`` x ``rows``, as in tmux."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    env = {
        **os.environ,
        "PYTHONPATH": python_path(),
        "TERM": "xterm-256color",
        "COLUMNS": str(cols),
        "LINES": str(rows),
    }
    for key in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        env.pop(key, None)
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "launch.py"), *args],
        cwd=cwd,
        env=env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        close_fds=True,
    )
    os.close(slave)
    try:
        output = _read_until_exit(master, proc, timeout)
    finally:
        os.close(master)
    return proc.returncode, output


def screen_lines(output: bytes, cols: int = 120, rows: int = 30) -> list[str]:
    """The terminal as a person sees it at the end: the scrollback, then the screen, trailing blank lines cut."""
    screen = pyte.HistoryScreen(cols, rows, history=100_000)
    pyte.ByteStream(screen).feed(output)

    def text(line) -> str:
        return "".join(line[x].data for x in range(cols)).rstrip()

    lines = [text(line) for line in screen.history.top] + [text(screen.buffer[y]) for y in range(rows)]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def assert_clean_screen(lines: list[str], num_blocks: int) -> None:
    """Every block line, no table left, no log line glued to a border."""
    screen = "\n".join(lines)
    for title in TABLE_TITLES:
        assert title not in screen, f"a table's title or header stayed on screen:\n{screen}"
    glued = [line for line in lines if re.search(r"[\u2500-\u257f][^\u2500-\u257f\s]", line)]
    assert not glued, f"a line starts right after a box-drawing character: {glued}"
    assert not BOX.search(screen), f"a table's border stayed on screen:\n{screen}"
    for i in range(1, num_blocks):
        assert sum(f"] - block {i}/{num_blocks - 1}:" in line for line in lines) == 1, (
            f"block {i}/{num_blocks - 1}:\n{screen}"
        )
    assert sum("] - final fit on" in line for line in lines) == 1, screen
    assert lines[-1].startswith("results: "), screen


# Fits that last a few seconds, so the table is drawn many times and members finish while others train.
LONG_ENOUGH = [*FAST, "mdl.num_blocks=4", "trainer.kwargs.max_epochs=80", "trainer.patience=8", "print_config=false"]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["stacked", pytest.param("sequential", marks=pytest.mark.slow)])
def test_the_screen_after_a_run_holds_every_block_line_and_no_table(engine: str, tmp_path: Path) -> None:
    code, output = run_in_terminal([*LONG_ENOUGH, FITS[engine], f"paths.output_root={tmp_path}"], tmp_path)
    lines = screen_lines(output)
    assert code == 0, "\n".join(lines)
    assert BOX.search(output.decode(errors="replace")), "no table was drawn: the run ended before the first frame"
    assert_clean_screen(lines, num_blocks=4)


def test_no_live_table_when_stdout_is_not_a_terminal(monkeypatch) -> None:
    """A Slurm job's stdout is a file even where its stderr is still a terminal: plain lines only."""
    from mdl.engine.progress_display import MemberProgress

    class Terminal:
        def isatty(self) -> bool:
            return True

        def write(self, text: str) -> int:
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert not MemberProgress(protocol=None).table.wanted
