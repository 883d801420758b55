"""Per-step time on torchrl's own objects (issue 34 item 1): torchrl's ``GymEnv("CartPole-v1")``
and a ``ProbabilisticActor`` (MLP 2x64, one-hot categorical), stepped by hand (the floor: the
actor, then ``env.step_and_maybe_reset``), by rlcollect's ``Collector`` and by torchrl's
``Collector`` (200 frames per batch), in alternated rounds; medians of µs per step.

Runs in the torchrl venv (``make test-torchrl``'s)::

    PYTHONPATH=. .venv-torchrl/bin/python bench/torchrl_objects.py split ROUNDS FRAMES

``split`` times, inside each step, ``env.step`` and the actor's forward (wrapped on the
instances); the rest is the collector's own work, and for rlcollect it is split further into the
adapter's own (``TensorDictEnvAdapter.step_rows`` less ``env.step``), the policy runner's own and
the rollout's. ``ROUNDS FRAMES`` alone prints totals; ``ROUNDS FRAMES ours|theirs|floor`` a
cProfile of that one.
"""

import statistics
import os
import sys
import time
import warnings

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.envs import GymEnv
from torchrl.modules import MLP, OneHotCategorical, ProbabilisticActor


def make():
    torch.manual_seed(0)
    env = GymEnv("CartPole-v1")
    env.set_seed(0)
    net = MLP(in_features=4, out_features=2, num_cells=[64, 64], activation_class=nn.Tanh)
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    actor = ProbabilisticActor(
        module,
        in_keys=["logits"],
        out_keys=["action"],
        distribution_class=OneHotCategorical,
        spec=env.action_spec,
        return_log_prob=True,
    )
    return env, actor


def floor(frames):
    env, actor = make()
    td = env.reset()
    t = time.perf_counter()
    with torch.no_grad():
        for _ in range(frames):
            td = actor(td)
            _, td = env.step_and_maybe_reset(td)
    return (time.perf_counter() - t) / frames * 1e6


def _collector_us_per_frame(collector_cls, frames):
    """Microseconds per frame of ``collector_cls`` (rlcollect's or torchrl's ``Collector``) on
    the same env and actor, after one warm-up batch."""
    env, actor = make()
    c = collector_cls(env, actor, frames_per_batch=200, total_frames=-1)
    it = iter(c)
    next(it)
    n = 0
    t = time.perf_counter()
    while n < frames:
        n += next(it).numel()
    el = time.perf_counter() - t
    c.shutdown()
    return el / n * 1e6


def ours(frames):
    from rlcollect import Collector

    return _collector_us_per_frame(Collector, frames)


def theirs(frames):
    from torchrl.collectors import Collector

    return _collector_us_per_frame(Collector, frames)


def _main():
    rounds, frames = int(sys.argv[1]), int(sys.argv[2])
    if len(sys.argv) > 3:
        import cProfile
        import pstats

        fn = {"ours": ours, "theirs": theirs, "floor": floor}[sys.argv[3]]
        fn(400)
        pr = cProfile.Profile()
        pr.enable()
        fn(frames)
        pr.disable()
        st = pstats.Stats(pr)
        st.sort_stats("tottime").print_stats(35)
        sys.exit()
    res = {"floor": [], "ours": [], "theirs": []}
    for r in range(rounds):
        for name, fn in (
            (("floor", floor), ("ours", ours), ("theirs", theirs))
            if r % 2 == 0
            else (("theirs", theirs), ("ours", ours), ("floor", floor))
        ):
            res[name].append(fn(frames))
    print(
        f"load {os.getloadavg()[0]:.1f}; us/step medians over {rounds} alternated rounds of {frames} frames:",
        {k: f"{statistics.median(v):.0f} ({'/'.join(f'{x:.0f}' for x in v)})" for k, v in res.items()},
    )


def split(which, frames):
    """Per-step µs: total, inside env.step, inside the actor's forward; the rest is the collector's."""
    env, actor = make()
    spent = {"env": 0.0, "actor": 0.0}
    step, forward = env.step, actor.forward

    def timed_step(td):
        t = time.perf_counter()
        out = step(td)
        spent["env"] += time.perf_counter() - t
        return out

    def timed_forward(*a, **k):
        t = time.perf_counter()
        out = forward(*a, **k)
        spent["actor"] += time.perf_counter() - t
        return out

    env.step = timed_step
    actor.forward = timed_forward
    if which == "floor":
        td = env.reset()
        with torch.no_grad():
            for _ in range(300):
                td = actor(td)
                _, td = env.step_and_maybe_reset(td)
            spent.update(env=0.0, actor=0.0)
            t = time.perf_counter()
            for _ in range(frames):
                td = actor(td)
                _, td = env.step_and_maybe_reset(td)
            total = time.perf_counter() - t
        n = frames
    else:
        if which == "ours":
            from rlcollect import Collector
            from rlcollect.envs.adapter import TensorDictEnvAdapter
            from rlcollect.policy import TensorDictRunner

            spent.update(adapter=0.0, runner=0.0)
            srows, rcall = TensorDictEnvAdapter.step_rows, TensorDictRunner.__call__

            def t_step_rows(self, *a):
                t = time.perf_counter()
                srows(self, *a)
                spent["adapter"] += time.perf_counter() - t

            def t_call(self, obs):
                t = time.perf_counter()
                out = rcall(self, obs)
                spent["runner"] += time.perf_counter() - t
                return out

            TensorDictEnvAdapter.step_rows, TensorDictRunner.__call__ = t_step_rows, t_call
        else:
            from torchrl.collectors import Collector
        c = Collector(env, actor, frames_per_batch=200, total_frames=-1)
        it = iter(c)
        next(it)
        next(it)
        for k in spent:
            spent[k] = 0.0
        n = 0
        t = time.perf_counter()
        while n < frames:
            n += next(it).numel()
        total = time.perf_counter() - t
        c.shutdown()
        if which == "ours":
            TensorDictEnvAdapter.step_rows, TensorDictRunner.__call__ = srows, rcall
    def us(s):
        return s / n * 1e6
    out = {
        "total": us(total),
        "env.step": us(spent["env"]),
        "actor": us(spent["actor"]),
        "rest": us(total - spent["env"] - spent["actor"]),
    }
    if "adapter" in spent:
        out["adapter own"] = us(spent["adapter"] - spent["env"])
        out["runner own"] = us(spent["runner"] - spent["actor"])
        out["rollout own"] = out["rest"] - out["adapter own"] - out["runner own"]
    return out


def split_rounds(rounds, frames):
    res = {}
    for r in range(rounds):
        order = ("floor", "ours", "theirs") if r % 2 == 0 else ("theirs", "ours", "floor")
        for name in order:
            for k, v in split(name, frames).items():
                res.setdefault(name, {}).setdefault(k, []).append(v)
    print(f"load {os.getloadavg()[0]:.1f}, {rounds} alternated rounds of {frames} frames, median µs/step:")
    for name, parts in res.items():
        print(
            f"  {name:7s}",
            "  ".join(f"{k} {statistics.median(v):6.0f}" for k, v in parts.items()),
            " rest per round:",
            "/".join(f"{x:.0f}" for x in parts["rest"]),
        )


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if sys.argv[1] == "split":
        split_rounds(int(sys.argv[2]), int(sys.argv[3]))
    else:
        _main()
