"""SGLang's own objects, built and driven as its scheduler does, on every supported release.

The tests under tests/sglang build real SGLang requests, caches, queues and server arguments and step
them the way SGLang's scheduler does; building them needs arguments and fields that differ between
releases. Those differences, which only the tests meet, are kept here; the ones the product meets are
in ``hisparse_sglang.integration.sglang.compat`` (docs/sglang-versions.md lists both).
"""

from __future__ import annotations

import dataclasses
import inspect


def disabled_prefix_cache(req_to_token_pool, allocator, page_size: int):
    """The prefix cache SGLang builds with ``--disable-radix-cache``: a ChunkCache up to 0.5.21; from
    0.5.22 (chunk_cache.py removed) a UnifiedRadixCache with ``disable=True``."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    params = CacheInitParams(
        disable=True, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator, page_size=page_size
    )
    try:
        from sglang.srt.mem_cache.chunk_cache import ChunkCache
    except ImportError:  # 0.5.22+
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        params.tree_components = (ComponentType.FULL,)
        return UnifiedRadixCache(params)
    return ChunkCache(params)


def release_kv_cache(req, tree_cache) -> None:
    """SGLang's release of a request's KV without caching it (``is_insert=False`` up to 0.5.21,
    ``checkpoint=False`` from 0.5.22)."""
    from sglang.srt.mem_cache import common

    keep = "checkpoint" if "checkpoint" in inspect.signature(common.release_kv_cache).parameters else "is_insert"
    common.release_kv_cache(req, tree_cache, **{keep: False})


def release_req(**kwargs):
    """SGLang's ``release_req`` (retraction); it took ``server_args`` up to 0.5.18 only."""
    from sglang.srt.managers.schedule_batch import release_req as sglang_release_req

    if "server_args" not in inspect.signature(sglang_release_req).parameters:
        kwargs.pop("server_args", None)
    return sglang_release_req(**kwargs)


def begin_prefill(req, prompt_len: int) -> None:
    """What SGLang records on a request whose prompt of ``prompt_len`` tokens was just prefilled
    into freshly allocated locations: its KV length (``req.kv`` is created here up to 0.5.18 and
    always present from 0.5.19) and its extend range (``extend_end`` from 0.5.22)."""
    if req.kv is None:
        from sglang.srt.managers.schedule_batch import ReqKvInfo

        req.kv = ReqKvInfo(kv_allocated_len=prompt_len, swa_evicted_seqlen=0)
    else:
        req.kv.kv_allocated_len = prompt_len
    set_extend_range(req, 0, prompt_len)
    set_kv_committed_len(req, prompt_len)


def set_extend_range(req, start: int, end: int) -> None:
    """The prompt positions ``[start, end)`` the request's current prefill (chunk) computes
    (``set_extend_range`` up to 0.5.21; ``prefix_len`` and ``extend_end`` from 0.5.22)."""
    if hasattr(req, "set_extend_range"):
        req.set_extend_range(start, end)
    else:
        req.prefix_len, req.extend_end = start, end


def disabled_stage_metrics():
    """A scheduler stage-metrics recorder that records nothing (a constructor argument of the PD
    queues from 0.5.21), or None before."""
    try:
        from sglang.srt.observability.scheduler_stage_metrics import SchedulerStageMetricsRecorder
    except ImportError:
        return None
    return SchedulerStageMetricsRecorder(enabled=False)


def set_kv_committed_len(req, length: int) -> None:
    if req.kv is not None and hasattr(req.kv, "kv_committed_len"):
        req.kv.kv_committed_len = length
    else:
        req.kv_committed_len = length


def retraction_backup(req):
    """The KV copy a retracted request keeps (``req.kv_cache_cpu`` in 0.5.17,
    ``req.retraction_backup`` in 0.5.18, ``req.kv.retraction_backup`` from 0.5.19), or None."""
    if hasattr(req, "kv_cache_cpu"):
        return req.kv_cache_cpu
    if hasattr(req, "retraction_backup"):
        return req.retraction_backup
    return getattr(req.kv, "retraction_backup", None)


def unresolved_server_args(**values):
    """A ServerArgs record with its declared defaults and ``values``, not resolved against a model
    (resolution reads the checkpoint and queries the GPU). From 0.5.19 construction leaves the
    record unresolved (``resolve_once`` resolves it); 0.5.17 and 0.5.18 resolve in ``__post_init__``,
    so there the record is filled field by field."""
    from sglang.srt.server_args import ServerArgs

    values.setdefault("model_path", "dummy")
    if hasattr(ServerArgs, "resolve_once"):
        return ServerArgs(**values)
    args = object.__new__(ServerArgs)
    for field in dataclasses.fields(ServerArgs):
        if field.default is not dataclasses.MISSING:
            setattr(args, field.name, field.default)
        elif field.default_factory is not dataclasses.MISSING:
            setattr(args, field.name, field.default_factory())
        else:
            setattr(args, field.name, None)
    for name, value in values.items():
        setattr(args, name, value)
    return args


def retraction_backup_is_configurable() -> bool:
    """Whether ServerArgs has ``disaggregation_decode_retraction_backup`` (0.5.18+)."""
    from sglang.srt.server_args import ServerArgs

    names = {field.name for field in dataclasses.fields(ServerArgs)} if dataclasses.is_dataclass(ServerArgs) else set()
    return "disaggregation_decode_retraction_backup" in names or hasattr(ServerArgs, "disaggregation_decode_retraction_backup")


def call(func, /, *args, optional: dict | None = None, **kwargs):
    """``func(*args, **kwargs, **optional)``, leaving out the ``optional`` keyword arguments the
    installed release's ``func`` no longer (or not yet) takes. SGLang's decode-side constructors
    dropped ``tp_rank``/``tp_size``/``dp_size``/``pp_rank`` (0.5.21) and ``gloo_group`` (0.5.22);
    ``initialize_model_parallel`` and ``initialize_dp_attention`` read the published config from
    0.5.21 instead of taking sizes and a model config."""
    parameters = inspect.signature(func).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for name, value in (optional or {}).items():
        if takes_any or name in parameters:
            kwargs[name] = value
    return func(*args, **kwargs)


def publish_single_rank_scheduler(server_args) -> None:
    """Publish ``server_args`` as the config of a one-rank scheduler process. From 0.5.21 the
    publisher also places the process (``SpawnRanks``); ranks are read from that placement."""
    from sglang.srt import runtime_context

    spawn_ranks = getattr(runtime_context, "SpawnRanks", None)
    if spawn_ranks is None:
        runtime_context.publish(server_args, role="scheduler")
    else:
        runtime_context.publish(server_args, role="scheduler", ranks=spawn_ranks(world_rank=0, dp_rank=None, gpu_id=0))


def resolve_deferred_releases(transfer_queue) -> None:
    """What ``process_decode_queue`` does every step from 0.5.20: release the KV of failed transfers
    whose prefill acknowledged that its writes drained (deferred by default from 0.5.21)."""
    resolve = getattr(transfer_queue, "resolve_deferred_releases", None)
    if resolve is not None:
        resolve()


def report_of_spawned(target, *args, name: str = "the child", timeout_s: float = 600, join_s: float = 60) -> dict:
    """Runs ``target(conn, *args)`` in a spawned process (a fresh interpreter, as SGLang starts a scheduler)
    and returns the one report it sends on ``conn``; the process is killed if it outlives ``join_s``."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    parent, child_conn = context.Pipe()
    child = context.Process(target=target, args=(child_conn, *args))
    child.start()
    try:
        assert parent.poll(timeout_s), f"{name} sent nothing within {timeout_s:g} s"
        return parent.recv()
    finally:
        child.join(timeout=join_s)
        if child.is_alive():
            child.kill()
