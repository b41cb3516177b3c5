"""``hisparse-plan``: size a HiSparse deployment before starting it.

From a model (a name this module knows, or a config.json), the GPUs, the host memory, the parallel
layout, the KV dtype, ``--mem-fraction-static`` and the ``--hisparse-config``, it computes per scheduler
process (rank) what SGLang and this package will allocate: SGLang's GPU KV pool (SGLang 0.5.17-0.5.23
size it from the bytes per token ``layers x (KV row + indexer key row x host_to_device_ratio)``), the
host pool per rank and per node, the buffer tables, the longest request, how many requests of a given
length can decode at once with and without HiSparse, and how long pinning the host pool takes. It runs
the package's own start-up checks on those numbers (``HiSparseConfig``, ``limits.check_host_pool``,
``limits.check_device_pool``) and says which choice wastes memory or cannot start. docs/sizing.md
explains every figure and the sources of the built-in model numbers.

Imports no SGLang (tests/sglang/test_plan_sglang.py compares the arithmetic with SGLang's own sizing code).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.errors import HiSparseConfigError, HiSparseError, HiSparseMemoryError
from hisparse_sglang.integration.sglang import limits
from hisparse_sglang.ops.swap_in_plan import MAX_VERIFY_POSITIONS

__all__ = ["ModelShape", "KNOWN_MODELS", "PlanInput", "Plan", "plan", "model_shape", "main"]

GIB = 2**30
# Host-pool pinning rate measured by benchmarks/bench_host_pool.py (16 GiB in 1.05 s with 16 threads on
# an H200 machine, 2026-11-24; docs/lab-notes/gpu-e2e-2026-11-24.md, "Host pool start-up").
PIN_RATE_GIB_S = 15.3
# SGLang's DSA indexer keys (DSATokenToKVPool): index_head_dim fp8 bytes plus one fp32 scale per block
# of this many values, per token and layer, in GPU memory.
INDEX_K_QUANT_BLOCK = 128
INDEX_K_SCALE_BYTES = 4
# SGLang's default request slots per DP group: token capacity / context length x 512, within [2048, 4096],
# at most half the token capacity (KVCacheConfigurator.resolve_max_num_reqs, 0.5.17-0.5.23).
REQ_SLOTS_PER_CONTEXT = 512
REQ_SLOTS_MIN, REQ_SLOTS_MAX = 2048, 4096
# The coordinator refuses buffer tables larger than this share of the GPU memory free after the KV pool.
TABLES_SHARE_OF_FREE = 0.5
KV_DTYPES = ("bf16", "fp8")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What sizing needs from a DSA model's config.json.

    Attributes:
        layers: ``num_hidden_layers`` (layers with a KV cache; the NextN / MTP layers add theirs only with
            speculative decoding, see ``nextn_layers``).
        nextn_layers: ``num_nextn_predict_layers``: the draft layers EAGLE / NextN MTP runs. With HiSparse their
            KV stays on the GPU over the whole logical space (``host_to_device_ratio`` rows per GPU token, no host
            rows; docs/speculative.md 2.6).
        kv_lora_rank, qk_rope_head_dim: the MLA latent row (512 + 64 values).
        index_topk: the indexer's top-k (HiSparse's ``top_k``).
        index_head_dim: the indexer key width (its cache stays in GPU memory).
        context_length: ``max_position_embeddings``.
        params_billion: parameters of the released checkpoint (for the weight estimate), None if unknown.
        fp8_weights: the released checkpoint stores its weights in fp8 (1 byte per parameter).
    """

    name: str
    layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_topk: int
    index_head_dim: int
    context_length: int
    params_billion: float | None = None
    fp8_weights: bool = True
    nextn_layers: int = 0


# Numbers of the public config.json files (docs/sizing.md gives the source of each).
KNOWN_MODELS = {
    "DeepSeek-V3.2": ModelShape("DeepSeek-V3.2", layers=61, kv_lora_rank=512, qk_rope_head_dim=64, index_topk=2048,
                                index_head_dim=128, context_length=163840, params_billion=685, nextn_layers=1),
    "GLM-5": ModelShape("GLM-5", layers=78, kv_lora_rank=512, qk_rope_head_dim=64, index_topk=2048,
                        index_head_dim=128, context_length=202752, params_billion=744, nextn_layers=1),
}


def model_shape(model: str) -> ModelShape:
    """A built-in model by name (case-insensitive), or the DSA fields of a config.json (file or directory)."""
    for name, shape in KNOWN_MODELS.items():
        if model.lower() in (name.lower(), name.lower().replace("-", "")):
            return shape
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise HiSparseConfigError(
            f"model {model!r} is neither a known name ({', '.join(KNOWN_MODELS)}) nor a config.json or a directory "
            f"holding one."
        )
    config = json.loads(path.read_text())
    missing = [key for key in ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim", "index_topk", "index_head_dim")
               if key not in config]
    if missing:
        raise HiSparseConfigError(
            f"{path} has no {', '.join(missing)}: HiSparse serves DeepSeek Sparse Attention models (MLA with an "
            f"indexer), such as {' and '.join(KNOWN_MODELS)}."
        )
    return ModelShape(
        name=str(path.parent.name), layers=config["num_hidden_layers"], kv_lora_rank=config["kv_lora_rank"],
        qk_rope_head_dim=config["qk_rope_head_dim"], index_topk=config["index_topk"],
        index_head_dim=config["index_head_dim"], context_length=config.get("max_position_embeddings", 0),
        nextn_layers=int(config.get("num_nextn_predict_layers", 0) or 0),
    )


def kv_row_bytes(shape: ModelShape, kv_dtype: str) -> int:
    """Bytes of one token of one layer in the KV pool (GPU) and the host pool (the package's row sizes)."""
    from hisparse_sglang.memory import BF16_MLA_ITEM_BYTES, FP8_DSA_ITEM_BYTES

    if (shape.kv_lora_rank, shape.qk_rope_head_dim) != (512, 64):
        raise HiSparseConfigError(
            f"{shape.name}: kv_lora_rank {shape.kv_lora_rank} + qk_rope_head_dim {shape.qk_rope_head_dim}; the host "
            f"pool and the swap-in handle the 512 + 64 MLA row of DeepSeek-V3.2 and GLM-5 only."
        )
    return BF16_MLA_ITEM_BYTES if kv_dtype == "bf16" else FP8_DSA_ITEM_BYTES


def index_key_bytes(shape: ModelShape) -> int:
    """GPU bytes of one token's indexer key in one layer."""
    return shape.index_head_dim + shape.index_head_dim // INDEX_K_QUANT_BLOCK * INDEX_K_SCALE_BYTES


def bytes_per_device_token(shape: ModelShape, kv_dtype: str, host_to_device_ratio: int, draft_layers: int = 0) -> int:
    """GPU bytes SGLang budgets per token of its KV pool: the KV row of every layer and the indexer keys of
    ``host_to_device_ratio`` logical tokens (1 without HiSparse); with speculative decoding also the draft's
    ``draft_layers`` (:func:`draft_layers`), whose pool holds KV row and indexer key of every logical token
    (SGLang's own count of the draft layers plus what the plugin's hook H8 adds to it)."""
    row, key = kv_row_bytes(shape, kv_dtype), index_key_bytes(shape)
    return shape.layers * (row + key * host_to_device_ratio) + draft_layers * (row + key) * host_to_device_ratio


@dataclasses.dataclass(frozen=True)
class PlanInput:
    """One deployment to size. Memory in GiB; ``weights_gib`` per GPU (None: estimated from the model)."""

    model: ModelShape
    gpu_mem_gib: float
    host_mem_gib: float
    tp: int = 8
    dp: int = 1
    gpus_per_node: int = 8
    kv_dtype: str = "bf16"
    mem_fraction_static: float = 0.85
    context_length: int | None = None
    hisparse_config: str = ""
    prompt_len: int = 16384
    output_len: int = 1024
    weights_gib: float | None = None
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    pd_decode: bool = False
    num_reserved_decode_tokens: int = 512
    speculative_num_draft_tokens: int = 1


@dataclasses.dataclass
class Plan:
    """Per rank unless a name says otherwise; ``warnings`` say what wastes memory, ``errors`` what cannot start."""

    config: HiSparseConfig | None
    ranks_per_node: int
    host_pools_per_node: int
    weights_gib: float | None
    kv_budget_gib: float | None
    bytes_per_token_without: int
    bytes_per_token_with: int
    device_tokens_without: int
    device_tokens_with: int
    kv_gib_with: float
    index_key_share: float
    logical_tokens: int
    host_rows: int
    host_pool_gib: float
    host_pool_node_gib: float
    pin_seconds: float
    pin_seconds_node: float
    request_slots: int
    buffers: int
    buffer_tables_gib: float
    longest_request_without: int
    longest_request_with: int
    longest_prompt_with: int
    concurrent_without: int
    concurrent_with: int
    concurrency_bounds: dict
    suggested_ratio: int | None
    hisparse_config_json: str
    warnings: list
    errors: list

    def as_dict(self) -> dict:
        values = dataclasses.asdict(self)
        values["config"] = json.loads(self.config.to_json()) if self.config else None
        return values


def _page_floor(tokens: float, page_size: int) -> int:
    return max(0, int(tokens)) // page_size * page_size


def _request_slots(device_tokens: int, context_length: int, requested: int | None, dp: int) -> int:
    if requested is not None:
        return min(max(1, requested // dp), device_tokens // 2)
    estimated = max(min(int(device_tokens / context_length * REQ_SLOTS_PER_CONTEXT), REQ_SLOTS_MAX), REQ_SLOTS_MIN)
    return min(estimated, device_tokens // 2)


def _weights_gib(spec: PlanInput) -> float | None:
    """GPU memory of the weights per GPU: given, estimated from the checkpoint, or None (unknown: the GPU pool
    is then --max-total-tokens)."""
    if spec.weights_gib is not None:
        return spec.weights_gib
    if spec.model.params_billion is not None:
        bytes_per_param = 1 if spec.model.fp8_weights else 2
        return spec.model.params_billion * 1e9 * bytes_per_param / spec.tp / GIB
    if spec.max_total_tokens is not None:
        return None
    raise HiSparseConfigError(
        f"the weights of {spec.model.name} are unknown: pass --weights-gib (GPU memory the weights take per GPU; "
        f"SGLang logs it at start-up as 'Load weight end ... mem usage') or --max-total-tokens."
    )


def _device_tokens(spec: PlanInput, budget_bytes: float, per_token: int, page_size: int) -> int:
    """SGLang's GPU KV pool: the budget over the bytes per token, whole pages, capped by --max-total-tokens."""
    tokens = _page_floor(budget_bytes / per_token, page_size) if math.isfinite(budget_bytes) else math.inf
    if spec.max_total_tokens is not None:
        tokens = min(tokens, _page_floor(spec.max_total_tokens, page_size))
    return int(tokens)


def _concurrency(tokens_per_request: int, device_tokens: int, logical_tokens: int, buffers: int, slots: int,
                 fits_a_buffer: bool) -> tuple[int, dict]:
    """Requests of ``tokens_per_request`` tokens decoding at once in one DP group, with HiSparse, and each bound."""
    if fits_a_buffer:  # never offloaded: resident like without HiSparse
        bounds = {"gpu_kv_pool": device_tokens // tokens_per_request}
    else:
        bounds = {"gpu_buffers": buffers, "host_pool": logical_tokens // tokens_per_request}
    bounds["request_slots"] = slots
    return min(bounds.values()), bounds


def draft_layers(spec: PlanInput) -> int:
    """The draft's KV layers: the model's NextN layers with speculative decoding (``speculative_num_draft_tokens``
    > 1), else 0. Raises for a draft-token count the verify swap-in cannot serve or a model without a NextN
    layer."""
    shape, draft_tokens = spec.model, spec.speculative_num_draft_tokens
    if not 1 <= draft_tokens <= MAX_VERIFY_POSITIONS:
        raise HiSparseConfigError(
            f"--speculative-num-draft-tokens {draft_tokens}: HiSparse's verify swap-in serves 1 to "
            f"{MAX_VERIFY_POSITIONS} positions per request (--speculative-num-steps 1-3 with topk 1)."
        )
    if draft_tokens == 1:
        return 0
    if not shape.nextn_layers:
        raise HiSparseConfigError(
            f"{shape.name} has no NextN layer (num_nextn_predict_layers 0): EAGLE / NextN MTP needs one; "
            f"drop --speculative-num-draft-tokens."
        )
    return shape.nextn_layers


def _bytes_per_token(spec: PlanInput, host_to_device_ratio: int) -> int:
    """:func:`bytes_per_device_token` of ``spec``'s model, KV dtype and draft layers at ``host_to_device_ratio``."""
    return bytes_per_device_token(spec.model, spec.kv_dtype, host_to_device_ratio, draft_layers(spec))


def plan(spec: PlanInput) -> Plan:
    """Size ``spec``; never raises for a setting that cannot start (it lands in ``errors``), only for a model
    or a config that cannot be read at all."""
    errors, warnings = [], []
    shape, drafts = spec.model, draft_layers(spec)
    if spec.kv_dtype not in KV_DTYPES:
        raise HiSparseConfigError(f"kv dtype {spec.kv_dtype!r}: use one of {', '.join(KV_DTYPES)}.")
    if spec.tp < 1 or spec.dp < 1 or spec.tp % spec.dp:
        raise HiSparseConfigError(f"--tp ({spec.tp}) must be a positive multiple of --dp ({spec.dp}).")
    try:
        config = HiSparseConfig.from_json(spec.hisparse_config or None, model_index_topk=shape.index_topk)
    except HiSparseConfigError as exc:
        errors.append(f"--hisparse-config: {exc}")
        config = None
    effective = config or HiSparseConfig(
        top_k=shape.index_topk, device_buffer_size=2 * shape.index_topk
    )
    page, ratio = effective.page_size, effective.host_to_device_ratio
    context = spec.context_length or shape.context_length
    row = kv_row_bytes(shape, spec.kv_dtype)
    ranks_per_node = min(spec.gpus_per_node, spec.tp)
    shared = effective.share_host_pool_across_tp and spec.dp == 1
    pools_per_node = limits.host_pools_on_host(["node"] * ranks_per_node, "node", shared)

    weights = _weights_gib(spec)
    # SGLang: the GPU memory free after loading the weights less (1 - mem_fraction_static) of the memory free
    # before; with the whole GPU free before loading, that is gpu x fraction - weights.
    budget_gib = math.inf if weights is None else spec.gpu_mem_gib * spec.mem_fraction_static - weights
    if budget_gib <= 0:
        errors.append(
            f"the weights ({weights:.1f} GiB per GPU) leave no KV memory under --mem-fraction-static "
            f"{spec.mem_fraction_static} on a {spec.gpu_mem_gib:g} GiB GPU: raise --mem-fraction-static, or spread "
            f"the weights over more GPUs (--tp)."
        )
    budget = max(budget_gib, 0) * GIB
    per_token_without = _bytes_per_token(spec, 1)
    per_token_with = _bytes_per_token(spec, ratio)
    tokens_without = _device_tokens(spec, budget, per_token_without, page)
    tokens_with = _device_tokens(spec, budget, per_token_with, page)

    from hisparse_sglang.integration.sglang.runtime import host_pages_for
    from hisparse_sglang.memory import DeviceBufferPool

    def host_bytes(host_ratio: int) -> int:
        return host_pages_for(tokens_with, host_ratio, page) * page * shape.layers * row

    logical = tokens_with * ratio
    host_rows = host_pages_for(tokens_with, ratio, page) * page
    pool_bytes = host_bytes(ratio)
    try:
        limits.check_host_pool(pool_bytes, pools_per_node, host_bytes, ratio,
                               limits.HostMemory(int(spec.host_mem_gib * GIB), "--host-mem-gib"))
    except HiSparseMemoryError as exc:
        errors.append(f"host memory: {exc}")
    try:
        limits.check_device_pool(tokens_with // page, effective)
    except HiSparseMemoryError as exc:
        errors.append(f"GPU KV pool: {exc}")

    slots = _request_slots(tokens_with, context, spec.max_running_requests, spec.dp)
    buffers = min(slots, tokens_with // effective.padded_buffer_size)
    tables = DeviceBufferPool.table_bytes(shape.layers, slots, buffers, effective.device_buffer_size, page, context)
    free_after_pool_gib = spec.gpu_mem_gib * (1 - spec.mem_fraction_static)
    if tables > TABLES_SHARE_OF_FREE * free_after_pool_gib * GIB:
        errors.append(
            f"the buffer tables need {tables / GIB:.2f} GiB of GPU memory, more than {TABLES_SHARE_OF_FREE:.0%} of the "
            f"{free_after_pool_gib:.1f} GiB left outside the KV pool: the coordinator refuses to start. Lower "
            f"--mem-fraction-static or --context-length, or raise device_buffer_size (fewer, larger buffers)."
        )

    request = spec.prompt_len + spec.output_len
    request_pages = -(-request // page) * page
    fits = request - 1 < effective.device_buffer_size
    concurrent_without = min(tokens_without // request_pages, _request_slots(tokens_without, context,
                                                                               spec.max_running_requests, spec.dp))
    concurrent_with, bounds = _concurrency(request_pages, tokens_with, logical, buffers, slots, fits)

    if spec.pd_decode:  # limits.decode_request_capacity: the logical pool less SGLang's decode reserve
        longest_with = min(context, (logical - spec.num_reserved_decode_tokens) // page * page)
        longest_prompt_with = longest_with
    else:  # co-located: the prefill writes the whole prompt into the GPU pool (limits.colocated_note)
        longest_with = min(context, logical)
        longest_prompt_with = min(longest_with, tokens_with)
    longest_without = min(context, tokens_without)

    if spec.pd_decode and longest_with < page:
        errors.append(
            f"the logical pool ({logical} tokens) leaves less than a page after --num-reserved-decode-tokens "
            f"({spec.num_reserved_decode_tokens}): raise host_to_device_ratio."
        )
    if request > longest_with or spec.prompt_len > longest_prompt_with:
        errors.append(
            f"a request of {spec.prompt_len} + {spec.output_len} tokens is longer than this setup serves with HiSparse "
            f"(prompts up to {longest_prompt_with}, prompt + output up to {longest_with}"
            + (")" if spec.pd_decode else "; a co-located server prefills the whole prompt into the GPU KV pool)")
        )
    if fits:
        warnings.append(
            f"requests of {request} tokens fit the device buffer ({effective.device_buffer_size}): they are never "
            f"offloaded, so HiSparse only costs GPU memory for indexer keys ({tokens_without - tokens_with} fewer GPU "
            f"tokens) and host memory here."
        )
    index_share = (shape.layers + drafts) * index_key_bytes(shape) * ratio / per_token_with
    if index_share > 0.3:
        warnings.append(
            f"the indexer keys of the logical pool take {index_share:.0%} of the GPU KV budget (host_to_device_ratio "
            f"{ratio} x {index_key_bytes(shape)} B per token and layer): a larger ratio shrinks the GPU pool."
        )

    suggested = _suggest_ratio(spec, shape, effective, budget, request_pages, fits, pools_per_node, host_bytes_for=(
        lambda tokens, host_ratio: host_pages_for(tokens, host_ratio, page) * page * shape.layers * row))
    if suggested is not None and suggested != ratio and not fits and tokens_with > 0:
        best = _concurrency_at_ratio(spec, shape, effective, budget, request_pages, suggested)
        if best > concurrent_with or (best == concurrent_with and suggested < ratio):
            warnings.append(
                f"host_to_device_ratio {ratio} gives {concurrent_with} concurrent requests of {request} tokens per DP "
                f"group; {suggested} gives {best}" + (" with less host memory" if suggested < ratio else "") + "."
            )
    if bounds.get("host_pool", math.inf) > 1.5 * bounds.get("gpu_buffers", math.inf):
        warnings.append(
            f"the host pool holds {bounds['host_pool']} requests of {request} tokens but only {buffers} GPU buffers "
            f"exist: {(1 - bounds['gpu_buffers'] / bounds['host_pool']):.0%} of the host pool stays unused at this "
            f"length."
        )
    suggested_json = json.dumps(
        {"top_k": effective.top_k, "device_buffer_size": effective.device_buffer_size,
         "host_to_device_ratio": suggested or ratio}, separators=(", ", ": "))
    return Plan(
        config=config, ranks_per_node=ranks_per_node, host_pools_per_node=pools_per_node, weights_gib=weights,
        kv_budget_gib=None if weights is None else budget_gib, bytes_per_token_without=per_token_without,
        bytes_per_token_with=per_token_with,
        device_tokens_without=tokens_without, device_tokens_with=tokens_with,
        kv_gib_with=tokens_with * per_token_with / GIB, index_key_share=index_share, logical_tokens=logical,
        host_rows=host_rows, host_pool_gib=pool_bytes / GIB, host_pool_node_gib=pool_bytes * pools_per_node / GIB,
        pin_seconds=pool_bytes / GIB / PIN_RATE_GIB_S,
        pin_seconds_node=pool_bytes * pools_per_node / GIB / PIN_RATE_GIB_S,
        request_slots=slots, buffers=buffers, buffer_tables_gib=tables / GIB, longest_request_without=longest_without,
        longest_request_with=longest_with, longest_prompt_with=longest_prompt_with,
        concurrent_without=concurrent_without * spec.dp,
        concurrent_with=concurrent_with * spec.dp, concurrency_bounds=bounds, suggested_ratio=suggested,
        hisparse_config_json=suggested_json, warnings=warnings, errors=errors,
    )


def _concurrency_at_ratio(spec, shape, config, budget, request_pages, ratio) -> int:
    """Concurrent requests per DP group with ``host_to_device_ratio`` = ``ratio`` (everything else as given)."""
    page = config.page_size
    tokens = _device_tokens(spec, budget, _bytes_per_token(spec, ratio), page)
    slots = _request_slots(tokens, spec.context_length or shape.context_length, spec.max_running_requests, spec.dp)
    buffers = min(slots, tokens // config.padded_buffer_size)
    return _concurrency(request_pages, tokens, tokens * ratio, buffers, slots, False)[0]


def _suggest_ratio(spec, shape, config, budget, request_pages, fits, pools_per_node, host_bytes_for) -> int | None:
    """The smallest host_to_device_ratio with the most concurrent requests of this length whose host pools fit
    the host (limits.check_host_pool); None when even 1 does not fit or requests never offload."""
    if fits:
        return None
    best, best_count = None, -1
    memory = limits.HostMemory(int(spec.host_mem_gib * GIB), "--host-mem-gib")
    for ratio in range(1, 1025):
        page = config.page_size
        tokens = _device_tokens(spec, budget, _bytes_per_token(spec, ratio), page)
        try:
            limits.check_host_pool(host_bytes_for(tokens, ratio), pools_per_node,
                                   lambda other, tokens=tokens: host_bytes_for(tokens, other), ratio, memory)
        except HiSparseMemoryError:
            break  # a larger ratio needs more host memory still
        count = _concurrency_at_ratio(spec, shape, config, budget, request_pages, ratio)
        if count > best_count:
            best, best_count = ratio, count
        elif tokens * ratio >= request_pages * count * 2:
            break  # the host pool is already twice what the GPU buffers can use
    return best


# ------------------------------------------------------------------------------------------ CLI
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hisparse-plan",
        description=(
            "Size a HiSparse deployment of SGLang 0.5.17-0.5.23: the GPU KV pool, the host pool per rank and\n"
            "per node, the longest request, the concurrent requests of a given length with and without\n"
            "HiSparse, the host-pool pinning time at start-up, and the --hisparse-config to use, with a\n"
            "warning where a choice wastes memory and CANNOT START where the plugin or SGLang would refuse it.\n"
            "Figures are per scheduler process (one GPU) unless they say otherwise; docs/sizing.md explains\n"
            "them. Exit status: 0, 1 when the setup cannot start, 2 when the model or an option is unusable."
        ),
        epilog=(
            "examples:\n"
            "  hisparse-plan DeepSeek-V3.2 --gpu-mem-gib 139.8 --host-mem-gib 1800 --tp 8\n"
            "  hisparse-plan GLM-5 --gpu-mem-gib 139.8 --host-mem-gib 1800 --tp 8 --dp 8 --kv-dtype fp8 \\\n"
            "      --hisparse-config '{\"host_to_device_ratio\": 8}' --prompt-len 65536 --output-len 2048\n"
            "  hisparse-plan benchmarks/models/tiny-dsv32 --gpu-mem-gib 79.2 --host-mem-gib 120 --tp 1 \\\n"
            "      --max-total-tokens 131072 --mem-fraction-static 0.5 --context-length 65536 \\\n"
            "      --hisparse-config '{\"host_to_device_ratio\": 8}' --prompt-len 16384 --output-len 4096"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help=f"a model name ({', '.join(KNOWN_MODELS)}) or a config.json (or its directory)")
    hardware = parser.add_argument_group("hardware")
    hardware.add_argument("--gpu-mem-gib", type=float, required=True,
                          help="memory of one GPU, GiB (torch's total: H100 80GB 79.2, H200 139.8)")
    hardware.add_argument("--host-mem-gib", type=float, required=True,
                          help="host memory one node can give the server (its MemAvailable), GiB")
    hardware.add_argument("--gpus-per-node", type=int, default=8,
                          help="GPUs (scheduler processes) per node (default 8)")
    layout = parser.add_argument_group("SGLang server")
    layout.add_argument("--tp", type=int, default=8, help="--tp-size (default 8)")
    layout.add_argument("--dp", type=int, default=1,
                        help="--dp-size with --enable-dp-attention (default 1: no DP attention)")
    layout.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16",
                        help="KV cache dtype: bf16 (1152 B per token and layer) or fp8 (fp8_e4m3, 656 B)")
    layout.add_argument("--mem-fraction-static", type=float, default=0.85,
                        help="as SGLang's (default 0.85; SGLang's own default depends on the GPU)")
    layout.add_argument("--context-length", type=int, help="as SGLang's (default: the model's)")
    layout.add_argument("--max-total-tokens", type=int, help="as SGLang's: caps the GPU KV pool")
    layout.add_argument("--max-running-requests", type=int, help="as SGLang's (default: SGLang's own choice)")
    layout.add_argument("--weights-gib", type=float,
                        help="GPU memory of the weights per GPU, GiB (default: the model's fp8 checkpoint / --tp)")
    layout.add_argument("--pd-decode", action="store_true",
                        help="size a PD decode instance (--disaggregation-mode decode)")
    layout.add_argument("--num-reserved-decode-tokens", type=int, default=512,
                        help="as SGLang's (PD decode; default 512)")
    hisparse = parser.add_argument_group("HiSparse and the workload")
    hisparse.add_argument("--hisparse-config", default="", help="the --hisparse-config JSON (default: all defaults)")
    hisparse.add_argument("--prompt-len", type=int, default=16384, help="prompt tokens per request (default 16384)")
    hisparse.add_argument("--output-len", type=int, default=1024, help="output tokens per request (default 1024)")
    hisparse.add_argument("--speculative-num-draft-tokens", type=int, default=1, metavar="T",
                          help="as SGLang's, with EAGLE / NextN MTP (2-4; default 1: none): the draft's NextN layers "
                               "keep KV and indexer keys of every logical token on the GPU (device_buffer_size keeps "
                               "its 2 x top_k default)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def _report(spec: PlanInput, result: Plan) -> str:
    shape, drafts, ratio = spec.model, draft_layers(spec), (result.config.host_to_device_ratio if result.config else None)
    bounds = ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in result.concurrency_bounds.items())
    ranks = f"{spec.tp} rank{'s' if spec.tp > 1 else ''}" + (f", {spec.dp} DP-attention groups" if spec.dp > 1 else "")
    lines = [
        f"{shape.name}: {shape.layers} layers"
        + (f" + {drafts} NextN draft layer(s) ({spec.speculative_num_draft_tokens} draft tokens; their KV on the GPU "
           f"for every logical token)" if drafts else "")
        + f", {kv_row_bytes(shape, spec.kv_dtype)} B KV + {index_key_bytes(shape)} B "
        f"indexer key per token and layer ({spec.kv_dtype}); {ranks}, {result.ranks_per_node} per node",
        (f"  weights {result.weights_gib:.1f} GiB per GPU; KV budget {result.kv_budget_gib:.1f} GiB per GPU "
         f"(--mem-fraction-static {spec.mem_fraction_static})" if result.weights_gib is not None else
         f"  weights unknown: the GPU KV pool is --max-total-tokens {spec.max_total_tokens}"),
        "GPU KV pool per rank:",
        f"  without HiSparse  {result.device_tokens_without:>12,} tokens "
        f"({result.bytes_per_token_without:,} B per token)",
        f"  with HiSparse     {result.device_tokens_with:>12,} tokens ({result.bytes_per_token_with:,} B per token, "
        f"{result.kv_gib_with:.2f} GiB; indexer keys {result.index_key_share:.0%} of it)",
        f"  buffer tables     {result.buffer_tables_gib:.2f} GiB for {result.buffers} buffers, "
        f"{result.request_slots} request slots",
        "Host pool (pinned):",
        f"  per rank {result.host_rows:,} rows = {result.host_pool_gib:,.1f} GiB (logical pool "
        f"{result.logical_tokens:,} tokens = GPU pool x {ratio}); per node {result.host_pools_per_node} pool(s) = "
        f"{result.host_pool_node_gib:,.1f} GiB of {spec.host_mem_gib:g}",
        f"  pinning at start-up: {result.pin_seconds:.1f} s per rank, {result.pin_seconds_node:.1f} s for the node's "
        f"pools at {PIN_RATE_GIB_S} GiB/s (benchmarks/bench_host_pool.py)",
        "Longest request (prompt + output):",
        f"  without HiSparse {result.longest_request_without:,}; with HiSparse {result.longest_request_with:,}"
        + (" (PD decode: the logical pool less the decode reserve)" if spec.pd_decode else
           f", its prompt at most {result.longest_prompt_with:,} (co-located: the prompt is prefilled into the "
           f"GPU pool)"),
        f"Concurrent requests of {spec.prompt_len} + {spec.output_len} tokens (per instance, upper bound from "
        f"the pools):",
        f"  without HiSparse {result.concurrent_without}; with HiSparse {result.concurrent_with} "
        "(per DP group: " + bounds + ")",
        "Config to use:",
        f"  --enable-hisparse --disable-radix-cache --hisparse-config '{result.hisparse_config_json}'",
    ]
    lines += [f"WARNING: {text}" for text in result.warnings]
    lines += [f"CANNOT START: {text}" for text in result.errors]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = PlanInput(
            model=model_shape(args.model), gpu_mem_gib=args.gpu_mem_gib, host_mem_gib=args.host_mem_gib, tp=args.tp,
            dp=args.dp, gpus_per_node=args.gpus_per_node, kv_dtype=args.kv_dtype,
            mem_fraction_static=args.mem_fraction_static, context_length=args.context_length,
            hisparse_config=args.hisparse_config, prompt_len=args.prompt_len, output_len=args.output_len,
            weights_gib=args.weights_gib, max_total_tokens=args.max_total_tokens,
            max_running_requests=args.max_running_requests, pd_decode=args.pd_decode,
            num_reserved_decode_tokens=args.num_reserved_decode_tokens,
            speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        )
        result = plan(spec)
    except HiSparseError as exc:
        print(f"hisparse-plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict(), indent=1) if args.json else _report(spec, result))
    return 1 if result.errors else 0


if __name__ == "__main__":
    sys.exit(main())
