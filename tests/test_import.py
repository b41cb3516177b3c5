"""`import hisparse_sglang` has no side effects: no sglang, no CUDA initialisation, no compilation."""

import json
import subprocess
import sys
import textwrap


def test_import_is_free_of_side_effects(tmp_path):
    code = textwrap.dedent(
        """
        import json, os, sys
        import hisparse_sglang
        import hisparse_sglang.config, hisparse_sglang.memory, hisparse_sglang.ops.reference
        import hisparse_sglang.coordinator, hisparse_sglang.testing.sim
        import hisparse_sglang.integration.sglang.hooks  # the hook registry and every module of hook bodies
        import torch
        print(json.dumps({
            "sglang": sorted(m for m in sys.modules if m == "sglang" or m.startswith("sglang.")),
            "mooncake": sorted(m for m in sys.modules if m.startswith("mooncake")),
            "tvm_ffi": "tvm_ffi" in sys.modules,
            "cuda_initialized": torch.cuda.is_initialized(),
            "cache_entries": os.listdir(os.environ["HISPARSE_CACHE_DIR"]),
        }))
        """
    )
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {"HISPARSE_CACHE_DIR": str(cache), "PATH": "/usr/bin:/bin"}
    import os

    env.update({k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "HOME", "LD_LIBRARY_PATH")})
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["sglang"] == []
    assert report["mooncake"] == []
    assert report["tvm_ffi"] is False
    assert report["cuda_initialized"] is False
    assert report["cache_entries"] == []
