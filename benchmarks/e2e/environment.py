"""The environment every server process gets: CUDA toolkit for the runtime JIT, offline flags, the FA3 guard."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

from common import Log


def purelib_of(python: str) -> str:
    return subprocess.run([python, "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True).stdout.strip()


def find_cuda_home(python: str) -> tuple[str | None, list[str]]:
    notes = []
    env_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cands = [env_home] if env_home else []
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(str(Path(os.path.realpath(nvcc)).parent.parent))
        with contextlib.suppress(Exception):  # `exec /x/bin/nvcc "$@"` wrapper scripts
            head = Path(nvcc).read_bytes()[:4096]
            if head.startswith(b"#!"):
                for m in re.finditer(rb"(/[^\s\"']+)/bin/nvcc", head):
                    cands.append(m.group(1).decode())
    cands += sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    purelib = purelib_of(python)
    if purelib:
        cands.append(f"{purelib}/nvidia/cu13")
    for c in cands:
        if c and os.path.isfile(f"{c}/bin/nvcc") and os.path.isfile(f"{c}/include/cuda_runtime.h"):
            return c, notes
        if c:
            notes.append(f"not a CUDA home: {c}")
    return None, notes


def build_jit_shim(shim: Path, cuda_home: str, python: str) -> dict:
    """Headers the toolkit lacks (flashinfer's JIT norm needs cublasLt.h, curand_kernel.h) are
    symlinked from the pip CUDA packages; unversioned libcudart.so/libcuda.so are provided for
    `-lcudart`/`-lcuda` if the toolkit has none."""
    inc, lib = shim / "include", shim / "lib"
    inc.mkdir(parents=True, exist_ok=True)
    lib.mkdir(parents=True, exist_ok=True)
    purelib = purelib_of(python)
    linked = []
    for d in sorted(glob.glob(f"{purelib}/nvidia/cu13/include")) + sorted(glob.glob(f"{purelib}/nvidia/*/include")):
        if os.path.realpath(d) == os.path.realpath(f"{cuda_home}/include"):
            continue
        for h in sorted(os.listdir(d)):
            if os.path.exists(f"{cuda_home}/include/{h}") or os.path.lexists(inc / h):
                continue
            os.symlink(f"{d}/{h}", inc / h)
            linked.append(h)

    def have(name: str) -> bool:
        for d in ("lib64", "lib", "lib64/stubs", "lib/stubs", "targets/x86_64-linux/lib",
                  "targets/x86_64-linux/lib/stubs"):
            if os.path.exists(f"{cuda_home}/{d}/{name}"):
                return True
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout if shutil.which("ldconfig") else ""
        return f" {name} " in out

    libs = []
    if not have("libcudart.so"):
        for c in sorted(glob.glob(f"{cuda_home}/lib*/libcudart.so.1*")) + sorted(glob.glob(f"{purelib}/nvidia/cu13/lib/libcudart.so.1*")):
            if not os.path.lexists(lib / "libcudart.so"):
                os.symlink(c, lib / "libcudart.so")
                libs.append(f"libcudart.so -> {c}")
            break
    if not have("libcuda.so"):
        for c in ["/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1",
                  "/usr/local/nvidia/lib64/libcuda.so.1", *sorted(glob.glob("/usr/local/nvidia/lib*/libcuda.so.1"))]:
            if os.path.exists(c):
                if not os.path.lexists(lib / "libcuda.so"):
                    os.symlink(c, lib / "libcuda.so")
                    libs.append(f"libcuda.so -> {c}")
                break
    return {"headers_linked": len(linked), "some_headers": linked[:12], "libs": libs}


def base_env(args, state: Path, log: Log) -> tuple[dict, dict]:
    """Environment shared by all arms (+ a description for the results)."""
    env = dict(os.environ)
    info = {}
    venv_bin = os.path.dirname(args.python) if os.path.isabs(args.python) else \
        subprocess.run([args.python, "-c", "import sysconfig;print(sysconfig.get_path('scripts'))"],
                       capture_output=True, text=True).stdout.strip()
    path = [venv_bin] if venv_bin else []
    cuda_home, notes = find_cuda_home(args.python)
    info["cuda_home"] = cuda_home
    if notes:
        info["cuda_home_notes"] = notes
    if cuda_home:
        env["CUDA_HOME"] = cuda_home
        path.append(f"{cuda_home}/bin")
        if not args.no_jit_shim:
            shim = state / "jit_shim"
            info["jit_shim"] = build_jit_shim(shim, cuda_home, args.python)
            env["CPATH"] = os.pathsep.join([str(shim / "include")] + ([env["CPATH"]] if env.get("CPATH") else []))
            env["LIBRARY_PATH"] = os.pathsep.join([str(shim / "lib")] + ([env["LIBRARY_PATH"]] if env.get("LIBRARY_PATH") else []))
    else:
        log("WARNING: no CUDA toolkit (nvcc + include/cuda_runtime.h) found; the runtime JIT "
            "(sglang.kernels.jit, flashinfer norm, DeepGEMM) will fail")
    env["PATH"] = os.pathsep.join(path + [env.get("PATH", "")])
    for tool in ("ninja", "c++", "nvcc"):
        found = shutil.which(tool, path=env["PATH"])
        info[f"which_{tool}"] = found
        if not found:
            log(f"WARNING: '{tool}' not on PATH (needed by the runtime JIT builds)")
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
        # Prefill with kv_len <= this would take the dense MHA path = FA3 from
        # sgl_kernel/flash_ops.abi3.so, which the bundle does not ship (1.1 GB).  0 keeps every
        # prefill on flashmla_sparse (what --enable-hisparse forces anyway).
        "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": str(args.dense_attn_threshold),
        # if FA3 is reached anyway: fail at once instead of trying a hub download
        "SGLANG_USE_SGL_FA3_KERNEL": "1",
        "HISPARSE_E2E_WEIGHT_INIT": args.weight_init,
        "HISPARSE_E2E_WEIGHT_SEED": str(args.weight_seed),
    })
    env.pop("SGLANG_PLUGINS", None)  # a whitelist would silently drop the fixture or the plugin
    env.pop("PYTHONPATH", None)
    return env, info


def mooncake_env(env0: dict, args) -> dict:
    """Environment of a PD server and of the Mooncake preflight: the bundle's system libraries
    (tools/gpu-bundle/install_part.sh links what the machine lacks into <--mooncake-syslibs>/lib) and torch's CUDA 13
    runtime on LD_LIBRARY_PATH; Mooncake's TCP transport (MC_FORCE_TCP, as SGLang's mooncake_tcp sets
    it); 127.0.0.1 as the address SGLang's connector announces (SGLANG_HOST_IP; the GPU machine has
    no network and no RDMA NIC)."""
    env = dict(env0)
    cu13 = f"{purelib_of(args.python)}/nvidia/cu13/lib"
    ld = [str(args.mooncake_syslibs / "lib")] + ([cu13] if os.path.isdir(cu13) else [])
    env.update(LD_LIBRARY_PATH=os.pathsep.join(ld + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else [])),
               MC_FORCE_TCP="1", SGLANG_HOST_IP="127.0.0.1")
    return env
