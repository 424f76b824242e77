"""Progress of long steps: one display, one task per stage, and plain lines when output is piped.

Library code marks its long steps with `stage` and advances them; it never prints. What the user
sees depends on the reporter the caller installed with `reporting` (the CLI does; a library user
who installs none gets no output at all):

- `RichReporter` — on a terminal: one rich progress display with a bar per stage (read headers,
  plan, gates, k-means, write, hash, verify), count of total in the stage's unit (bytes shown as
  MB/GB), throughput and time left.
- `LineReporter` — when stderr is not a terminal (CI logs, ``nohup``, notebooks): for a stage
  that runs longer than `FIRST_LINE_SECONDS`, a line then, one every `LINE_SECONDS` seconds
  (``MOE_UPCYCLE_PROGRESS_SECONDS`` overrides) and one when it ends, e.g.
  ``write: 1.2 GB of 6.8 GB (18%), 410 MB/s, about 14s left``.
- nothing (the default, and ``-q``).

Example:
    >>> with stage("gates", total=4, unit="prompts") as st:
    ...     st.advance(4)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.table import Column
from rich.text import Text

from moe_upcycle.terminal.markup import escape, printable

LINE_SECONDS = 5.0  # at most one plain progress line per stage this often
FIRST_LINE_SECONDS = 2.0  # a stage that ends sooner prints no plain line at all


@dataclass
class Stage:
    """A running stage: `advance` it by units done, `update` its total or note."""

    name: str
    total: Optional[float]
    unit: str
    reporter: "Reporter"
    completed: float = 0.0
    note: str = ""
    started: float = field(default_factory=time.monotonic)
    stopped: bool = False  # the block ended with an exception (an error, an interrupt): not "done"

    def advance(self, amount: float = 1, note: Optional[str] = None) -> None:
        self.completed += amount
        if note is not None:
            self.note = note
        self.reporter.changed(self)

    def update(self, *, total: Optional[float] = None, note: Optional[str] = None) -> None:
        if total is not None:
            self.total = total
        if note is not None:
            self.note = note
        self.reporter.changed(self)


class Reporter:
    """Shows nothing (the default); subclasses show stages."""

    def started(self, st: Stage) -> None:
        pass

    def changed(self, st: Stage) -> None:
        pass

    def finished(self, st: Stage) -> None:
        pass

    def close(self) -> None:
        pass


_CURRENT: contextvars.ContextVar[Reporter] = contextvars.ContextVar("moe_upcycle_progress", default=Reporter())
_OPEN: contextvars.ContextVar[dict] = contextvars.ContextVar("moe_upcycle_open_stages", default={})


@contextlib.contextmanager
def stage(name: str, total: Optional[float] = None, unit: str = "steps", note: str = "") -> Iterator[Stage]:
    """Report a long step as stage `name` with `total` units (None: unknown) until the block ends.

    Args:
        name: what the user sees, e.g. ``write``.
        total: units in the stage (bytes for ``unit="bytes"``), or None when unknown.
        unit: plural noun of what is counted (``bytes`` is shown as kB/MB/GB).
        note: a short detail shown beside the stage (what it works on).
    """
    reporter = _CURRENT.get()
    st = Stage(name, total, unit, reporter, note=note)
    reporter.started(st)
    try:
        yield st
    except BaseException:
        st.stopped = True
        raise
    finally:
        reporter.finished(st)


def staged(name: str, total: Optional[float] = None, unit: str = "steps") -> Callable:
    """Decorator: run the function as stage `name`; inside it, `advance(name, ...)` moves the stage on.

    Example:
        >>> @staged("check", total=2)
        ... def check():
        ...     advance("check", note="files"); advance("check", note="model")
        >>> check()
    """

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with stage(name, total, unit) as st:
                token = _OPEN.set({**_OPEN.get(), name: st})
                try:
                    return fn(*args, **kwargs)
                finally:
                    _OPEN.reset(token)
        return run

    return wrap


def advance(name: str, amount: float = 1, note: Optional[str] = None) -> None:
    """Advance the running stage `name` opened by `staged` (nothing when none is running)."""
    st = _OPEN.get().get(name)
    if st is not None:
        st.advance(amount, note)


@contextlib.contextmanager
def reporting(reporter: Reporter) -> Iterator[Reporter]:
    """Send every `stage` inside the block to `reporter`; close it at the end."""
    token = _CURRENT.set(reporter)
    try:
        yield reporter
    finally:
        _CURRENT.reset(token)
        reporter.close()


def for_console(console: Console, quiet: bool = False) -> Reporter:
    """The reporter for a console: rich bars on a terminal, plain lines otherwise, none when quiet."""
    if quiet:
        return Reporter()
    if console.is_terminal and not console.is_dumb_terminal:
        return RichReporter(console)
    return LineReporter(console.print, heartbeat=True)


def human_count(value: float, unit: str) -> str:
    """``1.2 GB`` for bytes, ``12 prompts`` otherwise.

    Example:
        >>> human_count(1_234_567, "bytes"), human_count(12, "prompts")
        ('1.2 MB', '12 prompts')
    """
    if unit == "bytes":
        for scale, suffix in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if value >= scale:
                return f"{value / scale:.1f} {suffix}"
        return f"{value:.0f} B"
    return f"{value:,.0f} {unit}"


def _seconds(value: float) -> str:
    value = int(round(value))
    return f"{value // 60}m{value % 60:02d}s" if value >= 60 else f"{value}s"


def describe(st: Stage, now: Optional[float] = None) -> str:
    """One plain line for a running stage: done of total (percent), throughput, time left, note.

    Example:
        >>> s = Stage("write", 4e9, "bytes", Reporter(), completed=1e9, started=0.0)
        >>> describe(s, now=2.0)
        'write: 1.0 GB of 4.0 GB (25%), 500.0 MB/s, about 6s left'
    """
    elapsed = max((time.monotonic() if now is None else now) - st.started, 1e-9)
    if not st.completed and not st.total:  # nothing to count yet (loading a model): say how long
        return f"{st.name}: running for {_seconds(elapsed)}" + (f" — {st.note}" if st.note else "")
    done = human_count(st.completed, st.unit)
    if st.total:
        line = f"{st.name}: {done.removesuffix(' ' + st.unit)} of {human_count(st.total, st.unit)} " \
               f"({100 * st.completed / st.total:.0f}%)"
    else:
        line = f"{st.name}: {done}"
    if st.completed > 0 and elapsed >= 0.5:
        rate = st.completed / elapsed
        line += f", {human_count(rate, st.unit)}/s" if st.unit == "bytes" else f", {rate:,.1f} {st.unit}/s"
        if st.total and st.total > st.completed:
            line += f", about {_seconds((st.total - st.completed) / rate)} left"
    return line + (f" — {st.note}" if st.note else "")


class LineReporter(Reporter):
    """Plain lines for logs: none for a stage that ends within `first` seconds; else a line at
    `first` seconds, then every `interval` seconds, and one when it ends. With `heartbeat`, a
    background thread keeps the lines coming while a stage reports nothing (loading a model)."""

    def __init__(self, emit: Callable[..., None], interval: Optional[float] = None, first: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic, heartbeat: bool = False):
        env = os.environ.get("MOE_UPCYCLE_PROGRESS_SECONDS")
        self.emit = emit
        self.interval = interval if interval is not None else float(env) if env else LINE_SECONDS
        self.first = first if first is not None else min(FIRST_LINE_SECONDS, self.interval)
        self.clock = clock
        self._next: dict[int, float] = {}
        self._open: dict[int, Stage] = {}
        self._shown: set[int] = set()
        self._said: dict[int, tuple] = {}  # what the last line of each stage said (done, total, note)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.heartbeat = heartbeat

    def _print(self, line: str) -> None:
        self.emit(printable(line), highlight=False, soft_wrap=True, markup=False)

    def started(self, st: Stage) -> None:
        st.started = self.clock()
        with self._lock:
            self._next[id(st)] = st.started + self.first
            self._open[id(st)] = st
            self._said[id(st)] = (st.completed, st.total, st.note)  # a parent's unchanged start is not news
        if self.heartbeat and self._thread is None and self.interval > 0:
            self._thread = threading.Thread(target=self._beat, name="progress-lines", daemon=True)
            self._thread.start()

    def _due(self, st: Stage, quiet_parent: bool = False) -> Optional[str]:
        """The line for `st` when one is due, else None. With `quiet_parent` (the heartbeat), a stage with a
        stage running inside it says nothing new until it changes: the inner stage's lines show the work."""
        now = self.clock()
        state = (st.completed, st.total, st.note)
        with self._lock:
            if now < self._next.get(id(st), float("inf")):
                return None
            if quiet_parent and self._said.get(id(st)) == state and next(reversed(self._open)) != id(st):
                return None  # `gates: 0 of 30 layers (0%)` every 5 s while its router inputs advance
            self._next[id(st)] = now + max(self.interval, 1e-9)
            self._shown.add(id(st))
            self._said[id(st)] = state
        return describe(st, now)

    def changed(self, st: Stage) -> None:
        line = self._due(st)
        if line:
            self._print(line)

    def _beat(self) -> None:
        while not self._stop.wait(min(0.5, self.interval)):
            with self._lock:
                running = list(self._open.values())
            for st in running:
                line = self._due(st, quiet_parent=True)
                if line:
                    self._print(line)

    def finished(self, st: Stage) -> None:
        with self._lock:
            self._next.pop(id(st), None)
            self._open.pop(id(st), None)
            shown = id(st) in self._shown
            self._shown.discard(id(st))
            self._said.pop(id(st), None)
        elapsed = self.clock() - st.started
        if shown or elapsed >= self.first:
            done = f"{human_count(st.completed, st.unit)} " if st.completed else ""
            if st.stopped:
                self._print(f"{st.name}: stopped after {done}{_seconds(elapsed)}")
            else:
                self._print(f"{st.name}: done {done}in {_seconds(elapsed)}" + (f" — {st.note}" if st.note else ""))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class _CountColumn(ProgressColumn):
    """``1.2 GB/6.8 GB`` or ``12/40 prompts`` (``12 prompts`` when the total is unknown)."""

    def render(self, task: Task) -> Text:
        unit = task.fields.get("unit", "steps")
        done = human_count(task.completed, unit)
        if task.total is None:  # nothing to count: the elapsed time says it is alive
            return Text(done if task.completed else f"{_seconds(task.elapsed or 0)} elapsed")
        if unit == "bytes":
            return Text(f"{done}/{human_count(task.total, unit)}")
        return Text(f"{task.completed:,.0f}/{task.total:,.0f} {unit}")


class _RateColumn(ProgressColumn):
    """Throughput in the task's unit."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        if not speed:
            return Text("")
        unit = task.fields.get("unit", "steps")  # the count beside it names other units: ``3.1/s`` keeps 80 columns
        return Text(f"{human_count(speed, unit)}/s" if unit == "bytes" else f"{speed:,.1f}/s")


class RichReporter(Reporter):
    """One rich progress display; each stage is a task that stays listed once done."""

    def __init__(self, console: Console):
        fixed = dict(no_wrap=True, overflow="ellipsis")
        self.progress = Progress(TextColumn("{task.description}", table_column=Column(**fixed)),
                                 BarColumn(bar_width=20), _CountColumn(table_column=Column(**fixed)),
                                 _RateColumn(table_column=Column(**fixed)),
                                 # never cut to ``0:0…``: the note, last, gives up its width first
                                 TimeRemainingColumn(table_column=Column(no_wrap=True, min_width=7)),
                                 TextColumn("{task.fields[note]}", table_column=Column(ratio=1, **fixed)),
                                 console=console, transient=False, expand=True)
        self._tasks: dict[int, int] = {}
        self._running = False

    def started(self, st: Stage) -> None:
        if not self._running:
            self.progress.start()
            self._running = True
        self._tasks[id(st)] = self.progress.add_task(escape(st.name), total=st.total, unit=st.unit,
                                                     note=escape(st.note))

    def changed(self, st: Stage) -> None:
        task = self._tasks.get(id(st))
        if task is not None:
            self.progress.update(task, completed=st.completed, total=st.total, note=escape(st.note))

    def finished(self, st: Stage) -> None:
        task = self._tasks.pop(id(st), None)
        if task is not None and st.stopped:  # Ctrl-C, an error: the bar stays where the stage stopped
            self.progress.update(task, completed=st.completed, note=escape(st.note or "stopped"))
            self.progress.stop_task(task)
        elif task is not None:  # an unknown total becomes what was done, so the bar ends full
            total = st.total if st.total else max(st.completed, 1)
            self.progress.update(task, completed=total if st.completed == 0 else st.completed, total=total,
                                 note=escape(st.note))
        if not self._tasks:  # nothing runs: stop the live display so results print below it, not inside
            self.close()

    def close(self) -> None:
        if self._running:
            self.progress.stop()  # the finished bars stay on screen; the next stage starts a new display
            self._running = False
            for task in list(self.progress.task_ids):
                self.progress.remove_task(task)
