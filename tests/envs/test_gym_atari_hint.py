"""An ``ALE/`` id: GymEnv and ``rlcollect collect --env`` import ale_py themselves (its import
registers the ids with gymnasium; ``rlcollect.envs.gym_ids.make``), and without ale-py the error
names the extra (issue 38, item 5)."""

from __future__ import annotations

import subprocess
import sys

import gymnasium
import pytest
from loadscale import scaled

from rlcollect import GymEnv


@pytest.mark.timeout(60)
def test_without_ale_py_the_error_names_the_atari_extra(monkeypatch):
    registry = gymnasium.envs.registration.registry  # ALE/ ids are there if a test imported ale_py
    monkeypatch.setattr(gymnasium.envs.registration, "registry",
                        {k: v for k, v in registry.items() if not k.startswith("ALE/")})
    monkeypatch.setitem(sys.modules, "ale_py", None)  # `import ale_py` raises ImportError
    with pytest.raises(gymnasium.error.NamespaceNotFound) as info:
        GymEnv("ALE/Pong-v5")
    assert str(info.value) == (
        "'ALE/Pong-v5': Atari envs need ale-py, which rlcollect does not install by default: "
        "pip install 'rlcollect[atari]' (Namespace ALE not found. Have you installed the proper package for ALE?)")
    with pytest.raises(gymnasium.error.NamespaceNotFound, match="^Namespace Foo not found"):
        GymEnv("Foo/Bar-v0")  # another namespace: gymnasium's own error, untouched


@pytest.mark.timeout(120)
def test_an_ale_id_works_without_importing_ale_py_first():
    pytest.importorskip("ale_py", reason="ale-py is not installed: pip install 'rlcollect[atari]'")
    # A fresh interpreter, where nothing imported ale_py before.
    code = ("import sys; from rlcollect import GymEnv\n"
            "env = GymEnv('ALE/Pong-v5')\n"
            "print('ale_py' in sys.modules, env.env_id)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=scaled(100, cap=400))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "True ALE/Pong-v5\n"


@pytest.mark.timeout(60)
def test_the_cli_names_the_atari_extra_without_ale_py(monkeypatch, capsys):
    from rlcollect import cli

    registry = gymnasium.envs.registration.registry
    monkeypatch.setattr(gymnasium.envs.registration, "registry",
                        {k: v for k, v in registry.items() if not k.startswith("ALE/")})
    monkeypatch.setitem(sys.modules, "ale_py", None)
    with pytest.raises(SystemExit) as info:
        cli.main(["collect", "--env", "ALE/Pong-v5", "--frames", "10"])
    assert info.value.code == 2
    assert capsys.readouterr().err.endswith(
        "rlcollect: error: argument --env: cannot make 'ALE/Pong-v5': 'ALE/Pong-v5': Atari envs need ale-py, which "
        "rlcollect does not install by default: pip install 'rlcollect[atari]' (Namespace ALE not found. Have you "
        "installed the proper package for ALE?)\n")


@pytest.mark.timeout(180)
def test_the_cli_collects_an_ale_id_without_importing_ale_py_first():
    pytest.importorskip("ale_py", reason="ale-py is not installed: pip install 'rlcollect[atari]'")
    # Before, `rlcollect collect --env ALE/Pong-v5` failed its early id check: "Namespace ALE not found".
    proc = subprocess.run([sys.executable, "-m", "rlcollect.cli", "collect", "--env", "ALE/Pong-v5", "--frames", "64",
                           "--frames-per-batch", "32", "--workers", "1", "--no-progress", "--log-level", "WARNING"],
                          capture_output=True, text=True, timeout=scaled(150, cap=600))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "64" in proc.stdout, proc.stdout
