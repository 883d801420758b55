"""What a user installing rlcollect from a wheel gets: no submitit or matplotlib unless asked for
(the ``[slurm]`` and ``[examples]`` extras), a ``rlcollect`` command whose ``--help`` and
``--version`` import nothing heavy, and no trace of the source checkout (``bench/``).

The wheel is built from a copy of the package (so that the build leaves nothing in the
checkout) and installed, without its dependencies, into a bare venv outside the checkout: there
torch cannot even be imported, so a command that answers there imported none of it."""

from __future__ import annotations

import ast
import email.parser
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import rlcollect

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "numpy", "tensordict", "gymnasium", "cloudpickle", "tqdm", "submitit", "matplotlib")
pytestmark = pytest.mark.timeout(120)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    return {**env, "PYTHONNOUSERSITE": "1"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "rlcollect", src / "rlcollect", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation, no index: the build uses this venv's setuptools and needs no network.
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", "--wheel-dir", str(out), str(src)],
                          capture_output=True, text=True, timeout=240, cwd=src)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = out.glob("rlcollect-*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A bare venv (no system site-packages, no pip) outside the checkout, with the wheel
    installed without its dependencies; returns its bin/ folder."""
    home = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(home)
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(home / "bin" / "python"), "install",
                           "--quiet", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=240, cwd=home, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return home / "bin"


def _run(bin_dir: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_dir / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=60,
                          cwd=bin_dir.parent, env=_env())


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(zf.read(name).decode())


@pytest.mark.timeout(300)
def test_submitit_and_matplotlib_are_extras_only(wheel):
    meta = _metadata(wheel)
    assert meta["Version"] == rlcollect.__version__
    requires = meta.get_all("Requires-Dist")
    default = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requires if "extra ==" not in r}
    assert default == {"torch", "tensordict", "gymnasium", "cloudpickle", "numpy", "tqdm"}
    assert 'submitit>=1.5; extra == "slurm"' in requires
    assert 'matplotlib>=3.8; extra == "examples"' in requires
    assert {"slurm", "examples", "test"} <= set(meta.get_all("Provides-Extra"))


@pytest.mark.timeout(300)
def test_the_wheel_holds_the_package_and_its_command_only(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = zf.read(entry_points).decode()
    assert {n.split("/")[0] for n in names} == {"rlcollect", f"rlcollect-{rlcollect.__version__}.dist-info"}
    assert "rlcollect/nets.py" in names and "rlcollect/distributed/job_bootstrap.py" in names
    assert "[console_scripts]\nrlcollect = rlcollect.cli:main" in scripts


@pytest.mark.timeout(300)
def test_installed_command_answers_without_its_dependencies(installed):
    # The proof holds only if the venv really lacks them (and uses the wheel, not the checkout).
    probe = _run(installed, "python", "-c", "import rlcollect, importlib.util as u; print(rlcollect.__file__); "
                 f"print([m for m in {HEAVY!r} if u.find_spec(m)])")
    assert probe.returncode == 0, probe.stderr
    location, missing = probe.stdout.splitlines()
    assert Path(location).is_relative_to(installed.parent) and missing == "[]"

    version = _run(installed, "rlcollect", "--version")
    assert (version.returncode, version.stdout) == (0, f"rlcollect {rlcollect.__version__}\n")
    help_ = _run(installed, "rlcollect", "--help")
    assert help_.returncode == 0, help_.stderr
    assert "collect" in help_.stdout and "node" in help_.stdout and "bench" not in help_.stdout
    for command in ("collect", "node"):
        sub = _run(installed, "rlcollect", command, "--help")
        assert sub.returncode == 0 and sub.stdout.startswith(f"usage: rlcollect {command}"), sub.stderr

    bench = _run(installed, "rlcollect", "bench", "--help")
    assert bench.returncode == 2 and bench.stdout == ""
    assert bench.stderr.startswith("rlcollect: error: bench: the benchmark suite is not part of the installed package")
    assert "`python -m bench`" in bench.stderr and len(bench.stderr.splitlines()) == 1


def test_no_package_module_imports_bench():
    offenders = []
    for path in (ROOT / "rlcollect").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "bench"]
    assert offenders == []


def test_a_missing_submitit_names_the_extra(monkeypatch):
    from rlcollect import CountingEnv, DistributedCollector
    from rlcollect.distributed.launchers import make_executor

    monkeypatch.setitem(sys.modules, "submitit", None)  # `import submitit` raises ImportError
    expected = "pip install 'rlcollect[slurm]'"
    with pytest.raises(ImportError, match=re.escape(expected)):
        DistributedCollector([CountingEnv], None, frames_per_batch=10, total_frames=10, launcher="submitit")
    with pytest.raises(ImportError, match=re.escape(expected)):
        make_executor({"executor": "local"})
