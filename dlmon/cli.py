"""The ``dlmon`` command. Heavy modules are imported inside the commands so ``--help`` is fast."""

from __future__ import annotations

import json
import sys
import threading
from typing import TYPE_CHECKING, Any, NoReturn

import click

from dlmon import __version__

if TYPE_CHECKING:
    from dlmon.collect.sampler import Sampler
    from dlmon.model import Snapshot
    from dlmon.recording import RecordWriter

EXIT_USAGE = 2


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """One clear line on stderr and a non-zero exit: never a traceback for bad input."""
    click.echo(f"dlmon: error: {message}", err=True)
    sys.exit(code)


def parse_pid(text: str) -> int:
    try:
        pid = int(text, 10)
    except ValueError:
        fail(f"{text!r} is not a process id (a positive whole number)")
    if pid <= 0:
        fail(f"{text!r} is not a process id (a positive whole number)")
    return pid


def positive_seconds(text: str | float, what: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        fail(f"{what} must be a number of seconds, not {text!r}")
    if not value > 0 or value == float("inf"):
        fail(f"{what} must be more than 0 seconds, not {text!r}")
    return value


def open_sampler(pid: int, *, unlimited_smaps: bool = False) -> Sampler:
    from dlmon.collect.sampler import NoSuchProcess, Sampler

    try:
        return Sampler(pid, unlimited_smaps=unlimited_smaps)
    except NoSuchProcess:
        fail(f"no such process: {pid}")
    except PermissionError as exc:
        fail(f"cannot read process {pid}: {exc.strerror or exc}")


def open_record(path: str) -> RecordWriter:
    from dlmon.recording import RecordWriter

    try:
        return RecordWriter(path)
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror or exc}")


class _Group(click.Group):
    """Usage errors as one line (click prints four), and no traceback for a closed pipe."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        kwargs.setdefault("prog_name", "dlmon")
        try:
            result = super().main(*args, **kwargs)
        except click.UsageError as exc:
            hint = f" (see: {exc.ctx.command_path} --help)" if exc.ctx else ""
            fail(exc.format_message() + hint)
        except click.ClickException as exc:
            fail(exc.format_message(), exc.exit_code)
        except click.Abort:
            sys.exit(130)
        except BrokenPipeError:  # `dlmon record ... | head`: the reader left; that is fine
            sys.stderr.close()
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dlmon")
def main() -> None:
    """A live monitor for PyTorch training jobs: true memory (PSS/USS) per DataLoader worker,
    shared memory, IO, GPU, and what is wrong."""


INTERVAL_HELP = "Seconds between samples (default 1)."


@main.command()
@click.argument("pid")
@click.option("--interval", default="1", metavar="S", help=INTERVAL_HELP)
@click.option(
    "--record", "record_path", metavar="FILE", help="Also write every snapshot to FILE (JSON lines)."
)
@click.option("--once", is_flag=True, help="Take two samples ~1 s apart (so rates exist), print one, exit.")
@click.option("--json", "as_json", is_flag=True, help="Print snapshots as JSON.")
def attach(pid: str, interval: str, record_path: str | None, once: bool, as_json: bool) -> None:
    """Watch a running training process PID and all its descendants."""
    target = parse_pid(pid)
    seconds = positive_seconds(interval, "--interval")
    if once:
        _attach_once(target, as_json)
        return
    from dlmon.format import one_line
    from dlmon.loop import sample_until_done, stop_on_signals
    from dlmon.recording import encode_snapshot

    writer = open_record(record_path) if record_path else None
    sampler = open_sampler(target)

    def show(snapshot: Snapshot) -> None:
        if writer is not None:
            writer.write(snapshot)
        if as_json:
            sys.stdout.write(encode_snapshot(snapshot).decode())
        else:
            sys.stdout.write(one_line(snapshot) + "\n")
        sys.stdout.flush()

    stop = threading.Event()
    with stop_on_signals(stop):
        reason = sample_until_done(sampler, seconds, show, stop)
    if writer is not None:
        writer.end(reason)
        writer.close()
    sampler.close()


def _attach_once(pid: int, as_json: bool) -> None:
    import time

    from dlmon.format import one_line
    from dlmon.model.serialize import snapshot_to_dict

    sampler = open_sampler(pid, unlimited_smaps=True)
    sampler.sample()
    time.sleep(1.0)
    snapshot = sampler.sample()
    sampler.close()
    if as_json:
        click.echo(json.dumps(snapshot_to_dict(snapshot), indent=2, allow_nan=False))
    else:
        click.echo(one_line(snapshot))


@main.command()
@click.argument("pid")
@click.option("-o", "--output", "output", required=True, metavar="FILE", help="JSON-lines file to append to.")
@click.option("--interval", default="1", metavar="S", help=INTERVAL_HELP)
@click.option(
    "--duration", default=None, metavar="S", help="Stop after S seconds (default: until the target exits)."
)
def record(pid: str, output: str, interval: str, duration: str | None) -> None:
    """Record snapshots of PID to FILE without a dashboard, one JSON object per line."""
    target = parse_pid(pid)
    seconds = positive_seconds(interval, "--interval")
    limit = positive_seconds(duration, "--duration") if duration is not None else None
    from dlmon.loop import sample_until_done, stop_on_signals

    sampler = open_sampler(target)
    writer = open_record(output)
    stop = threading.Event()
    with stop_on_signals(stop):
        reason = sample_until_done(sampler, seconds, writer.write, stop, duration=limit)
        writer.end(reason)
    writer.close()
    sampler.close()
    click.echo(f"dlmon: recorded to {output} ({reason.replace('_', ' ')})", err=True)
