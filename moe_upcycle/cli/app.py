"""The Typer app and what every command shares: consoles, -q/--version/--debug, progress and error handling.

Commands live in `commands` and `prompt_commands`; they register themselves on `app`. Caught, printed
and exit code 1: `UpcycleError`; a symlink loop in a path the user gave, or one they may not read or change; a failed write to standard
output (``> /dev/full``; a closed pipe is rich's to end, also with 1). Any other exception is a bug and
keeps its traceback.
"""

from __future__ import annotations

import contextlib
import functools
import shlex
import sys
import warnings
from typing import Callable, Iterator, Optional

import typer
from rich.console import Console
from typer.core import TyperGroup

from moe_upcycle.terminal.markup import escape
from moe_upcycle.cli.mergekit_flags import explain, translate
from moe_upcycle.cli.out_of_memory import out_of_memory
from moe_upcycle.checkpoint.output_dir import forget_published, previous_kept, published
from moe_upcycle.distributed.world import World, alone, joined_world, torchrun_follower
from moe_upcycle.errors import UpcycleError, UpcycleWarning
from moe_upcycle.inputs.paths import denied, symlink_loop
from moe_upcycle.terminal import import_gc
from moe_upcycle.terminal.allocator import return_large_frees
from moe_upcycle.terminal.progress import for_console, reporting
from moe_upcycle.terminal.quiet import libraries_quiet
from moe_upcycle.terminal.signals import exit_code, signal_name, terminations_raise

console = Console(stderr=True)


class _Commands(TyperGroup):
    """The command group: mergekit-moe options copied into a build or plan command line are explained (what
    moe-upcycle does instead, and the command to run) before the parser would answer "No such option"."""

    def resolve_command(self, ctx, args):
        ARGS["command"] = list(args)  # the command's own arguments, to run it again (`command_line`)
        first = args[0] if args else ""
        if self.get_command(ctx, first) is None and first.lower().endswith((".yaml", ".yml")):
            # mergekit-moe's form, `mergekit-moe config.yml OUT [options]`: the recipe where the command goes
            found, said, run = translate("build", list(args))
            flags = f" ({'; '.join(said)})" if found else ""
            console.print(f"[bold red]config error:[/] {escape(first)} is a recipe, not a command; build from it "
                          f"with: {escape(run)}{escape(flags)} (or plan it first: moe-upcycle plan "
                          f"{escape(shlex.quote(first))})", highlight=False, soft_wrap=True)
            raise typer.Exit(1)
        name, command, rest = super().resolve_command(ctx, args)
        message = explain(name or "", list(rest))
        if message:
            console.print(f"[bold red]config error:[/] {escape(message)}", highlight=False, soft_wrap=True)
            raise typer.Exit(1)
        return name, command, rest


app = typer.Typer(cls=_Commands, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Turn dense decoder LLM checkpoints into Mixture-of-Experts checkpoints.")
out = Console()
DEBUG = {"on": False}
ARGS: dict[str, list[str]] = {"command": []}  # the running command's name and arguments
QUIET = {"on": False}
VERBOSE = {"on": False}
DEVICE_HELP = "Where the models run: auto (a GPU when torch sees one, else cpu), cpu, cuda or cuda:N."


def _version(value: bool) -> None:
    if value:
        from moe_upcycle import __version__

        typer.echo(f"moe-upcycle {__version__}")
        raise typer.Exit()


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks for errors."),
          quiet: bool = typer.Option(False, "-q", "--quiet", help="No progress display and no notes on stderr; "
                                                                   "results, warnings and errors only."),
          verbose: bool = typer.Option(False, "-v", "--verbose", help="Full reports where a command prints a "
                                                                      "summary line (build: the duplicate-tensor report)."),
          version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    DEBUG["on"] = debug
    QUIET["on"] = quiet
    VERBOSE["on"] = verbose
    return_large_frees()  # big freed tensors go back to the OS: memory is what `plan` predicts


def command_line() -> list[str]:
    """The arguments of the running command (global options first), as ``moe-upcycle`` was given them: to run the
    same command in other processes (``build --workers``)."""
    return [*(["--debug"] if DEBUG["on"] else []), *(["-q"] if QUIET["on"] else []),
            *(["-v"] if VERBOSE["on"] else []), *ARGS["command"]]


def note(text: str) -> None:
    """An informational line on stderr (left out with -q)."""
    if not QUIET["on"]:
        console.print(text, highlight=False, soft_wrap=True)


def cli_errors(fn: Callable) -> Callable:
    """Print UpcycleError (every problem) and exit 1; Ctrl-C, SIGTERM, SIGHUP exit 128+signal after cleanup."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        forget_published()
        # torch (and numpy) load before the command's own signal handling: a signal raised as an exception inside
        # their C imports was caught there ("cannot load module more than once") or lost (the build ran on). Under
        # start-up's handling (`signals.quiet_startup`) it ends the process at once, as nothing is written yet.
        try:
            import torch  # noqa: F401
        except (MemoryError, ImportError, OSError, SystemError) as exc:  # `ulimit -v`: torch could not be mapped
            message = _torch_not_loaded(exc)
            if message is None or DEBUG["on"]:
                raise
            with contextlib.suppress(OSError, MemoryError):  # plain text: rich imports more to render markup
                sys.stderr.write(f"error: {message}\n")
                sys.stderr.flush()
            raise typer.Exit(1) from None
        import_gc.resume()  # start-up's objects (torch's above all) frozen, the collector back on
        # the world is left after the message (torchrun then stops the other ranks); inside it, a rank's warnings
        # go to the lead, which prints them
        with _warnings_printed(), _command_world(fn.__name__) as world:
            return _run(fn, world, *args, **kwargs)

    return wrapper


def _run(fn: Callable, world: World, *args, **kwargs):
    """Run the command `fn`; say what stopped it and exit 1 or 128 + signal.

    On the other ranks of a distributed build nothing is printed (`_said_by`): the lead says their failures too.
    """
    try:
        with (_said_by(world), terminations_raise(sigint=True), libraries_quiet(),
              reporting(for_console(console, QUIET["on"] or not world.lead)),  # SIGTERM/SIGHUP: as Ctrl-C
              world.failing_together(not_failures=(typer.Exit,))):  # one rank's failure stops every rank
            return fn(*args, **kwargs)
    except UpcycleError as exc:
        if DEBUG["on"]:
            raise
        if not getattr(exc, "said_by_launcher", False):  # a killed rank: `build --workers` names it and its signal
            with contextlib.nullcontext() if getattr(exc, "said_here", False) else _said_by(world):  # a lead gone
                _print_error(exc)
        raise typer.Exit(1)
    except (RuntimeError, OSError, MemoryError, ImportError) as exc:  # torch.OutOfMemoryError: a RuntimeError
        message = out_of_memory(exc, fn.__name__, kwargs)
        if message is not None and not DEBUG["on"]:  # the model, batch or machine too small: not a bug
            said = "; nothing was written under the output name" if fn.__name__ in _WRITERS else ""
            with contextlib.suppress(OSError), _said_by(world):
                console.print(f"[bold red]error:[/] {escape(message)}{said}", highlight=False, soft_wrap=True)
            raise typer.Exit(1)
        stream = _failed_console(exc) if isinstance(exc, OSError) and not DEBUG["on"] else None
        if stream is not None:  # results on a full disk (`> /dev/full`): the stream, not a bug
            if stream is out:
                done = published()  # the output is complete: only the report of it is lost
                built = f" ({escape(str(done))} was built and is complete)" if done is not None else ""
                with contextlib.suppress(OSError):
                    console.print(f"[bold red]error:[/] writing the results to standard output failed "
                                  f"({escape(exc.strerror or str(exc))}){built}; send them to a file on a disk "
                                  f"with room, or to a terminal", highlight=False, soft_wrap=True)
            raise typer.Exit(1)  # stderr failed: nowhere left to say it
        # Path.resolve() on a looping link, a name too long, a path the user may not read: theirs, not a bug
        message = symlink_loop(exc) or denied(exc)
        if message is None or DEBUG["on"]:
            raise
        with _said_by(world):
            console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    except KeyboardInterrupt as exc:  # a signal held off while publishing is raised after it: then say so
        done, kept = published(), previous_kept()
        said = (f" after {escape(str(done))} was complete and in place" if done is not None else
                f": nothing was written under the output name; the previous {escape(str(kept))} is untouched"
                if kept is not None else
                ": nothing was written under the output name" if fn.__name__ in _WRITERS else "")
        with contextlib.suppress(OSError), _said_by(world):  # after SIGHUP the terminal may be gone
            console.print(f"[bold red]interrupted ({signal_name(exc)}{escape(getattr(exc, 'where', ''))})[/]{said}",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(exit_code(exc))


def _print_error(exc: UpcycleError) -> None:
    kind = type(exc).__name__.replace("Error", " error").lower()
    for problem in exc.problems:
        console.print(f"[bold red]{kind}:[/] {escape(problem)}", highlight=False, soft_wrap=True)


@contextlib.contextmanager
def _command_world(command: str) -> Iterator[World]:
    """The ranks of a distributed build (`build` under torchrun joins them for the whole command, so the lead
    leaves the job only after its message); a process alone for every other command, which under torchrun runs
    once, on rank 0: the other ranks end at once, with nothing said (N copies of a report, N demos or `prompts
    grow` writing one file, helped no one)."""
    if command not in _DISTRIBUTED:
        if torchrun_follower():
            raise typer.Exit(0)
        with alone() as world:  # `demo`'s build, `plan`'s dry run: this process's, not the job's
            yield world
        return
    with contextlib.ExitStack() as stack:
        try:
            world = stack.enter_context(joined_world())
        except UpcycleError as exc:  # this process cannot join the job (WORLD_SIZE without torchrun's other variables)
            if DEBUG["on"]:
                raise
            _print_error(exc)
            raise typer.Exit(1)
        yield world


@contextlib.contextmanager
def _said_by(world: World) -> Iterator[None]:
    """Nothing is printed in the block on a rank other than the lead (it says what every rank did)."""
    if world.lead:
        yield
        return
    before = console.quiet, out.quiet
    console.quiet = out.quiet = True
    try:
        yield
    finally:
        console.quiet, out.quiet = before


def _torch_not_loaded(exc: BaseException) -> Optional[str]:
    """The message for torch failing to import for want of memory (`ulimit -v`, a small container), else None.
    Out of memory, the interpreter itself may fail an import with a SystemError ("returned NULL without setting
    an exception", "error return without exception set"); any other SystemError (a broken install) is a bug's
    traceback, as before."""
    message = out_of_memory(exc, "import", {})
    if message is None and isinstance(exc, SystemError) and any(
            words in str(exc) for words in ("without setting an exception", "error return without exception set")):
        message = (f"torch could not be loaded ({type(exc).__name__}: {exc}), as happens when memory is limited "
                   f"(ulimit -v, a container); free memory or raise the limit, and run it again")
    return message


# the commands that write an output (staged, then renamed into place): an interrupt leaves nothing under its name
_WRITERS = frozenset({"build", "demo", "grow"})
_DISTRIBUTED = frozenset({"build"})  # run by every rank of a torchrun job as one build


def _failed_console(exc: OSError):
    """`out` or `console` when `exc` was raised writing to that stream (rich ends a broken pipe itself, with
    exit 1, as Python's documentation advises); None when it came from anywhere else."""
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is out or owner is console:
            return owner
        tb = tb.tb_next
    return None


@contextlib.contextmanager
def _warnings_printed() -> Iterator[None]:
    """Print every UpcycleWarning as ``warning: ...`` (each one, not just the first per line of code)."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", UpcycleWarning)
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, UpcycleWarning):
                console.print(f"[bold yellow]warning:[/] {escape(str(message))}", highlight=False, soft_wrap=True)
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield
