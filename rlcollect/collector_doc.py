"""The docstring of ``Collector`` (its arguments, with torchrl's names), kept here so that
``rlcollect/collector.py`` holds the code."""

COLLECTOR_DOC = """Collect experience from one env with a policy, in this process.

Iterating yields batches (``TensorDict``, time as the last dim; the outcome of each step
under ``"next"``) until ``total_frames`` are collected. The arguments are torchrl's
``Collector``'s, with the same names and defaults; where the behaviour differs, the entry
says so.

Args:
    create_env_fn: the env: an instance (rlcollect's ``GymEnv``/``SerialEnv``/..., a
        ``gymnasium.Env`` or vector env, a torchrl-style TensorDict env), a gymnasium id
        (``"CartPole-v1"``, built with ``GymEnv``), or a callable returning one (called here,
        with ``create_env_kwargs``).
    policy: ``None`` (random actions from the env's action space), a ``TensorDictModule``
        (reads its ``in_keys``, writes ``"action"``), an ``nn.Module`` or a callable whose
        parameters are named after observation keys and which returns the action (matched
        to the env's observations at construction; a mismatch is a ``ValueError``).
    policy_factory: a callable taking no argument that builds the policy here instead
        (``policy``, if given too, is then only the source of weights for
        ``update_policy_weights_``). Default ``None``.
    frames_per_batch: frames per yielded batch (required); the batch has shape
        ``(*env.batch_size, T)`` with ``T = ceil(frames_per_batch / prod(env.batch_size))``,
        so a batched env rounds it up to a multiple of its rows.
    total_frames: stop after this many frames (``-1``, the default: never); not a multiple
        of ``frames_per_batch`` warns, and the last batch is a whole one.
    device: the default of ``policy_device`` and ``storing_device`` (torchrl's ``device``):
        a ``torch.device``, a string (``"cpu"``, ``"cuda:0"``) or ``None`` (where each
        already is). Default ``None``.
    storing_device: where the yielded batches live; ``None``: ``device``, else the CPU.
    env_device: the env's device: TensorDict (torchrl) envs are moved there
        (``env.to(env_device)``); rlcollect's numpy-backed envs accept only the CPU (another
        device is a ``ValueError``). Default ``None``.
    policy_device: where the policy runs: a copy of it is made there if it lives elsewhere,
        observations go there and actions come back; ``None``: ``device``, else where the
        policy's parameters are.
    create_env_kwargs: keyword arguments for ``create_env_fn`` when it is a callable or a
        gymnasium id (with an env instance: ``ValueError``). Default ``None``.
    max_frames_per_traj: truncate trajectories at this length (adds ``"step_count"``;
        ``None``, the default: no limit).
    init_random_frames: the first frames (whole batches) act randomly, whatever the policy
        (``None``: none).
    reset_at_each_iter: reset every env at the start of each batch. Default ``False``.
    postproc: a callable applied to each batch before it is yielded (or written to the
        buffer). Default ``None``.
    split_trajs: yield ``split_trajectories(batch)`` (one row per trajectory, padded, with
        a ``("collector", "mask")``). Default ``False``.
    exploration_type: the ``ExplorationType`` (or its name) every rollout runs under; it
        decides how a probabilistic policy picks its action. Default ``"random"``.
    set_truncated: mark the last step of each batch truncated and start new trajectories
        at the next batch. Default ``False``.
    use_buffers: with ``return_same_td=True`` (or a replay buffer), refill one preallocated
        batch; otherwise each batch is filled in fresh memory and yielded without a copy.
        ``False`` allocates a fresh batch each time. Default ``True``.
    return_same_td: yield the same ``TensorDict`` every time, refilled in place (faster;
        copy what you keep: ``batch.clone()``). Default ``False``.
    replay_buffer: any object with ``extend()`` (rlcollect's or torchrl's ``ReplayBuffer``):
        batches are written there and iteration yields ``None``. Default ``None``.
    extend_buffer: with ``replay_buffer``, ``True`` (the default) calls ``extend`` once per
        batch; ``False`` calls ``add`` once per time step (torchrl's semantics).
    trust_policy: ``True`` calls the policy with the tensordict as it is, whatever its type
        or signature (no matching of observation keys); ``None``/``False`` match. Default
        ``None``.
    compile_policy: ``True`` or a dict of ``torch.compile`` keyword arguments: the policy
        is wrapped in ``torch.compile``. Default ``None``.
    cudagraph_policy: ``True`` or a dict of ``tensordict.nn.CudaGraphModule`` keyword
        arguments: the policy is captured in a CUDA graph (needs a CUDA device). Default
        ``None``.
    no_cuda_sync: accepted for torchrl's sake (``True``/``False``); rlcollect never calls
        ``torch.cuda.synchronize()`` (copies to the policy's device are stream-ordered,
        copies back blocking), so either value gives the same data. Default ``False``.
    weight_sync_schemes: ``{"policy": scheme}`` (or attribute paths as model ids, like
        torchrl); ``NoWeightSyncScheme()`` makes updates no-ops. Default ``None``.
    track_policy_version: add ``("collector", "policy_version")`` to every frame: the
        number of ``update_policy_weights_`` calls its action was computed after. Default
        ``False``.
    worker_idx: this collector's index when it runs inside a multi-process collector (the
        multi-process collectors set it; it also offsets the trajectory ids). Default ``None``.
    traj_id_start: the first trajectory id; ``None``: ``worker_idx * 2**40`` (0 alone), so
        that ids from different workers never collide.
    reset_when_done: must be ``True`` (the default): an env is reset in the very step it
        ends. torchrl's ``False`` (leave ended envs to the user) is a ``ValueError``; use
        ``reset_at_each_iter=True`` or ``collector.reset()``.
    weight_updater: torchrl's ``WeightUpdaterBase`` (an instance, or its class), or a plain
        function, that moves the weights on ``update_policy_weights_`` instead of the
        schemes (exclusive with ``weight_sync_schemes``); the updater calls
        ``update_policy_weights_`` back. Default ``None``.
    pre_collect_hook: torchrl 0.14's: called with no argument before each batch (a
        settable attribute too). Default ``None``.
    post_collect_hook: torchrl 0.14's: called with each batch after ``postproc``, before it
        is yielded or written (settable; ``set_post_collect_hook``). Default ``None``.
    weight_recv_schemes: torchrl 0.14's; only ``None`` (its default) is accepted.
    track_traj_ids: ``False`` drops ``("collector", "traj_ids")`` (torchrl 0.14's). Default ``True``.
    compact_obs: torchrl 0.14's: drop the ``("next", ...)`` copies of root entries. Default ``False``.
    check_finite: NaN/inf in the env's rewards and float observations: ``None`` (default:
        not looked for), ``"first"`` (on the first step of each batch) or ``"every"`` step; one
        raises ``ValueError`` naming the worker (if any), the env row, the key and the step.
    trajs_per_batch: torchrl 0.14's: yield batches of this many whole trajectories (each
        ended by a done) instead of fixed-frame ones, assembled in this process from
        ``frames_per_batch``-frame collections, in the order they end; with ``replay_buffer``
        they are written there flat and iteration yields ``None`` per collection. Steps of
        trajectories not ended when the collection stops, or cut by a reset, are dropped
        (not with ``split_trajs``). Default ``None``: fixed-frame batches.
    trajs_per_write: with ``trajs_per_batch`` and ``replay_buffer``: trajectories per
        ``extend`` call. Default ``None``: all that ended, in one call.
    traj_format: with ``trajs_per_batch``: ``"padded"`` (``(trajectories, longest)``,
        zero-padded along time, with a boolean ``("collector", "mask")`` of the real steps)
        or ``"cat"`` (concatenated along time, no padding). Default ``None``: ``"padded"``
        (torchrl 0.14's; it warns that its default becomes ``"cat"``, rlcollect does not).
    interruptor: torchrl's: an object whose ``collection_stopped()`` is read after each step
        of a batch (torchrl's ``_Interruptor``, or any with that method); once it returns True
        the batch ends there: the steps not taken keep the batch's shape with
        ``("collector", "traj_ids")`` -1 and ``("collector", "mask")`` False (a key the
        batch then always has), and only the steps taken count as frames (torchrl counts the
        whole batch). A batch always takes its first step. Default ``None``.
    auto_register_policy_transforms: torchrl 0.14's: ``True`` appends to the torchrl env
        the transforms the policy needs and the env lacks: an ``InitTracker`` (``"is_init"``)
        for a module policy, and the ``TensorDictPrimer`` of each recurrent module
        (``LSTMModule``, ``GRUModule``); the env must be a torchrl env (a ``ValueError``
        otherwise). ``None`` (default) and ``False`` add nothing (torchrl's ``None`` also
        warns that its default will change; rlcollect does not).
    backend: torchrl's front door: ``"direct"`` (this collector), ``"process"`` (a
        ``MultiSyncCollector`` or ``MultiAsyncCollector``), ``"distributed"``,
        ``"submitit"`` or ``"ray"`` (a ``DistributedCollector`` with that launcher).
        Given this, ``num_collectors``, ``backend_options`` or ``sync``, ``Collector(...)``
        returns that backend's collector. Default ``None``: ``"process"`` if
        ``num_collectors`` is given, else ``"direct"``.
    num_collectors: the workers ("process") or nodes (the other backends) of the collector
        the front door builds. Default ``None``.
    backend_options: extra keyword arguments of that backend's collector (for ``"ray"``,
        ``ray_options`` among them). Default ``None``.
    sync: ``True`` builds a synchronous collector; torchrl's default is asynchronous.
        Default ``None``.

Example:
    >>> from rlcollect import Collector
    >>> collector = Collector("CartPole-v1", frames_per_batch=100, total_frames=300)
    >>> [batch.shape for batch in collector]
    [torch.Size([100]), torch.Size([100]), torch.Size([100])]
    >>> collector.shutdown()
"""
