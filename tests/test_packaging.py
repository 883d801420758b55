"""What a user installing rlcollect from a wheel gets: no submitit or matplotlib unless asked for
(the ``[slurm]`` and ``[examples]`` extras), a ``rlcollect`` command whose ``--help`` and
``--version`` import nothing heavy, no trace of the source checkout (``bench/``), the metadata a
company checks first (license, authors, URLs: what ``pip show`` prints), and the package's types
(``py.typed``: mypy checks a user's script against rlcollect's annotations).

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
    for name in ("pyproject.toml", "README.md", "LICENSE"):
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
    assert "rlcollect/nets.py" in names and "rlcollect/distributed/launch/job_bootstrap.py" in names
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
    from rlcollect.distributed.launch.launchers import make_executor

    monkeypatch.setitem(sys.modules, "submitit", None)  # `import submitit` raises ImportError
    expected = "pip install 'rlcollect[slurm]'"
    with pytest.raises(ImportError, match=re.escape(expected)):
        DistributedCollector([CountingEnv], None, frames_per_batch=10, total_frames=10, launcher="submitit")
    with pytest.raises(ImportError, match=re.escape(expected)):
        make_executor({"executor": "local"})


@pytest.mark.timeout(300)
def test_the_wheel_has_license_authors_urls_and_types(wheel):
    meta = _metadata(wheel)
    assert meta["License-Expression"] == "MIT"
    assert meta["Author"] == "The rlcollect authors"
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(urls)
    assert "Typing :: Typed" in meta.get_all("Classifier")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        license_text = zf.read(f"rlcollect-{rlcollect.__version__}.dist-info/licenses/LICENSE").decode()
    assert "rlcollect/py.typed" in names and "rlcollect/typing.py" in names
    assert license_text == (ROOT / "LICENSE").read_text() and license_text.startswith("MIT License")


def _pip_show(installed: Path) -> str:
    """``pip show -v rlcollect`` in the venv of the installed wheel (that venv has no pip of its
    own: this venv's pip, pointed at it). pip 25.1 or newer prints ``License-Expression``."""
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(installed / "python"), "show", "-v",
                           "rlcollect"], capture_output=True, text=True, timeout=120, cwd=installed.parent, env=_env())
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.timeout(300)
def test_pip_show_has_the_license_and_urls(installed):
    show = _pip_show(installed)
    lines = show.splitlines()
    assert "License-Expression: MIT" in lines, show
    assert "Home-page: https://github.com/rlcollect/rlcollect" in lines, show
    assert "Author: The rlcollect authors" in lines, show
    assert "  Documentation, https://github.com/rlcollect/rlcollect/tree/main/docs" in lines, show


# A user's script, typed: mypy must check it against rlcollect's annotations (not skip the
# package as untyped) and accept it; the same script with two mistakes must be refused, on the
# lines of the mistakes. The wheel's venv has no torch (nor the other dependencies): mypy is told
# to treat them as unknown, which is what keeps this test to seconds (type-checking torch takes
# minutes), and a user's own run with them installed sees at least as much.
USER_SCRIPT = """\
from rlcollect import Collector, CountingEnv, DistributedCollector, GymEnv, ReplayBuffer
from rlcollect.typing import DeviceLike, EnvLike, EnvSource, PolicyLike

env: EnvLike = CountingEnv()
source: EnvSource = "CartPole-v1"
policy: PolicyLike = None
device: DeviceLike = "cpu"
collector = Collector(CountingEnv, policy, frames_per_batch=10, total_frames=20, policy_device=device)
gym_env = GymEnv("CartPole-v1", num_envs=2)
buffer = ReplayBuffer(100)
distributed = DistributedCollector(["CartPole-v1"] * 2, None, frames_per_batch=10, secret_file="/tmp/secret")
"""
MISTAKES = """\
wrong_env: EnvLike = 3
wrong = Collector(CountingEnv, None, frames_per_batch="10")
"""
MYPY_INI = """\
[mypy]
[mypy-torch.*,tensordict.*,gymnasium.*,numpy.*,cloudpickle.*,tqdm.*]
ignore_missing_imports = True
"""


def _mypy(installed: Path, folder: Path, source: str) -> subprocess.CompletedProcess:
    folder.mkdir()
    (folder / "user.py").write_text(source)
    (folder / "mypy.ini").write_text(MYPY_INI)
    return subprocess.run([sys.executable, "-m", "mypy", "--python-executable", str(installed / "python"),
                           "--config-file", "mypy.ini", "--no-incremental", "--cache-dir", os.devnull, "user.py"],
                          capture_output=True, text=True, timeout=240, cwd=folder, env=_env())


@pytest.mark.timeout(600)
def test_mypy_checks_a_user_script_against_the_installed_types(installed, tmp_path):
    pytest.importorskip("mypy", reason="mypy is in the [test] extra")
    good = _mypy(installed, tmp_path / "good", USER_SCRIPT)
    assert good.returncode == 0 and good.stdout.startswith("Success: no issues found"), good.stdout + good.stderr
    bad = _mypy(installed, tmp_path / "bad", USER_SCRIPT + MISTAKES)
    errors = [line for line in bad.stdout.splitlines() if ": error:" in line]
    first = USER_SCRIPT.count("\n") + 1
    assert errors == [
        f'user.py:{first}: error: Incompatible types in assignment (expression has type "int", variable has type '
        '"EnvLike")  [assignment]',
        f'user.py:{first + 1}: error: Argument "frames_per_batch" to "Collector" has incompatible type "str"; '
        'expected "int"  [arg-type]',
    ], bad.stdout


# -- make dist, make release ---------------------------------------------------------------------

def _checkout_copy(dest: Path) -> Path:
    """What `make dist` and `make release` read, copied into a git repository of its own with one
    commit (the release target tags it; this checkout is left alone)."""
    for name in ("pyproject.toml", "README.md", "LICENSE", "Makefile", "CHANGELOG.md"):
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(ROOT / "rlcollect", dest / "rlcollect", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (dest / ".gitignore").write_text("dist/\nbuild/\n*.egg-info/\n")
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "release candidate"]):
        subprocess.run([*git, *argv], cwd=dest, check=True, capture_output=True, timeout=60)
    return dest


def _make(checkout: Path, target: str) -> subprocess.CompletedProcess:
    # PY: this venv (it has build and twine, the [test] extra); STAMP empty: no .venv to set up.
    return subprocess.run(["make", "--no-print-directory", target, f"PY={sys.executable}", "STAMP="], cwd=checkout,
                          capture_output=True, text=True, timeout=500, env=_env())


@pytest.mark.timeout(600)
def test_make_dist_builds_an_sdist_and_a_wheel_that_twine_accepts_and_make_release_tags_the_version(tmp_path):
    pytest.importorskip("build", reason="build is in the [test] extra")
    pytest.importorskip("twine", reason="twine is in the [test] extra")
    checkout = _checkout_copy(tmp_path)
    version = rlcollect.__version__

    dist = _make(checkout, "dist")
    assert dist.returncode == 0, dist.stdout[-3000:] + dist.stderr[-3000:]
    assert sorted(p.name for p in (checkout / "dist").iterdir()) == [
        f"rlcollect-{version}-py3-none-any.whl", f"rlcollect-{version}.tar.gz"]
    assert re.findall(r"Checking dist/(\S+): (\w+)", re.sub(r"\x1b\[[0-9;]*m", "", dist.stdout)) == [
        (f"rlcollect-{version}-py3-none-any.whl", "PASSED"), (f"rlcollect-{version}.tar.gz", "PASSED")]

    def tags() -> str:
        return subprocess.run(["git", "tag", "-l"], cwd=checkout, capture_output=True, text=True, timeout=60).stdout

    (checkout / "README.md").write_text("changed\n")  # a tree with uncommitted changes is not released
    dirty = _make(checkout, "release")
    assert dirty.returncode != 0 and "uncommitted changes" in dirty.stdout and tags() == ""
    subprocess.run(["git", "checkout", "README.md"], cwd=checkout, check=True, timeout=60)

    release = _make(checkout, "release")
    assert release.returncode == 0, release.stdout[-3000:] + release.stderr[-3000:]
    assert tags() == f"v{version}\n"
    assert f"Tagged v{version}" in release.stdout and f"git push origin v{version}" in release.stdout
    again = _make(checkout, "release")
    assert again.returncode != 0 and f"tag v{version} exists; bump __version__" in again.stdout


def test_the_changelog_has_a_section_for_this_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(rlcollect.__version__)}\]", changelog, re.M)
    assert "## What 0.x promises" in changelog


# -- docs/ray.md's KubeRay manifest: its pip install, in a scratch venv ----------------------------

RAY_DOC = ROOT / "docs" / "ray.md"
TORCH_INDEX_LINE = "--extra-index-url https://download.pytorch.org/whl/cpu"
MOUNTED_WHEEL = f"file:///home/ray/train/rlcollect-{rlcollect.__version__}-py3-none-any.whl"


def _manifest_pip_packages() -> list[str]:
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with yamllint (the [test] extra)")
    [text] = re.findall(r"^```yaml\n(.*?)^```", RAY_DOC.read_text(), re.S | re.M)
    runtime_env = yaml.safe_load(yaml.safe_load(text)["spec"]["runtimeEnvYAML"])
    return runtime_env["pip"]["packages"]


def _local_torch_wheel() -> Path | None:
    """torch 2.13.0's CPU wheel on local disk, in a folder pip is configured to find links in."""
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60).stdout
    folders = [f for line in listing.splitlines() if "find-links" in line
               for f in line.split("=", 1)[1].strip("'\"").split()]
    folders += os.environ.get("PIP_FIND_LINKS", "").split()
    for folder in folders:
        found = sorted(Path(folder.removeprefix("file://")).glob("torch-2.13.0+cpu-cp311-*.whl"))
        if found:
            return found[0]
    return None


def test_the_manifest_installs_torchs_cpu_build_and_rlcollect_from_the_mounted_wheel():
    packages = _manifest_pip_packages()
    assert packages == [TORCH_INDEX_LINE, "torch==2.13.0+cpu", f"rlcollect[ray] @ {MOUNTED_WHEEL}"]
    # The wheel's name in the manifest is the one `make dist` writes, and the ConfigMap that
    # holds it is the one mounted at /home/ray/train on every pod (the actors install it too).
    assert f"--from-file=dist/rlcollect-{rlcollect.__version__}-py3-none-any.whl" in RAY_DOC.read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_manifests_pip_install_works_in_a_scratch_venv(wheel, tmp_path):
    """What Ray does with the manifest's ``pip.packages`` on a pod: the list written one per line
    to a requirements file, then ``pip install -r`` it (Ray adds --no-cache-dir, left out here so
    that pip's cache serves the test). Two lines are substituted, because this machine cannot
    reach them: torch's CPU index becomes the folder of torch 2.13.0's CPU wheel on local disk,
    and the wheel mounted from the ConfigMap becomes the one this test builds."""
    torch_wheel = _local_torch_wheel()
    if torch_wheel is None:
        pytest.skip("needs torch 2.13.0's CPU wheel on local disk (torch's own index is not reachable here)")
    assert wheel.name == MOUNTED_WHEEL.rsplit("/", 1)[1]
    lines = [f"--find-links {torch_wheel.parent}" if line == TORCH_INDEX_LINE else
             line.replace(MOUNTED_WHEEL, wheel.as_uri()) for line in _manifest_pip_packages()]
    (tmp_path / "requirements.txt").write_text("\n".join(lines) + "\n")
    home = tmp_path / "venv"
    try:
        _install_and_probe(home, tmp_path)
    finally:
        shutil.rmtree(home, ignore_errors=True)  # 1.5 GB: not kept with pytest's last temporary folders


def _install_and_probe(home: Path, tmp_path: Path) -> None:
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(home)
    python = str(home / "bin" / "python")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
                              "--disable-pip-version-check", "-r", "requirements.txt"],
                             capture_output=True, text=True, timeout=800, cwd=tmp_path, env=_env())
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    probe = subprocess.run([python, "-c", "import ray, rlcollect, torch\n"
                            "from rlcollect import Collector\n"
                            "c = Collector('CartPole-v1', frames_per_batch=10, total_frames=10)\n"
                            "print(torch.__version__, rlcollect.__version__, ray.__version__, [b.shape for b in c])\n"
                            "c.shutdown()"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env())
    assert probe.returncode == 0, probe.stderr[-3000:]
    torch_version, version, ray_version, shapes = probe.stdout.split(" ", 3)
    assert (torch_version, version, shapes.strip()) == ("2.13.0+cpu", rlcollect.__version__, "[torch.Size([10])]")
    extra = re.search(r'ray = \["ray>=([\d.]+)"\]', (ROOT / "pyproject.toml").read_text()).group(1)
    assert tuple(map(int, ray_version.split("."))) >= tuple(map(int, extra.split(".")))
