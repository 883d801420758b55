"""The guard process of one worker pool (see reaper.py). Standard library only, run by path with
``python -I -S`` so that it is up in milliseconds, long before a worker has imported torch.

It reads ``+ <pid> <start time>`` / ``- <pid>`` / ``clear`` lines from stdin, whose only writer is the main
process. End of file means the main process has closed the pipe or died: every process still
registered is SIGKILLed (if its start time still matches, so that a recycled pid is spared), and
the guard exits.
"""

import os
import signal
import sys


def start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot); 0 without /proc, -1 if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return -1
    except OSError:
        return 0
    return int(stat[stat.rfind(b")") + 2:].split()[19])


def main() -> None:
    # Ctrl-C is the main process's to handle; it is started in its own session as well.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watched: dict[int, int] = {}
    for line in sys.stdin.buffer:
        parts = line.split()
        if len(parts) == 3 and parts[0] == b"+":
            watched[int(parts[1])] = int(parts[2])
        elif len(parts) == 2 and parts[0] == b"-":
            watched.pop(int(parts[1]), None)
        elif parts == [b"clear"]:
            watched.clear()
    for pid, started in watched.items():
        if started == 0 or start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    main()
