"""scripts/burn.py, the loaded machine of `make test-loaded`: it runs the command beside burning
processes, passes its exit status on, and leaves no burner behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from loadscale import scaled

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "burn.py"
# The command counts the burners: its parent's other children (burn.py's, beside the command).
COUNT = ("import os; ppid = os.getppid(); "
         "kids = [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid() and "
         "open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1] == str(ppid)]; "
         "print(len(kids), flush=True); raise SystemExit(3)")


def test_burn_runs_the_command_beside_the_burners_and_ends_them():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--procs", "2", "--", sys.executable, "-c", COUNT],
                          capture_output=True, text=True, timeout=scaled(60, cap=240))
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "2\n"
    assert "2 burners" in proc.stderr and "exited 3" in proc.stderr
    # burn.py joined its burners before exiting; the leak checker of conftest.py sees none left.


def test_burn_without_a_command_says_how():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=scaled(60, cap=240))
    assert proc.returncode == 2 and "python3 scripts/burn.py -- make test" in proc.stderr
