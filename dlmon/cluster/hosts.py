"""The nodes to read: HOST:PORT arguments, a hosts file, or SLURM's compact node list."""

from __future__ import annotations

import re

MAX_NODES = 100_000  # node[1-99999999] is a typo, not a cluster
MAX_HOSTS_FILE_CHARS = 16 * 1024 * 1024


class HostsError(ValueError):
    """A node list that cannot be read: one line for the user."""


def expand_nodelist(text: str) -> list[str]:
    """``node[01-03,07],gpu-a`` -> node01, node02, node03, node07, gpu-a (SLURM's hostlist form;
    zero padding kept, several bracket groups multiply)."""
    names: list[str] = []
    for part in _split_top(text.strip()):
        names.extend(_expand_one(part, MAX_NODES - len(names)))
    return names


def _split_top(text: str) -> list[str]:
    """Split on the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostsError(f"node list {text[:60]!r}: a ']' without its '['")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise HostsError(f"node list {text[:60]!r}: a '[' without its ']'")
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


_GROUP = re.compile(r"\[([^\]]*)\]")


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()  # "²".isdigit(), but int("²") fails


def _expand_one(part: str, room: int) -> list[str]:
    """The names ``part`` stands for; HostsError past ``room`` of them, checked as they are made
    (two ranges multiply: n[1-99999]-m[1-99999] is 10^10 names, never built)."""
    match = _GROUP.search(part)
    if match is None:
        if room < 1:
            raise HostsError(f"node list names more than {MAX_NODES} nodes (at {part[:60]!r})")
        return [part]
    head, tail = part[: match.start()], part[match.end() :]
    out: list[str] = []
    for item in match.group(1).split(","):
        low, sep, high = item.strip().partition("-")
        if not _digits(low) or (sep and not _digits(high)):
            raise HostsError(f"node list {part[:60]!r}: {item!r} is not a number or a range of numbers")
        width = len(low)
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise HostsError(f"node list {part[:60]!r}: the range {item!r} runs backwards")
        if last - first > MAX_NODES:
            raise HostsError(f"node list {part[:60]!r} names more than {MAX_NODES} nodes")
        for n in range(first, last + 1):
            out.extend(_expand_one(f"{head}{n:0{width}d}{tail}", room - len(out)))
    return out


def read_hosts_file(text: str) -> list[str]:
    """One node per line (HOST or HOST:PORT); blank lines and ``#`` comments skipped."""
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.extend(line.split())
    return out


def with_port(node: str, port: int) -> str:
    """``HOST`` -> ``HOST:port``; ``HOST:PORT``, ``[v6]:PORT`` and URLs stay as given."""
    if "://" in node or re.search(r"(^[^:]*|\]):\d+$", node):
        return node
    return f"{node}:{port}"


def resolve_nodes(
    nodes: tuple[str, ...], hosts_file: str | None, port: int, slurm_nodelist: str | None
) -> tuple[str, ...]:
    """The HOST:PORT addresses to read: the arguments and the hosts file, else SLURM's node list;
    a node named twice (an argument and the file, HOST and HOST:PORT) once. HostsError with the
    user's one line for what cannot be read, or for no node at all."""
    named = list(nodes)
    if hosts_file is not None:
        try:
            with open(hosts_file, encoding="utf-8") as fh:
                text = fh.read(MAX_HOSTS_FILE_CHARS + 1)  # /dev/zero would be read for ever
        except (OSError, UnicodeDecodeError) as exc:
            raise HostsError(
                f"cannot read --hosts-file {hosts_file}: {getattr(exc, 'strerror', None) or exc}"
            ) from None
        if len(text) > MAX_HOSTS_FILE_CHARS:
            raise HostsError(
                f"--hosts-file {hosts_file} is longer than {MAX_HOSTS_FILE_CHARS >> 20} MiB "
                "(not a list of nodes)"
            )
        named += read_hosts_file(text)
    if len(named) > MAX_NODES:
        raise HostsError(f"more than {MAX_NODES} nodes named")
    if not named and slurm_nodelist:
        try:
            named = expand_nodelist(slurm_nodelist)
        except HostsError as exc:
            raise HostsError(f"SLURM_JOB_NODELIST: {exc}") from None
    if not named:
        raise HostsError(
            "name the nodes (HOST:PORT ..., --hosts-file FILE, SLURM_JOB_NODELIST) or --prometheus URL"
        )
    return tuple(dict.fromkeys(with_port(n, port) for n in named))
