"""docs/ray.md: its examples (the ```` ```py ```` blocks, kept out of tests/test_docs.py, which
runs without Ray) run here, in order, against this module's Ray cluster; its KubeRay ``RayJob``
manifest parses, passes yamllint, and agrees with the rest of the page (the Ray version of the
extra, the port the training script listens on)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from conftest import NO_RAY, SKIP_REASON
from ray_helpers import pid_alive, wait_no_actors

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]
DOC = Path(__file__).resolve().parents[2] / "docs" / "ray.md"


def _blocks(tag: str) -> list[str]:
    return re.findall(rf"^```{tag}\n(.*?)^```", DOC.read_text(), re.S | re.M)


def _manifest() -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with ray and yamllint")
    [text] = _blocks("yaml")
    return yaml.safe_load(text)


@pytest.mark.skipif(NO_RAY, reason=SKIP_REASON)
def test_examples_run(ray_cluster, monkeypatch, tmp_path):
    blocks = _blocks("py")
    assert len(blocks) == 3
    shm_before = set(os.listdir("/dev/shm"))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "rlcollect_doc_ray"}
    for i, code in enumerate(blocks):
        code = code.replace("    ...                                                        # train\n", "    pass\n")
        exec(compile(code, f"ray.md[py block {i}]", "exec"), namespace)
    for value in list(namespace.values()):
        if type(value).__name__.endswith("Collector") and callable(getattr(value, "shutdown", None)):
            value.shutdown()
    # The KubeRay example's nodes run multi-process collectors inside the actors, whose shared
    # memory (torch_<pid>_...) the leak check of tests/conftest.py cannot see (Ray's processes
    # are not this test's): none may outlive the process that made it.
    assert wait_no_actors(timeout=30.0) == set()
    deadline = time.monotonic() + 10
    while (left := _orphaned_shm(shm_before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == set()


def _orphaned_shm(before: set[str]) -> set[str]:
    """New torch shared-memory files whose creating process is gone."""
    found = set()
    for name in set(os.listdir("/dev/shm")) - before:
        parts = name.split("_")
        if len(parts) >= 3 and parts[0] == "torch" and parts[1].isdigit() and not pid_alive(int(parts[1])):
            found.add(name)
    return found


def test_manifest_passes_yamllint():
    linter = pytest.importorskip("yamllint.linter", reason="yamllint is in the test extra")
    from yamllint.config import YamlLintConfig

    [text] = _blocks("yaml")
    config = YamlLintConfig("extends: default\nrules:\n  line-length: {max: 120}\n  document-start: disable\n")
    problems = [f"{p.line}:{p.column} {p.level} {p.message} ({p.rule})" for p in linter.run(text, config)]
    assert problems == []


def test_manifest_is_a_rayjob_that_runs_the_training_script():
    job = _manifest()
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert spec["entrypoint"] == "python /home/ray/train/train.py"
    assert spec["shutdownAfterJobFinishes"] is True
    assert "rlcollect[ray]" in spec["runtimeEnvYAML"]
    cluster = spec["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    workers = cluster["workerGroupSpecs"]
    containers = head["containers"] + [c for g in workers for c in g["template"]["spec"]["containers"]]
    # The Ray of every pod is the cluster's, and the one the extra asks for at least.
    extra = re.search(r'ray = \["ray>=([\d.]+)"\]', (DOC.parents[1] / "pyproject.toml").read_text()).group(1)
    assert cluster["rayVersion"] == f"{extra}.0"
    assert {c["image"] for c in containers} == {f"rayproject/ray:{cluster['rayVersion']}-py311-cpu"}
    # Every pod has the same Ray token (Ray's own authentication, see "Trust").
    for c in containers:
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "ppo-cartpole-ray-token"
    # The head pod (the trainer, rank 0) opens the port the script gives as tcp_port (its channel listener).
    ports = {p["containerPort"] for p in head["containers"][0]["ports"]}
    script = _blocks("py")[1]
    port = int(re.search(r"tcp_port=(\d+)", script).group(1))
    assert port in ports
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no collector node on the trainer's pod
    mounts = {m["mountPath"]: m["name"] for m in head["containers"][0]["volumeMounts"]}
    assert mounts["/home/ray/train"] in {v["name"] for v in head["volumes"]}
    # Room on the worker pods for the script's nodes (2 nodes x 2 workers, one CPU each).
    assert sum(g["replicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"])
               for g in workers) >= 4
