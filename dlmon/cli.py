"""The ``dlmon`` command. Heavy modules are imported inside the commands so ``--help`` is fast."""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import click

from dlmon import __version__

if TYPE_CHECKING:
    from dlmon.flow.sources import Source
    from dlmon.flow.watch import Plug, Watch
    from dlmon.launch.runner import Training
    from dlmon.model import Snapshot
    from dlmon.ui.result import DashboardResult

EXIT_USAGE = 2
EXIT_FAILURE = 1
MIN_INTERVAL_S = 0.1  # below this dlmon would burn a core sampling, and rates turn to noise
MAX_INTERVAL_S = 86400.0  # a day; far above, the wait between ticks overflows the clock (OverflowError)


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """One clear line on stderr and a non-zero exit: never a traceback for bad input."""
    click.echo(f"dlmon: error: {message}", err=True)
    sys.exit(code)


def parse_pid(text: str) -> int:
    try:
        if not text.strip().isascii():  # int() takes Arabic-Indic and other Unicode digits
            raise ValueError(text)
        pid = int(text, 10)
    except ValueError:
        fail(f"{text!r} is not a process id (a positive whole number)")
    if pid <= 0:
        fail(f"{text!r} is not a process id (a positive whole number)")
    from dlmon.collect.procfs import thread_group_of  # here: `dlmon --help` loads no collector

    leader = thread_group_of(pid)
    if leader is not None and leader != pid:
        fail(f"{pid} is a thread of process {leader}, not a process: watch {leader} instead")
    return pid


def interval_seconds(text: str) -> float:
    """``--interval``: a number of seconds, from MIN_INTERVAL_S to MAX_INTERVAL_S."""
    seconds = positive_seconds(text, "--interval")
    if seconds < MIN_INTERVAL_S:
        fail(f"--interval must be at least {MIN_INTERVAL_S} seconds, not {text!r}")
    if seconds > MAX_INTERVAL_S:
        fail(f"--interval must be at most {MAX_INTERVAL_S:.0f} seconds (a day), not {text!r}")
    return seconds


def positive_seconds(text: str | float, what: str, *, allow_zero: bool = False) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        fail(f"{what} must be a number of seconds, not {text!r}")
    if math.isnan(value) or math.isinf(value):
        fail(f"{what} must be a finite number of seconds, not {text!r}")
    if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
        lowest = "0 or more" if allow_zero else "more than 0"
        fail(f"{what} must be {lowest} seconds, not {text!r}")
    return value


def terminal_problem() -> str | None:
    """Why the dashboard cannot run here, else None (see dlmon.launch.console)."""
    from dlmon.launch.console import terminal_problem

    return terminal_problem()


def call(body: Callable[..., int | None], *args: Any, **kwargs: Any) -> NoReturn:
    """Run a command's body (in dlmon/launch); its Failed is one line and its exit code."""
    from dlmon.launch.console import Failed

    try:
        code = body(*args, **kwargs)
    except Failed as exc:
        fail(exc.message, exc.code)
    sys.exit(code or 0)


def check_record(path: str, force: bool = False) -> None:
    """Fail early on a record path that cannot be written, without truncating what is there, or
    that is a symlink or another file than a record (unless ``force``)."""
    from dlmon.flow.recording import RecordPathRefused, check_record_path

    try:
        check_record_path(path, force)
    except RecordPathRefused as exc:
        fail(str(exc.strerror))
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror or exc}")


def prometheus_plug(address: str | None, pid_labels: bool = False) -> Plug | None:
    """--prometheus: a plug that, when the watch starts it, serves /metrics and returns the
    exporter, a sink fed each analysed snapshot."""
    if address is None:  # "" is given, and refused by parse_address like any other non-address
        return None

    def start() -> Callable[[Snapshot], None]:
        from dlmon.export.prometheus import AddressError, Exporter, parse_address, serve, start_line

        try:
            where = parse_address(address)
        except AddressError as exc:
            fail(str(exc))
        exporter = Exporter(pid_labels=pid_labels)
        try:
            server = serve(exporter, where)
        except OSError as exc:
            fail(f"cannot serve Prometheus metrics on {address}: {exc.strerror or exc}")
        click.echo(start_line(server), err=True)
        return exporter

    return start


def plugs(prometheus: str | None) -> tuple[Plug, ...]:
    context = click.get_current_context(silent=True)
    pid_labels = bool(context is not None and context.meta.get(PIDS_META))
    plug = prometheus_plug(prometheus, pid_labels)
    return () if plug is None else (plug,)


def _silence_stdout() -> None:
    """After a failed write to stdout, drop what is still buffered so exit does not retry it."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


class _Group(click.Group):
    """Usage errors as one line (click prints four), and no traceback for a closed pipe."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        kwargs.setdefault("prog_name", "dlmon")
        from dlmon.launch.limits import raise_open_files_limit

        raise_open_files_limit()
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
            _silence_stdout()
            sys.stderr.close()
            sys.exit(1)
        except OSError as exc:  # the output on a full disk (ENOSPC), EIO: one line, no traceback
            _silence_stdout()
            where = f" ({exc.filename})" if exc.filename else ""
            fail(f"cannot write the output{where}: {exc.strerror or exc}", EXIT_FAILURE)
        sys.exit(result if isinstance(result, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dlmon")
def main() -> None:
    """A live monitor for PyTorch training jobs: true memory (PSS/USS) per DataLoader worker,
    shared memory, IO, GPU, and what is wrong."""


INTERVAL_HELP = "Seconds between samples (default 1)."
FORCE_HELP = "Write the record through a symlink, or over a file that is not a dlmon record."
PROMETHEUS_HELP = (
    "Also serve the latest snapshot as Prometheus metrics on [HOST:]PORT/metrics (HOST: 127.0.0.1 "
    "unless given; PORT 0: any free port, printed)."
)

PIDS_META = "dlmon.prometheus_pids"


def _remember_pids(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    ctx.meta[PIDS_META] = value


# every command with --prometheus takes it; read by plugs(), so no command body passes it along
prometheus_pids_option = click.option(
    "--prometheus-pids",
    is_flag=True,
    expose_value=False,
    callback=_remember_pids,
    help="Label the trainer's and other processes' series with their pid (off: across a fleet, "
    "every restart would add series; a worker is keyed by loader and worker_id either way).",
)

INJECT_FIRST_HELP = (
    "Load the agent into PID first (gdb on Python 3.9-3.13, sys.remote_exec on 3.14+); "
    "if it cannot, one line says why and the watch goes on with the outside figures."
)
RANK_HELP = (
    "Show only rank N of a distributed job (torchrun, SLURM: RANK as the agent read it) and what "
    "belongs to no rank."
)
rank_option = click.option("--rank", "rank", type=click.IntRange(0), metavar="N", help=RANK_HELP)


@main.command()
@click.argument("pid")
@click.option("--interval", default="1", metavar="S", help=INTERVAL_HELP)
@click.option(
    "--record", "record_path", metavar="FILE", help="Also write every snapshot to FILE (JSON lines)."
)
@click.option("--once", is_flag=True, help="Take two samples ~1 s apart (so rates exist), print one, exit.")
@click.option("--json", "as_json", is_flag=True, help="Print snapshots as JSON.")
@click.option(
    "--inject/--no-inject",
    default=None,
    help="Load the agent into PID first (gdb on Python 3.9-3.13, sys.remote_exec on 3.14+; if it "
    "cannot, one line says why and the watch goes on); --no-inject: never offer it. "
    "Default: the dashboard of a job without the agent offers it (press i).",
)
@click.option("--prometheus", metavar="[HOST:]PORT", help=PROMETHEUS_HELP)
@prometheus_pids_option
@click.option("--force", is_flag=True, help=FORCE_HELP)
@rank_option
def attach(
    pid: str,
    interval: str,
    record_path: str | None,
    once: bool,
    as_json: bool,
    inject: bool | None,
    prometheus: str | None = None,
    force: bool = False,
    rank: int | None = None,
) -> None:
    """Watch a running training process PID and all its descendants."""
    target = parse_pid(pid)
    remind_unwatched(except_pid=target)
    seconds = interval_seconds(interval)
    if record_path:
        check_record(record_path, force)
    if prometheus is not None and once:
        fail("--prometheus serves a running watch; it cannot be combined with --once")
    from dlmon.launch.attach import attach as attach_body

    call(
        attach_body,
        target,
        seconds,
        record_path,
        once=once,
        as_json=as_json,
        inject=inject,
        plugs=plugs(prometheus),
        rank=rank,
        dashboard=dashboard,
    )


def dashboard(source: Source, **kw: Any) -> DashboardResult:
    """The dashboard (dlmon/ui), handed to the commands in dlmon/launch, which cannot import it.
    A live source gets the boot time (dlmon/ui reads no /proc file): the header's uptime for a
    snapshot without the target's start_unix_time."""
    from dlmon import ui
    from dlmon.collect.procfs import read_boot_time

    if source.live:
        kw.setdefault("boot_time", read_boot_time())
    return ui.run_dashboard(source, **kw)


@main.command()
@click.argument("pid")
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    metavar="FILE",
    help="JSON-lines file to write (replaced if it exists).",
)
@click.option("--interval", default="1", metavar="S", help=INTERVAL_HELP)
@click.option(
    "--duration", default=None, metavar="S", help="Stop after S seconds (default: until the target exits)."
)
@click.option("--force", is_flag=True, help=FORCE_HELP)
@click.option("--inject", is_flag=True, help=INJECT_FIRST_HELP)
def record(
    pid: str, output: str, interval: str, duration: str | None, force: bool = False, inject: bool = False
) -> None:
    """Record snapshots of PID to FILE without a dashboard, one JSON object per line."""
    target = parse_pid(pid)
    seconds = interval_seconds(interval)
    limit = positive_seconds(duration, "--duration") if duration is not None else None
    check_record(output, force)
    from dlmon.launch.attach import record as record_body

    call(record_body, target, output, seconds, limit, inject=inject)


class _RunCommand(click.Command):
    """Remembers whether ``--`` came right before the command: ``run -- CMD`` vs ``run SCRIPT``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["dlmon.raw_args"] = list(args)
        return super().parse_args(ctx, args)


def _is_command_mode(ctx: click.Context, command: tuple[str, ...]) -> bool:
    raw: list[str] = ctx.meta.get("dlmon.raw_args", [])
    tail_start = len(raw) - len(command)
    return tail_start > 0 and raw[tail_start - 1] == "--"


RUN_SETTINGS = {"ignore_unknown_options": True, "allow_interspersed_args": False}


@main.command(cls=_RunCommand, context_settings=RUN_SETTINGS)
@click.option("--interval", default="1", metavar="S", help=INTERVAL_HELP)
@click.option(
    "--record", "record_path", metavar="FILE", help="Also write every snapshot to FILE (JSON lines)."
)
@click.option("--headless", is_flag=True, help="No dashboard: the training's output passes through.")
@click.option("--prometheus", metavar="[HOST:]PORT", help=PROMETHEUS_HELP)
@prometheus_pids_option
@click.option("--force", is_flag=True, help=FORCE_HELP)
@rank_option
@click.argument(
    "command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="SCRIPT [ARGS]... | -- CMD [ARGS]..."
)
@click.pass_context
def run(
    ctx: click.Context,
    interval: str,
    record_path: str | None,
    headless: bool,
    command: tuple[str, ...],
    prometheus: str | None = None,
    force: bool = False,
    rank: int | None = None,
) -> None:
    """Run a training script (with this Python) or any command, with the in-process agent, and watch it.

    \b
      dlmon run train.py --epochs 3
      dlmon run -- torchrun --nproc_per_node 2 train.py
    """
    from dlmon.launch.runner import command_for

    seconds = interval_seconds(interval)
    remind_unwatched()
    is_command = _is_command_mode(ctx, command)
    if not is_command and not os.path.isfile(command[0]):
        fail(f"no such script: {command[0]} (to run a command, put it after --: dlmon run -- CMD)")
    if rank is not None and headless:
        fail("--rank filters the dashboard; with --headless there is none (the record keeps every rank)")
    _run_training(
        command_for(list(command), is_command),
        seconds,
        record_path,
        headless,
        prometheus,
        force=force,
        rank=rank,
    )


@main.command()
@click.option(
    "--scenario", type=click.Choice(["healthy", "leak", "io-bound", "slow-workers"]), default="healthy"
)
@click.option("--workers", default=4, type=click.IntRange(0, 256), help="DataLoader num_workers.")
@click.option("--batch-size", default=64, type=click.IntRange(1, 1 << 16))
@click.option(
    "--duration", default="0", metavar="S", help="Stop the demo after S seconds (0: run until stopped)."
)
@click.option("--interval", default="1", metavar="S", help=INTERVAL_HELP)
@click.option(
    "--record", "record_path", metavar="FILE", help="Also write every snapshot to FILE (JSON lines)."
)
@click.option("--headless", is_flag=True, help="No dashboard: the demo's output passes through.")
@click.option("--prometheus", metavar="[HOST:]PORT", help=PROMETHEUS_HELP)
@prometheus_pids_option
def demo(
    scenario: str,
    workers: int,
    batch_size: int,
    duration: str,
    interval: str,
    record_path: str | None,
    headless: bool,
    prometheus: str | None = None,
) -> None:
    """A synthetic training (small model, generated data, DataLoader workers) under dlmon run.

    \b
    Scenarios: healthy, leak (copy-on-read growth of a Python-object dataset, pytorch#13246),
    io-bound (reads that hit the disk), slow-workers (CPU-heavy transforms).
    """
    import importlib.util

    seconds = interval_seconds(interval)
    remind_unwatched()
    if importlib.util.find_spec("torch") is None:
        fail("dlmon demo needs PyTorch: pip install 'dlmon[demo]'")
    limit = positive_seconds(duration, "--duration", allow_zero=True)
    command = [sys.executable, "-m", "dlmon.demo", "--scenario", scenario, "--workers", str(workers)]
    command += ["--batch-size", str(batch_size), "--duration", str(limit)]
    _run_training(command, seconds, record_path, headless, prometheus, stop_by_default=True)


def _run_training(
    command: list[str],
    interval: float,
    record_path: str | None,
    headless: bool,
    prometheus: str | None = None,
    stop_by_default: bool = False,  # the demo: quitting ends the synthetic training unless told not to
    force: bool = False,  # --force: a record path through a symlink, or over a file that is no record
    rank: int | None = None,
) -> NoReturn:
    from dlmon.launch.run_watch import run_training

    if record_path:
        check_record(record_path, force)  # fail early, before the training starts, truncating nothing
    call(
        run_training,
        command,
        interval,
        record_path,
        headless,
        plugs(prometheus),
        dashboard,
        stop_by_default=stop_by_default,
        rank=rank,
    )


def _run_dashboard(
    training: Training,
    interval: float,
    record_path: str | None,
    watch: Watch | None = None,
    stop_by_default: bool = False,
    rank: int | None = None,
) -> int:
    """The dashboard on a launched training (dlmon.launch.run_watch.run_dashboard)."""
    from dlmon.flow.watch import Watch, WatchOptions
    from dlmon.launch.run_watch import run_dashboard

    if watch is None:
        watch = Watch(WatchOptions(interval, record_path))
    return run_dashboard(training, watch, dashboard, stop_by_default=stop_by_default, rank=rank)


def remind_unwatched(except_pid: int | None = None) -> None:
    from dlmon.launch.console import remind_unwatched

    remind_unwatched(except_pid)


@main.command()
@click.argument("pid")
@click.option("--seconds", default="5", metavar="S", help="How long to measure before advising (default 5).")
@click.option("--json", "as_json", is_flag=True, help="Print the advice as JSON.")
@click.option("--inject", is_flag=True, help=INJECT_FIRST_HELP)
def advise(pid: str, seconds: str, as_json: bool, inject: bool = False) -> None:
    """Measure PID for a few seconds and advise on num_workers, batch size and memory.

    Uses the seed's rule, peak ~ (num_workers + 1) x batch_size x memory per sample, fed with
    measured per-worker memory and the real (cgroup-aware) headroom.
    """
    from dlmon.launch.advise import advise_pid

    call(advise_pid, parse_pid(pid), positive_seconds(seconds, "--seconds"), as_json=as_json, inject=inject)


@main.command()
@click.argument("file")
@click.option(
    "--speed", default="1", metavar="X", help="Play X times faster than recorded (default 1; 0: all at once)."
)
@rank_option
def replay(file: str, speed: str, rank: int | None = None) -> None:
    """Play a record file (from record, attach --record or run --record) in the dashboard.

    It needs a terminal: without one (a pipe, cron, TERM=dumb) it checks the file, lists the
    lines it would skip, and exits 2.
    """
    from dlmon.flow.sources import scan_record
    from dlmon.flow.watch import Watch, WatchOptions
    from dlmon.launch.console import report_screenshots
    from dlmon.ui import run_dashboard

    factor = speed_factor(speed)
    try:
        source = Watch(WatchOptions()).replay_source(file, factor or None)  # verdicts of this dlmon
    except OSError as exc:
        fail(f"cannot read {file}: {exc.strerror or exc}")
    no_terminal = terminal_problem()
    # streamed: with a terminal only the lines before the first snapshot are read up front
    scan = scan_record(file) if no_terminal or source.first is None else None
    problems = scan.problems if scan is not None else tuple(source.problems)
    if source.first is None:
        why = f" (line {problems[0].line}: {problems[0].reason})" if problems else ""
        fail(f"{file} holds no snapshots{why}")
    for problem in problems[:5]:
        click.echo(f"dlmon: skipping line {problem.line} of {file}: {problem.reason}", err=True)
    skipped = scan.problem_count if scan is not None else len(problems)
    if skipped > 5:
        click.echo(f"dlmon: ... {skipped - 5} more lines of {file} skipped", err=True)
    if no_terminal:
        assert scan is not None
        fail(
            f"replay shows a dashboard and needs a terminal ({no_terminal}); {file} holds "
            f"{scan.snapshots} readable snapshots"
        )
    report_screenshots(run_dashboard(source, rank=rank))


def speed_factor(text: str) -> float:
    """``--speed``: how many times faster than recorded; 0 means all at once."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        fail(f"--speed must be a factor of 0 or more (1: the recorded pace, 0: all at once), not {text!r}")
    return value


# --- export, report, diff (dlmon/export) ---------------------------------------------------------


@main.command("export")
@click.argument("pid", required=False)
@click.option("--prometheus", metavar="[HOST:]PORT", required=True, help=PROMETHEUS_HELP)
@prometheus_pids_option
@click.option("--interval", default="1", metavar="S", help=INTERVAL_HELP)
@click.option("--all-jobs", is_flag=True, help="Every training job of this user (a `job` label each).")
@click.option("--inject", is_flag=True, help=INJECT_FIRST_HELP + " Not with --all-jobs.")
def export_command(
    pid: str | None, prometheus: str, interval: str, all_jobs: bool, inject: bool = False
) -> None:
    """Serve PID's snapshots (or, with --all-jobs, every job's) as Prometheus metrics, headless,
    until PID exits or Ctrl-C."""
    if all_jobs == (pid is not None):
        fail("give a PID or --all-jobs (one of the two)")
    if all_jobs and inject:
        fail("--inject loads the agent into one PID; it cannot be combined with --all-jobs")
    seconds = interval_seconds(interval)
    if pid is None:
        _export_all_jobs(prometheus, seconds)
        return
    target = parse_pid(pid)
    from dlmon.launch.export_watch import export

    call(export, target, seconds, plugs(prometheus), inject=inject)


def _export_all_jobs(prometheus: str, seconds: float) -> None:
    from dlmon.export.jobs import JobsExporter
    from dlmon.export.prometheus import AddressError, parse_address, serve, start_line
    from dlmon.flow.loop import stop_on_signals

    try:
        where = parse_address(prometheus)
    except AddressError as exc:
        fail(str(exc))
    context = click.get_current_context(silent=True)
    pid_labels = bool(context is not None and context.meta.get(PIDS_META))
    jobs = JobsExporter(
        seconds, report=lambda line: click.echo(f"dlmon: {line}", err=True), pid_labels=pid_labels
    )
    try:
        server = serve(jobs, where)
    except OSError as exc:
        fail(f"cannot serve Prometheus metrics on {prometheus}: {exc.strerror or exc}")
    click.echo(start_line(server) + " (every job of this user)", err=True)
    stop = threading.Event()
    with stop_on_signals(stop):
        jobs.run(stop)
    server.close()
    click.echo("dlmon: export stopped (interrupted)", err=True)


MAX_CLUSTER_TIMEOUT_S = 600
MAX_CLUSTER_WINDOW_S = 3600
MAX_CLUSTER_TREND_S = 7 * 24 * 3600  # a week, in trend.POINTS slots of 8.4 h


@main.command()
@click.argument("nodes", nargs=-1, metavar="[HOST:PORT]...")
@click.option("--hosts-file", metavar="FILE", help="Nodes to read, one HOST[:PORT] a line.")
@click.option(
    "--port",
    default=9108,
    type=click.IntRange(1, 65535),
    help="The port of a node named without one (default 9108).",
)
@click.option(
    "--prometheus",
    "prometheus_url",
    metavar="URL",
    help="Read the nodes from this Prometheus server's HTTP API instead of scraping them.",
)
@click.option("--job", metavar="NAME", help="With --prometheus: the scrape job of the training's nodes.")
@click.option(
    "--match", metavar="SELECTOR", help="With --prometheus: label matchers, e.g. '{cluster=\"a\"}'."
)
@click.option("--once", is_flag=True, help="Read the cluster once, print it, exit (1: no node answered).")
@click.option("--json", "as_json", is_flag=True, help="Print the view as one JSON object.")
@click.option(
    "--timeout", default="2", metavar="S", help="Seconds each node (or query) may take (default 2)."
)
@click.option(
    "--window",
    default="2",
    metavar="S",
    help="Average the per-interval figures over S seconds (several scrapes; avg_over_time). Default 2.",
)
@click.option(
    "--trend",
    default="300",
    metavar="S",
    help="Each node's batches/s and data wait over the last S seconds, as a sparkline (default 300).",
)
@click.option("--interval", default="2", metavar="S", help="Seconds between refreshes (default 2).")
def cluster(
    nodes: tuple[str, ...],
    hosts_file: str | None,
    port: int,
    prometheus_url: str | None,
    job: str | None,
    match: str | None,
    once: bool,
    as_json: bool,
    timeout: str,
    window: str,
    trend: str,
    interval: str,
) -> None:
    """Many nodes from one terminal: one row per node (its ranks under it), worst first, the
    cluster's straggler on top; from the nodes' `--prometheus` exporters or a Prometheus server.

    \b
      dlmon cluster node01:9108 node02:9108 --once --json
      dlmon cluster --hosts-file nodes.txt
      dlmon cluster                        # in a SLURM job: the nodes of SLURM_JOB_NODELIST
      dlmon cluster --prometheus http://prometheus:9090 --job training
    """
    from dlmon.cluster.command import ClusterFailed, ClusterOptions, run_cluster
    from dlmon.cluster.hosts import HostsError, resolve_nodes

    timeout_s = positive_seconds(timeout, "--timeout")
    window_s = positive_seconds(window, "--window", allow_zero=True)
    # beyond these a socket's timeout or a PromQL range overflows (a traceback), and the direct
    # form would scrape for ever
    if timeout_s > MAX_CLUSTER_TIMEOUT_S:
        fail(f"--timeout must be at most {MAX_CLUSTER_TIMEOUT_S} seconds, not {timeout!r}")
    if window_s > MAX_CLUSTER_WINDOW_S:
        fail(f"--window must be at most {MAX_CLUSTER_WINDOW_S} seconds, not {window!r}")
    trend_s = positive_seconds(trend, "--trend")
    if trend_s > MAX_CLUSTER_TREND_S:
        fail(f"--trend must be at most {MAX_CLUSTER_TREND_S} seconds, not {trend!r}")
    interval_s = interval_seconds(interval)
    addresses: tuple[str, ...] = ()
    if prometheus_url is not None:
        if nodes or hosts_file is not None:
            fail("give nodes to scrape or --prometheus URL, not both")
    else:
        if job is not None or match is not None:
            fail("--job and --match select series on a Prometheus server: give --prometheus URL")
        try:
            addresses = resolve_nodes(nodes, hosts_file, port, os.environ.get("SLURM_JOB_NODELIST"))
        except HostsError as exc:
            fail(str(exc))
    options = ClusterOptions(addresses, prometheus_url, job, match, timeout_s, window_s, trend_s)
    screen = None  # --json without --once: one JSON line every --interval
    if not once and not as_json:
        problem = terminal_problem()
        if problem is not None:
            fail(f"{problem}: the cluster screen needs one (or use --once, --json)")
        from dlmon.ui.cluster_screen import run_cluster_screen

        screen = run_cluster_screen
    try:
        code = run_cluster(options, once=once, as_json=as_json, interval_s=interval_s, screen=screen)
    except ClusterFailed as exc:
        fail(exc.message, exc.code)
    sys.exit(code)


def _summarize(path: str) -> Any:
    """A recording's summary; one line and exit 2 if it cannot be read or holds no snapshot."""
    from dlmon.flow.summary import summarize

    try:
        summary = summarize(path)
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror or exc}")
    for problem in summary.problems[:5]:
        click.echo(f"dlmon: skipping line {problem.line} of {path}: {problem.reason}", err=True)
    if summary.problems_total > 5:
        click.echo(f"dlmon: ... and {summary.problems_total - 5} more skipped lines in {path}", err=True)
    if not summary.snapshots:
        why = f" (line {summary.problems[0].line}: {summary.problems[0].reason})" if summary.problems else ""
        fail(f"{path} holds no snapshots{why}")
    return summary


@main.command()
@click.argument("file")
@click.option("--html", "html_path", metavar="OUT.html", help="Also write a self-contained HTML report.")
@click.option("--md", "as_markdown", is_flag=True, help="Print Markdown (for a PR comment) instead of text.")
@click.option("--no-charts", is_flag=True, help="Leave out the terminal charts.")
def report(file: str, html_path: str | None, as_markdown: bool, no_charts: bool) -> None:
    """Summarise a recording (.jsonl or .jsonl.gz): peaks, throughput, data-wait, deaths, alerts.

    Streams the file, so a day-long recording needs no more memory than a short one.
    """
    from dlmon.export.text import format_markdown, format_text

    summary = _summarize(file)
    if html_path:
        from dlmon.export.html import format_html

        try:
            with open(html_path, "w", encoding="utf-8") as fh:
                fh.write(format_html(summary))
        except OSError as exc:
            fail(f"cannot write {html_path}: {exc.strerror or exc}")
        click.echo(f"dlmon: HTML report written to {html_path}", err=True)
    if as_markdown:
        click.echo(format_markdown(summary), nl=False)
        return
    click.echo(format_text(summary), nl=False)
    if not no_charts:
        from dlmon.ui.report_charts import report_charts

        width = min(120, max(40, os.get_terminal_size().columns if sys.stdout.isatty() else 100))
        click.echo("\n" + report_charts(summary, width=width, colour=sys.stdout.isatty()))


@main.command()
@click.argument("before")
@click.argument("after")
@click.option(
    "--fail-on",
    "fail_on",
    multiple=True,
    metavar="SPEC",
    help="Exit 1 when a figure moves past a limit: memory+10%, throughput-5%, data-wait+5pp, "
    "worker-memory+20%, rss|anon|shm|vram+N%, alerts+0 (new alert kinds). Repeatable.",
)
def diff(before: str, after: str, fail_on: tuple[str, ...]) -> None:
    """Compare two recordings (BEFORE and AFTER a change): throughput, data-wait, peak memory per
    process, alerts; a verdict, and exit 1 when a --fail-on limit is exceeded."""
    from dlmon.export.diff import SpecError, compare, format_diff, parse_limit

    limits = []
    for spec in fail_on:
        try:
            limits.append(parse_limit(spec))
        except SpecError as exc:
            fail(str(exc))
    a, b = _summarize(before), _summarize(after)
    result = compare(a, b, limits)
    click.echo(format_diff(a, b, result), nl=False)
    sys.exit(1 if result.verdict == "FAIL" else 0)


TUNE_SETTINGS = {"ignore_unknown_options": True, "allow_interspersed_args": False}


@main.command(context_settings=TUNE_SETTINGS)
@click.option(
    "--workers",
    "workers_text",
    metavar="LIST",
    help="num_workers to try, e.g. 0,2,4,8 (default: 0 up to the usable cores).",
)
@click.option(
    "--batch-sizes",
    "batches_text",
    metavar="LIST",
    help="batch sizes, e.g. 32,64,128 (default: the script's own, x1/2 and x2).",
)
@click.option(
    "--pin-memory",
    "pin_text",
    default="own",
    metavar="on|off|both|own",
    help="pin_memory to try (default: the script's own).",
)
@click.option("--prefetch-factor", "prefetch_text", metavar="LIST", help="prefetch factors, e.g. 2,4.")
@click.option(
    "--seconds-per-config",
    "seconds_text",
    default="10",
    metavar="S",
    help="Measuring window per configuration, after warm-up (default 10).",
)
@click.option("--batches", "batches_n", type=click.IntRange(1), help="Measure N batches instead.")
@click.option(
    "--loader",
    metavar="FILE:LINE",
    help="The DataLoader to tune, by where it is built (default: the first one built).",
)
@click.option(
    "--warmup-timeout",
    "warmup_text",
    default="60",
    metavar="S",
    help="Give up on a configuration whose DataLoader has not started after S (default 60).",
)
@click.option(
    "--loader-only", is_flag=True, help="Iterate the DataLoader without the training step: its ceiling."
)
@click.option("--force", is_flag=True, help="Run configurations the measurements say cannot fit.")
@click.option("--json", "json_path", metavar="FILE", help="Write the sweep to FILE as it goes (JSON).")
@click.option("--csv", "csv_path", metavar="FILE", help="Write the table to FILE (CSV) at the end.")
@click.option("--resume", "resume_path", metavar="FILE", help="Continue the sweep saved in FILE.")
@click.option(
    "--yes", is_flag=True, help="With --resume: run the command FILE holds without asking (it is shown)."
)
@click.option("--no-plot", is_flag=True, help="No terminal plot after the table.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
def tune(
    workers_text: str | None,
    batches_text: str | None,
    pin_text: str,
    prefetch_text: str | None,
    seconds_text: str,
    batches_n: int | None,
    loader: str | None,
    warmup_text: str,
    loader_only: bool,
    force: bool,
    json_path: str | None,
    csv_path: str | None,
    resume_path: str | None,
    no_plot: bool,
    command: tuple[str, ...],
    yes: bool = False,
) -> None:
    """Measure num_workers x batch_size (x pin_memory, prefetch) on the unchanged training command.

    \b
      dlmon tune -- python train.py
      dlmon tune --workers 0,2,4,8 --batch-sizes 32,64 --json sweep.json -- python train.py
    """
    from dlmon.tune.cli import PlotRenderer, run_tune

    plot: PlotRenderer | None = None
    if not no_plot:  # the UI layer draws the plot; dlmon.tune never imports it
        from dlmon.ui.tune_plot import render

        plot = render
    sys.exit(
        run_tune(
            list(command),
            workers_text,
            batches_text,
            pin_text,
            prefetch_text,
            seconds_text,
            batches_n,
            loader,
            warmup_text,
            force,
            json_path,
            csv_path,
            resume_path,
            plot,
            loader_only=loader_only,
            yes=yes,
        )
    )
