"""The guard process of one worker pool (see reaper.py). Standard library only, run by path with
``python -I -S`` so that it is up in milliseconds, long before a worker has imported torch.

It reads ``+ <pid> <start time>`` / ``- <pid>`` / ``clear`` lines from stdin, whose only writer is the main
process. End of file means the main process has closed the pipe or died: every process still
registered is SIGKILLed (if its start time still matches, so that a recycled pid is spared), with
what is left of the process group it led (a worker's env's processes), and the guard exits.
Meanwhile it checks the registered processes every ``POLL_S``: when one has died (a zombie, gone,
or its pid recycled) it ends what is left of its process group.
"""

import os
import select
import signal

#: How often the watched processes are checked for an unasked death.
POLL_S = 0.25


def read_stat(pid: int) -> tuple[bytes, int]:
    """The state (field 3) and start time (field 22: clock ticks after boot) of ``pid``:
    ``(b"?", 0)`` without /proc, ``(b"X", -1)`` if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return b"X", -1
    except OSError:
        return b"?", 0
    fields = stat[stat.rfind(b")") + 2:].split()
    return fields[0], int(fields[19])


def start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot); 0 without /proc, -1 if gone."""
    return read_stat(pid)[1]


def died(pid: int, started: int) -> bool:
    """Whether the watched process ``pid`` (started at ``started``) has died: a zombie, gone,
    or its pid recycled. Unknown without /proc."""
    state, now = read_stat(pid)
    return started != 0 and (now != started or state in (b"Z", b"X"))


def kill_group(pid: int) -> None:
    """SIGKILL what is left of the process group ``pid`` led (a worker leads its own: what its
    env started). No such group: nothing to do."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def main() -> None:
    # Ctrl-C is the main process's to handle; it is started in its own session as well.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watched: dict[int, int] = {}
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], POLL_S if watched else None)
        if ready:
            chunk = os.read(0, 65536)
            if not chunk:
                break  # end of file: the main process closed the pipe, or died
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                parts = line.split()
                if len(parts) == 3 and parts[0] == b"+":
                    watched[int(parts[1])] = int(parts[2])
                elif len(parts) == 2 and parts[0] == b"-":
                    watched.pop(int(parts[1]), None)
                elif parts == [b"clear"]:
                    watched.clear()
        # A watched process that died unasked (SIGKILL, say): end what its env started, now,
        # whether or not the main process notices soon.
        for pid, started in list(watched.items()):
            if died(pid, started):
                del watched[pid]
                kill_group(pid)
    for pid, started in watched.items():
        if started == 0 or start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        kill_group(pid)


if __name__ == "__main__":
    main()
