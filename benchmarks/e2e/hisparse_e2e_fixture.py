"""Test fixture for the end-to-end benchmark: a tiny SGLang general plugin (entry point group
``sglang.srt.plugins``) that run_e2e.py makes discoverable in EVERY arm (a, b and c alike).

It wraps ``sglang.srt.model_loader.weight_utils.initialize_dummy_weights`` (used by
``--load-format dummy``) and

* with ``HISPARSE_E2E_WEIGHT_INIT=scaled`` (run_e2e.py's default) replaces SGLang's init by a
  deterministic, *meaningful* random init: every floating-point parameter gets its own generator
  seeded from (HISPARSE_E2E_WEIGHT_SEED, crc32(parameter name)); matrices ~ N(0, 1/fan_in)
  (embedding N(0, 0.1^2), lm_head N(0, (2/sqrt(fan_in))^2)), norm weights 1, biases 0.
  SGLang's own dummy init draws U(-1e-3, 1e-3) for every tensor with the SAME seed (1234) per
  tensor, so tensors of equal size are identical and, worse, every RMSNorm weight is ~1e-3: the
  attention contribution to the residual stream is ~1e-5 of the token embedding, the model is in
  effect a bigram table, greedy outputs collapse into short cycles and do not depend on the
  context at all - useless for checking that sparse attention over 8K-32K tokens is unchanged.
* with ``HISPARSE_E2E_WEIGHT_INIT=sglang`` keeps SGLang's init.

In both modes it prints one line ``[hisparse-e2e-fixture] weights ... fingerprint=<model class>:...`` to
stderr (the server log) after the init of each model (two with a speculative draft model), so run_e2e.py can
verify that all arms served identical weights, model by model.
At plugin-load time it also prints which ``sglang.srt.plugins`` entry points are visible.

With ``HISPARSE_E2E_PD_TRACE=1`` (the harness sets it on PD servers) it wraps SGLang's
``MooncakeKVManager.register_buffer_to_engine`` and logs, before the registration, one line
``[hisparse-e2e-fixture] pd-register {json}``: for the KV, aux (metadata) and state (index-K) regions the
manager registers with Mooncake, their count, bytes, and bytes per memory kind as the CUDA driver sees
each address (``cuPointerGetAttribute``: host = pinned host memory, device = GPU memory, pageable = not
known to CUDA). That is what shows where the prefill's KV writes land on the decode instance.

With ``HISPARSE_E2E_KV_CHECK=<N>`` (a server with the plugin) every N-th decode batch is checked row by
row against the host pool, and ``HISPARSE_E2E_KERNEL_DEFINES`` builds the plugin's kernels as a test
variant: ``kv_check_fixture.py``.

With ``HISPARSE_E2E_SYNC_TRACE=<first>:<count>`` (profiling, any arm) it also finds every host wait of
the scheduler's decode loop: from decode batch ``first`` on, for ``count`` decode batches, PyTorch's
sync debug mode is on (``torch.cuda.set_sync_debug_mode("warn")``) and each synchronizing CUDA call is
recorded with its Python stack; then one line ``[hisparse-e2e-fixture] sync-trace {json}`` gives the
distinct stacks and how often each was hit.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import sys
import traceback
import zlib

PREFIX = "[hisparse-e2e-fixture]"
TARGET = "sglang.srt.model_loader.weight_utils.initialize_dummy_weights"


def _say(msg: str) -> None:
    print(f"{PREFIX} pid={os.getpid()} {msg}", file=sys.stderr, flush=True)


def _param_seed(base: int, name: str) -> int:
    return (base * 1_000_003 + zlib.crc32(name.encode("utf-8"))) % (1 << 62)


def _std_for(name: str, shape) -> float:
    fan_in = int(shape[-1])
    if "embed_tokens" in name:
        return 0.1
    if "lm_head" in name:
        return 2.0 / math.sqrt(fan_in)
    return 1.0 / math.sqrt(fan_in)


def scaled_init(model, seed: int) -> int:
    import torch

    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not torch.is_floating_point(p):
                continue
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() <= 1:
                p.fill_(1.0)  # RMSNorm / LayerNorm weights
            else:
                gen = torch.Generator(device=p.device)
                gen.manual_seed(_param_seed(seed, name))
                tmp = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                tmp.normal_(0.0, _std_for(name, p.shape), generator=gen)
                p.copy_(tmp.to(p.dtype))
                del tmp
            n += 1
    return n


def fingerprint(model) -> tuple[int, int, float, float]:
    """(number of float params, elements, sum, sum of squares) in float64."""
    import torch

    count, elems, s, s2 = 0, 0, 0.0, 0.0
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if not torch.is_floating_point(p):
                continue
            x = p.detach().to(torch.float64)
            count += 1
            elems += x.numel()
            s += float(x.sum())
            s2 += float((x * x).sum())
    return count, elems, s, s2


def _around_init(original, model, *args, **kwargs):
    mode = os.environ.get("HISPARSE_E2E_WEIGHT_INIT", "scaled").strip().lower()
    seed = int(os.environ.get("HISPARSE_E2E_WEIGHT_SEED", "1234"))
    if mode == "scaled":
        n = scaled_init(model, seed)
        desc = f"mode=scaled seed={seed} params_initialised={n}"
    else:
        original(model, *args, **kwargs)
        desc = "mode=sglang (U(-1e-3,1e-3), seed 1234 per tensor)"
    try:
        count, elems, s, s2 = fingerprint(model)
        _say(f"weights {desc} params={count} elements={elems} fingerprint={type(model).__name__}:{s:.9e}/{s2:.9e}")
    except Exception as e:  # a fingerprint failure must never break serving
        _say(f"weights {desc} fingerprint=unavailable ({type(e).__name__}: {e})")


PD_REGISTER_TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.register_buffer_to_engine"
# CUpointer_attribute CU_POINTER_ATTRIBUTE_MEMORY_TYPE and its CUmemorytype values (cuda.h)
_MEMORY_TYPE_ATTRIBUTE = 2
_MEMORY_TYPES = {1: "host", 2: "device", 3: "array", 4: "unified"}


def memory_kinds(pointers: list[int]) -> list[str]:
    """Memory kind of each address as the CUDA driver reports it; "unknown" without a driver."""
    try:
        get = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute
    except (OSError, AttributeError):
        return ["unknown"] * len(pointers)
    get.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    get.restype = ctypes.c_int
    kinds = []
    for ptr in pointers:
        value = ctypes.c_uint(0)
        rc = get(ctypes.byref(value), _MEMORY_TYPE_ATTRIBUTE, int(ptr))
        # CUDA_ERROR_INVALID_VALUE (1): an address CUDA neither allocated nor registered
        kinds.append(_MEMORY_TYPES.get(value.value, f"type {value.value}") if rc == 0 else
                     "pageable" if rc == 1 else f"error {rc}")
    return kinds


def _regions(pointers, lengths) -> dict:
    pointers, lengths = list(pointers or []), list(lengths or [])
    by_kind: dict[str, int] = {}
    for kind, length in zip(memory_kinds(pointers), lengths):
        by_kind[kind] = by_kind.get(kind, 0) + int(length)
    return {"regions": len(pointers), "bytes": sum(int(x) for x in lengths), "by_kind": by_kind}


def _around_register(original, manager, *args, **kwargs):
    try:
        kv_args = manager.kv_args
        state = [_regions(p, n) for p, n in zip(getattr(kv_args, "state_data_ptrs", None) or [],
                                                getattr(kv_args, "state_data_lens", None) or [])]
        report = {"mode": str(getattr(manager, "disaggregation_mode", "?")),
                  "kv": _regions(kv_args.kv_data_ptrs, kv_args.kv_data_lens),
                  "kv_item_bytes": sorted(set(int(x) for x in kv_args.kv_item_lens or [])),
                  "aux": _regions(kv_args.aux_data_ptrs, kv_args.aux_data_lens), "state": state}
        _say("pd-register " + json.dumps(report))
    except Exception as e:  # the trace must never break serving
        _say(f"pd-register unavailable ({type(e).__name__}: {e})")
    return original(manager, *args, **kwargs)


class _SyncTrace:
    """Counts synchronizing CUDA calls by Python stack over a window of decode batches."""

    def __init__(self, spec: str) -> None:
        first, count = spec.split(":")
        self.first, self.last = int(first), int(first) + int(count)
        self.decode_batches = 0
        self.stacks: dict[str, int] = {}
        self.active = False
        self._saved_showwarning = None

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing" not in str(message):
            return self._saved_showwarning(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings.py" not in f.filename]
        key = " <- ".join(
            f"{f.filename.split('site-packages/')[-1].split('/src/')[-1]}:{f.lineno}:{f.name}"
            for f in reversed(frames[-14:])
        )
        self.stacks[key] = self.stacks.get(key, 0) + 1

    def _start(self) -> None:
        import warnings

        import torch

        self._saved_showwarning = warnings.showwarning
        warnings.showwarning = self._record
        self._filters = warnings.filters[:]
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        self.active = True

    def _stop(self) -> None:
        import warnings

        import torch

        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._saved_showwarning
        warnings.filters[:] = self._filters
        self.active = False
        ranked = sorted(self.stacks.items(), key=lambda kv: -kv[1])
        _say("sync-trace " + json.dumps({
            "decode_batches": self.last - self.first,
            "syncs": sum(self.stacks.values()),
            "stacks": [{"count": n, "stack": k} for k, n in ranked[:20]],
        }))

    def around_run_batch(self, original, scheduler, batch, *args, **kwargs):
        is_decode = batch is not None and batch.forward_mode.is_decode()
        if is_decode:
            self.decode_batches += 1
            if self.decode_batches == self.first and not self.active:
                self._start()
            elif self.decode_batches == self.last and self.active:
                self._stop()
        return original(scheduler, batch, *args, **kwargs)


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``), called by sglang.srt.plugins.load_plugins()."""
    try:
        from importlib.metadata import entry_points

        eps = sorted(f"{ep.name}={ep.value}" for ep in entry_points(group="sglang.srt.plugins"))
        _say(f"visible sglang.srt.plugins entry points: {eps}")
    except Exception as e:
        _say(f"could not list entry points: {e}")
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _around_init, HookType.AROUND)
    if os.environ.get("HISPARSE_E2E_PD_TRACE") == "1":
        HookRegistry.register(PD_REGISTER_TARGET, _around_register, HookType.AROUND)
        _say(f"PD trace on: AROUND hook on {PD_REGISTER_TARGET}")
    import kv_check_fixture  # copied beside this module by the harness (arms.prepare_pyext)

    kv_check_fixture.install(HookRegistry, HookType)
    sync_trace = os.environ.get("HISPARSE_E2E_SYNC_TRACE")
    if sync_trace:
        HookRegistry.register(
            "sglang.srt.managers.scheduler.Scheduler.run_batch", _SyncTrace(sync_trace).around_run_batch,
            HookType.AROUND,
        )
        _say(f"sync trace on (HISPARSE_E2E_SYNC_TRACE={sync_trace})")
    _say(f"registered AROUND hook on {TARGET} "
         f"(HISPARSE_E2E_WEIGHT_INIT={os.environ.get('HISPARSE_E2E_WEIGHT_INIT', 'scaled')})")
