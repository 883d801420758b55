"""An ``ALE/`` id: GymEnv imports ale_py itself (its import registers the ids with gymnasium),
and without ale-py the error names the extra (issue 38, item 5)."""

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
        "GymEnv('ALE/Pong-v5'): Atari envs need ale-py, which rlcollect does not install by default: "
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
