"""The app: one Typer application, its error mapping (every failure a user can cause is one line on stderr and a
non-zero exit, never a traceback), --help at 80 columns, and the --version and --verbose callback."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import signal
import sys
import threading
import typing

import typer
from rich.console import Console
from rich.logging import RichHandler

from gpt2onnx.cli.flags import VerboseOpt, VersionOpt, library_defaults
from gpt2onnx.errors import BadInput, Gpt2OnnxError, shown
from gpt2onnx.files import write_json_atomic

INTERNAL_ERROR = 70  # a bug of ours, not the user's: still one line, and the traceback with --verbose

# no markup, no emoji codes: names and messages from the user print as they are (a file 'x:b:y.txt' stays that)
console = Console(markup=False, emoji=False)
err_console = Console(stderr=True, markup=False, emoji=False)


# --help at 80 columns: a short metavar per value type (typer shows "<list[str]>", "<int>"), none for flags
_METAVARS = {int: "N", float: "X"}


def _short_metavars(command, ctx) -> None:
    help_option = command.get_help_option(ctx)
    if help_option is not None and help_option.metavar is None:
        help_option.metavar = ""
    for param in command.params:
        if isinstance(param, typer.core.TyperArgument) and param.type_descriptor.is_list:
            param.display_type_rich = lambda ctx: "PATH..."  # typer shows "<list[Path]>" and ignores metavar
        if not isinstance(param, typer.core.TyperOption) or param.metavar is not None:
            continue
        descriptor = param.type_descriptor
        if param.is_flag:
            param.metavar = ""
        elif descriptor.is_path:
            param.metavar = "PATH"
        else:
            element = (typing.get_args(descriptor.annotation) or (descriptor.annotation,))[0]
            param.metavar = _METAVARS.get(element, "TEXT")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, so that it unwinds as Ctrl-C does (staging folders removed, locks
    released, nothing half-written); exit code 143."""

    signum = signal.SIGTERM


_terminated = False  # SIGTERM arrived (typer turns the exception into exit code 130, as for Ctrl-C: told apart here)


def _terminate(signum, frame) -> None:
    global _terminated
    _terminated = True
    raise Terminated()


class ShortHelp(typer.core.TyperGroup):
    """A group whose --help, and its commands', reads at 80 columns (short metavars)."""

    def format_help(self, ctx, formatter):
        _short_metavars(self, ctx)
        return super().format_help(ctx, formatter)

    def get_command(self, ctx, cmd_name):
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _short_metavars(command, ctx)
            _defaults_epilog(command)
        return command


def _defaults_epilog(command) -> None:
    """Under the --help of a command whose workload sizes default to the library's (gpt2onnx.cli.flags'
    defaults_from), those defaults: 'This command's defaults: --warmup 3, --repeat 20.'"""
    if command.epilog is None and getattr(command.callback, "defaults_from", None):
        left = [(p.name, p.opts[0]) for p in command.params if p.default is None]
        shown = ", ".join(f"{flag} {value}" for flag, value in library_defaults(command.callback, left))
        command.epilog = f"This command's defaults: {shown}." if shown else ""


class DefaultedGroup(ShortHelp):
    """A command with subcommands, one of them the default: ``gpt2onnx bench FOLDER`` runs ``bench run FOLDER``
    (a first word that names no subcommand, or none, goes to the default; a folder named like a subcommand is
    given as ./NAME)."""

    default = "run"

    def parse_args(self, ctx, args):
        if not args or (args[0] not in self.commands and args[0] not in ctx.help_option_names):
            args = [self.default, *args]
        return super().parse_args(ctx, args)


class OneLineErrors(ShortHelp):
    """Every failure the user can cause ends as one line on stderr and a non-zero exit, never a traceback."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:  # callers who handle errors themselves
            _refuse_underscored_numbers(args[0] if args else kwargs.get("args"))
            return super().main(*args, standalone_mode=False, **kwargs)
        interrupts = signal.getsignal(signal.SIGINT) if _in_main_thread() else None
        terminations = signal.signal(signal.SIGTERM, _terminate) if _in_main_thread() else None
        try:
            _refuse_underscored_numbers(args[0] if args else kwargs.get("args"))
            rv = super().main(*args, standalone_mode=False, **kwargs)
            if _terminated:
                raise Terminated()
            if rv == 130:  # typer ends a KeyboardInterrupt as exit code 130, silently: say it as the rest do
                raise KeyboardInterrupt()
            sys.stdout.flush()  # a full or closed stdout fails here, not at exit
        except typer.TyperException as err:  # usage errors: bad option values, missing options
            _fail(f"{err.format_message()} (see --help)", err.exit_code)
        except typer.Abort:
            _fail("aborted", 1, prefix="")
        except Gpt2OnnxError as err:
            _fail(str(err), err.exit_code)
        except Terminated:
            _fail("terminated", 143, prefix="")
        except KeyboardInterrupt:
            _fail("interrupted", 130, prefix="")
        except OSError as err:
            if err.errno in _NOT_PERMITTED and err.filename is not None:  # a path this user may not use
                _fail(_not_permitted(err), 4 if err.errno == errno.EROFS else BadInput.exit_code)
            if err.errno not in (errno.ENOSPC, errno.EPIPE, errno.EIO, errno.EDQUOT):
                _internal_error(err)
            with contextlib.suppress(OSError):  # what is still buffered goes nowhere, quietly, at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            if err.filename is not None:  # a file, not stdout: name it
                _fail(f"cannot write '{err.filename}' ({os.strerror(err.errno)}): free space, or write elsewhere", 4)
            _fail(f"cannot write the output to stdout ({os.strerror(err.errno)}): free space, or send it elsewhere", 4)
        except MemoryError:
            _fail("out of memory: use a smaller model, batch or length", 4)
        except Exception as err:  # a bug: one line for the user, the traceback in the log with --verbose
            _internal_error(err)
        finally:
            if interrupts is not None and not _as_process and signal.getsignal(signal.SIGINT) is not interrupts:
                signal.signal(signal.SIGINT, interrupts)  # a caller's own (the test runner's), as it was
            if terminations is not None and not _as_process:
                signal.signal(signal.SIGTERM, terminations)
        sys.exit(rv if isinstance(rv, int) else 0)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


_written = False  # a command of this process wrote its --json file: Ctrl-C stays ignored until it exits
_as_process = False  # the app runs as the gpt2onnx process (_Process), not inside a caller's


def ignore_interrupts() -> None:
    """A command starts writing its --json (and --plot) file, its last work: from here on Ctrl-C and SIGTERM are
    ignored until the process exits, so that an interrupted command (exit code 130, 143) has written nothing and a
    finished one the whole file (atomically)."""
    global _written
    if _in_main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _written = True


def write_json_output(path, data) -> None:
    """A command's --json file, written as its last work (see ignore_interrupts)."""
    ignore_interrupts()
    write_json_atomic(path, data)


class _Process(typer.Typer):
    """The app as the gpt2onnx process runs it (python -m gpt2onnx, the console script; Typer's test runner calls
    the command group instead): once the command has ended, a Ctrl-C while the interpreter shuts down (a second
    or so, unloading onnxruntime and torch) ends the process at once, as the signal, instead of printing Python's
    'Exception ignored ... KeyboardInterrupt' traceback after the one line; ignored where a --json file was
    written."""

    def __call__(self, *args, **kwargs):
        global _as_process
        _as_process = True
        try:
            return super().__call__(*args, **kwargs)
        finally:
            if _in_main_thread():
                if not _written:
                    signal.signal(signal.SIGINT, signal.SIG_DFL)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)


_NOT_PERMITTED = (errno.EACCES, errno.EPERM, errno.EROFS)


def _not_permitted(err: OSError) -> str:
    """One line for a path the user running gpt2onnx may not read, search or write (a folder of another user's,
    a read-only file system), wherever the library first touched it: a model folder under a private folder is
    refused like any input, not as an internal error."""
    return (
        f"cannot use {shown(err.filename)} ({os.strerror(err.errno)}): check the permissions of it and of the"
        " folders above it, or give a path this user may use"
    )


def _fail(message: str, code: int, *, prefix: str = "error: ") -> None:
    err_console.print(prefix + message, markup=False, highlight=False, soft_wrap=True)
    sys.exit(code)


def _internal_error(err: BaseException) -> None:
    logging.getLogger("gpt2onnx").debug("internal error", exc_info=err)
    text = str(err).splitlines()[0][:200] if str(err).strip() else ""
    _fail(
        f"internal error ({type(err).__name__}: {text}); please report it with the command you ran (--verbose shows"
        " the traceback)",
        INTERNAL_ERROR,
    )


_UNDERSCORED_NUMBER = re.compile(r"[+-]?[0-9][0-9_]*_[0-9_]*(?:\.[0-9_]*)?(?:[eE][+-]?[0-9_]+)?")
# free text, paths and names, or values parsed by their own parser: never read by int() or float()
_TEXT_OPTIONS = (
    "--prompt",
    "--ids",
    "--model",
    "--out",
    "--reference",
    "--revision",
    "--json",
    "--plot",
    "--trt-cache-dir",
    "--triton-name",
    "--server-name",
    "--server-image",
    "--target",
    "--device",
)


def _refuse_underscored_numbers(args) -> None:
    """Python's int() and float(), which parse option values, read '1_0' as 10: refuse it as a typo."""
    args = list(sys.argv[1:] if args is None else args)
    given = [(before.split("=")[0], value) for before, value in zip(args, args[1:])]  # --flag value
    given += [(flag, value) for flag, _, value in (arg.partition("=") for arg in args)]  # --flag=value
    for flag, value in given:
        if flag.startswith("--") and flag not in _TEXT_OPTIONS and _UNDERSCORED_NUMBER.fullmatch(value):
            raise BadInput(f"{flag} '{value}' is not a number as written: give it without underscores")


app = _Process(
    cls=OneLineErrors,
    help="GPT-2 from a PyTorch checkpoint to a verified, fast ONNX decoder with past key/values.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def main(verbose: VerboseOpt = False, version: VersionOpt = None) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err_console, show_path=False)],
        force=True,
    )
    # their notices are not the tool's output; matplotlib's "building the font cache" on a brand-new machine would be
    # a second line before a one-line error
    for noisy in ("transformers", "huggingface_hub", "torch", "onnxruntime", "onnxscript", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
