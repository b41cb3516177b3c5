"""The arms: what each server runs (argv, PYTHONPATH, environment) and the plugins it sees.

Arms a-d are one server each.  The PD arms are a pair on the one GPU: a prefill instance (SGLang, no
HiSparse, no plugin: arm a's flags) and a decode instance (arm c's flags for pd-c, arm b's for pd-b),
with their own --max-total-tokens and --mem-fraction-static, Mooncake over TCP on 127.0.0.1."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
from pathlib import Path

from common import HERE, HOST, REPO

DEFAULT_MODEL = REPO / "benchmarks" / "models" / "tiny-dsv32"
DEFAULT_HISPARSE_CONFIG = '{"top_k":2048,"device_buffer_size":4096,"host_to_device_ratio":8}'
DEFAULT_PLUGIN_EP = ("hisparse", "hisparse_sglang.integration.sglang.plugin:register")
FIXTURE_EP = ("hisparse_e2e_weight_init", "hisparse_e2e_fixture:register")
FIXTURE_MODULES = ("hisparse_e2e_fixture.py", "kv_check_fixture.py", "topk_workload_fixture.py")  # what every server imports from pyext-common
# topk_workload_fixture.py (--topk-profile): a second entry point, and the workload model beside it
TOPK_FIXTURE_EP = ("hisparse_e2e_topk_workload", "topk_workload_fixture:register")
TOPK_WORKLOAD_SOURCE = REPO / "src/hisparse_sglang/testing/workload.py"  # copied as topk_workload_fixture.WORKLOAD_COPY
# "<arm>+mtp": the arm with speculative decoding (EAGLE / NextN MTP, topk 1, --mtp-steps) on a copy of the
# model whose config declares one NextN layer (prepare_mtp_model); everything else as the arm's. In
# "pd-c+mtp" both instances run it, as SGLang's PD with MTP needs: the prefill runs the draft's first step.
MTP_SUFFIX = "+mtp"
MTP_ARMS = ("a+mtp", "b+mtp", "c+mtp", "d+mtp", "pd-c+mtp", "dx+mtp")
ALL_ARMS = ("a", "b", "c", "d", "pd-c", "pd-b", "dx") + MTP_ARMS
ARM_LABELS = {"a": "baseline (no HiSparse)", "b": "SGLang in-tree HiSparse", "c": "hisparse-sglang plugin",
              "d": "hisparse-sglang plugin, always offload",
              "pd-c": "PD, decode with hisparse-sglang", "pd-b": "PD, decode with SGLang in-tree HiSparse",
              "dx": "plugin, always offload, kernel build corrupting 1 in 16 missed rows (must fail)",
              "a+mtp": "baseline + MTP", "b+mtp": "SGLang in-tree HiSparse + MTP", "c+mtp": "hisparse-sglang + MTP",
              "d+mtp": "hisparse-sglang, always offload, + MTP", "pd-c+mtp": "PD, decode with hisparse-sglang, + MTP",
              "dx+mtp": "dx + MTP: the verify swap-in of the corrupting build (must fail)"}
COLOCATED_ARMS = ("a", "b", "c", "d")
# dx: arm d on a kernel build that copies every 16th missed row of a swap-in from the wrong host row
# (csrc/swap_in.cuh, HISPARSE_TEST_CORRUPT_MISSES): what the correctness judge and the in-server KV
# check must reject, to show they can fail. dx+mtp: the same build under speculation, where the verify's
# multi-position swap-in (the same kernel body) corrupts its misses.
CORRUPT_DEFINES = "HISPARSE_TEST_CORRUPT_MISSES=16"
# Keyed by the arm without "+mtp" (base_arm): an MTP arm takes its arm's environment and overrides.
ARM_ENV = {"dx": {"HISPARSE_E2E_KERNEL_DEFINES": CORRUPT_DEFINES}}
# The co-located arms whose flags a PD arm's decode / prefill instance takes.
PD_DECODE_ARM = {"pd-c": "c", "pd-b": "b", "pd-c+mtp": "c+mtp"}
PD_PREFILL_ARM = {"pd-c": "a", "pd-b": "a", "pd-c+mtp": "a+mtp"}
PD_ARMS = tuple(PD_DECODE_ARM)
# arms that load our plugin (its dist-info + src on PYTHONPATH; a PD arm: its decode)
_PLUGIN_BASE_ARMS = ("c", "d", "pd-c", "dx")
PLUGIN_ARMS = _PLUGIN_BASE_ARMS + tuple(a for a in MTP_ARMS if a.removesuffix(MTP_SUFFIX) in _PLUGIN_BASE_ARMS)
PD_TRANSFER_BACKEND = "mooncake_tcp"  # SGLang 0.5.17: Mooncake with MC_FORCE_TCP=1 (no RDMA NIC on the GPU machine)
ARM_HISPARSE_OVERRIDES = {"d": {"resident_first": False}, "dx": {"resident_first": False}}  # merged into --hisparse-config
# The DSA backend of each KV cache dtype whose decode path calls the HiSparse swap-in (SGLang 0.5.17).
DSA_BACKEND_OF_KV_DTYPE = {"bfloat16": "flashmla_sparse", "fp8_e4m3": "flashmla_kv"}


def base_arm(arm: str) -> str:
    """The arm whose server an MTP arm runs with speculation added ("c+mtp" -> "c"); other arms: themselves."""
    return arm.removesuffix(MTP_SUFFIX)


def mtp_model_dir(args) -> Path:
    """Where prepare_mtp_model puts the MTP arms' model (in the state dir)."""
    return args.state_dir / "model-mtp"


def _model_copy(src: Path, dst: Path, **config_changes) -> Path:
    """``dst``: ``src`` with config.json rewritten by ``config_changes`` and every other file a symlink."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def prepare_mtp_model(args) -> Path:
    """A copy of --model-dir whose config.json declares one NextN (MTP) layer, the draft model of the MTP arms:
    config.json rewritten, every other file a symlink.  With --load-format dummy the draft's weights come from
    the fixture's seeded init like the target's."""
    return _model_copy(Path(args.model_dir), mtp_model_dir(args), num_nextn_predict_layers=1)


def prepare_layered_model(args) -> Path:
    """--model-layers N: every arm serves a copy of --model-dir whose config.json declares N decoder layers, made in
    the state dir as ``<model>-L<N>`` (``args.model_dir`` is set to it, and the MTP arms' model is made from it);
    without the flag, --model-dir itself.  The weights are dummy, drawn per layer, so nothing else changes.  Why:
    the tiny model's one draft (NextN) layer is a quarter of its four target layers, so MTP adds about 25 % to
    every prefill where DeepSeek-V3.2's one NextN layer against 61 adds under 2 % (docs/speculative.md, section 7):
    with more layers the draft takes a real model's share of the forward.  Call it before anything reads
    ``args.model_dir``."""
    if args.model_layers:
        src = Path(args.model_dir)
        args.model_dir = _model_copy(src, args.state_dir / f"{src.name}-L{args.model_layers}",
                                     num_hidden_layers=args.model_layers)
    return args.model_dir


def speculative_args(args) -> list[str]:
    """SGLang's flags of the MTP arms: linear EAGLE / NextN with --mtp-steps draft steps."""
    steps = args.mtp_steps
    return ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(steps),
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(steps + 1)]


def speculative_env(args) -> dict[str, str]:
    """--mtp-accept-len X > 0: SGLang's own acceptance simulation (SGLANG_SIMULATE_ACC_LEN, sglang/srt/speculative/
    spec_utils.py) accepts X tokens per verify (an integer X: exactly X; else floor or ceil with X's mean), the
    accepted ones being the draft's real tokens and the bonus the target's own prediction
    (SGLANG_SIMULATE_ACC_TOKEN_MODE=real-draft-token).  Dummy weights' draft agrees with the target almost never;
    this makes every arm run the paths of long accepts, identically (integer X), at the cost that outputs are no
    longer the target's own greedy ones (compare MTP arms with each other then, not with arms without MTP)."""
    if not args.mtp_accept_len:
        return {}
    return {"SGLANG_SIMULATE_ACC_LEN": str(args.mtp_accept_len), "SGLANG_SIMULATE_ACC_METHOD": "match-expected",
            "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real-draft-token"}


def arm_port(args, arm: str) -> int:
    """Arms a/b/c/d/pd-c/pd-b/dx/a+mtp/.../pd-c+mtp/dx+mtp listen on --port-base +0/+10/.../+120 (a PD arm: its
    prefill; decode +1, bootstrap +2)."""
    return args.port_base + 10 * ALL_ARMS.index(arm)


def port_offsets() -> tuple[int, ...]:
    """Every port offset from --port-base that an arm's servers listen on (arm_port, pd_ports), in order."""
    at_zero = argparse.Namespace(port_base=0)
    return tuple(port for arm in ALL_ARMS
                 for port in (pd_ports(at_zero, arm) if arm in PD_ARMS else (arm_port(at_zero, arm),)))


def pd_ports(args, arm: str) -> tuple[int, int, int]:
    """(prefill HTTP port, decode HTTP port, the prefill's bootstrap port) of a PD arm."""
    port = arm_port(args, arm)
    return port, port + 1, port + 2


@dataclasses.dataclass
class ServerSpec:
    """One server of an arm: its role ("" when it prefills and decodes, else "prefill" / "decode")."""

    role: str
    cmd: list
    env: dict
    port: int

    def name(self, arm: str) -> str:
        return f"{arm}-{self.role}" if self.role else arm


def parse_env_assignments(items: list[str]) -> dict[str, str]:
    env = {}
    for it in items:
        if "=" not in it or it.startswith("="):
            raise ValueError(f"expected KEY=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        env[k] = v
    return env


def read_plugin_entry_point(pyproject: Path) -> tuple[str, str]:
    """The `sglang.srt.plugins` entry point declared in pyproject.toml (name, "module:attr")."""
    try:
        import tomllib
        data = tomllib.loads(pyproject.read_text())
        eps = data["project"]["entry-points"]["sglang.srt.plugins"]
        name, value = sorted(eps.items())[0]
        return name, value
    except Exception:
        return DEFAULT_PLUGIN_EP


def write_dist_info(root: Path, dist: str, eps: list[tuple[str, str]], group: str = "sglang.srt.plugins") -> Path:
    """Create <root>/<dist>-0.0.0.dist-info with METADATA + entry_points.txt, so that
    importlib.metadata.entry_points(group=...) finds `eps` when <root> is on sys.path."""
    d = root / f"{dist}-0.0.0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: 0.0.0\n")
    (d / "entry_points.txt").write_text(f"[{group}]\n" + "".join(f"{n} = {v}\n" for n, v in eps))
    (d / "INSTALLER").write_text("run_e2e.py\n")
    return d


def prepare_pyext(state: Path, args) -> tuple[Path, Path, tuple[str, str]]:
    """<state>/pyext-common: fixture module + its dist-info (all arms);
    <state>/pyext-plugin: hisparse_sglang dist-info with the plugin entry point (arms c and d)."""
    common = state / "pyext-common"
    shutil.rmtree(common, ignore_errors=True)
    common.mkdir(parents=True)
    for module in FIXTURE_MODULES:
        shutil.copy2(HERE / module, common / module)
    from topk_workload_fixture import WORKLOAD_COPY

    shutil.copy2(TOPK_WORKLOAD_SOURCE, common / f"{WORKLOAD_COPY}.py")
    write_dist_info(common, "hisparse_e2e_fixture", [FIXTURE_EP, TOPK_FIXTURE_EP])
    plugin = state / "pyext-plugin"
    shutil.rmtree(plugin, ignore_errors=True)
    plugin.mkdir(parents=True)
    ep = (args.plugin_ep.split("=", 1)[0].strip(), args.plugin_ep.split("=", 1)[1].strip()) \
        if args.plugin_ep else read_plugin_entry_point(REPO / "pyproject.toml")
    write_dist_info(plugin, "hisparse_sglang", [ep])
    return common, plugin, ep


def hisparse_config_json(config: str, arm: str, plugin_config: str = "") -> str:
    """--hisparse-config of an arm: the common JSON, then for the plugin's arms (c, d, dx; pd-c's decode takes c's)
    the keys of ``plugin_config`` (--plugin-hisparse-config: e.g. another device_buffer_size for ours while
    SGLang's in-tree arm keeps the common one), then the arm's own overrides; compact (one argv element)."""
    merged = json.loads(config)
    if not isinstance(merged, dict):
        raise ValueError(f"--hisparse-config must be a JSON object, got {config!r}")
    if plugin_config:
        try:
            extra = json.loads(plugin_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--plugin-hisparse-config is not JSON ({e}): {plugin_config!r}") from None
        if not isinstance(extra, dict):
            raise ValueError(f"--plugin-hisparse-config must be a JSON object, got {plugin_config!r}")
        if arm in PLUGIN_ARMS:
            merged.update(extra)
    merged.update(ARM_HISPARSE_OVERRIDES.get(base_arm(arm), {}))
    return json.dumps(merged, separators=(",", ":"))


def topk_workload_env(args) -> dict[str, str]:
    """HISPARSE_E2E_TOPK_* of every server (topk_workload_fixture.py): every arm gets the same top-k."""
    from topk_workload_fixture import OFF, workload_env

    return workload_env(getattr(args, "topk_profile", OFF), getattr(args, "topk_params", ""))


def arm_spec(arm: str, args, env0: dict, common: Path, plugin_dir: Path, port: int, *,
             max_total_tokens: int | None = None, mem_fraction_static: float | None = None) -> tuple[list, dict]:
    """Server argv and environment of one of the arms a-d (by default with --max-total-tokens and
    --mem-fraction-static of the options)."""
    mtp = arm.endswith(MTP_SUFFIX)
    cmd = [args.python, "-m", "sglang.launch_server",
           "--model-path", str(mtp_model_dir(args) if mtp else args.model_dir), "--load-format", "dummy", "--skip-tokenizer-init",
           "--host", HOST, "--port", str(port),
           "--mem-fraction-static", str(mem_fraction_static or args.mem_fraction_static),
           "--max-total-tokens", str(max_total_tokens or args.max_total_tokens),
           "--context-length", str(args.context_length),
           "--disable-radix-cache",
           "--attention-backend", "dsa",
           "--dsa-prefill-backend", DSA_BACKEND_OF_KV_DTYPE[args.kv_cache_dtype],
           "--dsa-decode-backend", DSA_BACKEND_OF_KV_DTYPE[args.kv_cache_dtype],
           "--kv-cache-dtype", args.kv_cache_dtype,
           "--random-seed", str(args.random_seed)]
    if args.disable_cuda_graph:
        cmd.append("--disable-cuda-graph")
    hisparse = ["--enable-hisparse", "--hisparse-config",
                hisparse_config_json(args.hisparse_config, arm, getattr(args, "plugin_hisparse_config", ""))]
    env = dict(env0)
    env.update(topk_workload_env(args))
    if mtp:
        cmd += speculative_args(args)
        env.update(speculative_env(args))
    pp = [str(common), str(args.site)]
    if base_arm(arm) == "b":
        cmd += hisparse
    elif arm in PLUGIN_ARMS:
        if not args.plugin_no_enable_hisparse:
            cmd += hisparse
        cmd += shlex.split(args.plugin_args)
        # the generated dist-info goes first: it must win over any *.egg-info / dist-info of an
        # editable install lying in src/ (importlib.metadata keeps the first distribution per name)
        pp = [str(plugin_dir), str(args.plugin_src)] + pp
        env.update(parse_env_assignments(args.plugin_env))
        env.update(ARM_ENV.get(base_arm(arm), {}))
        if args.kv_check_every:
            env["HISPARSE_E2E_KV_CHECK"] = str(args.kv_check_every)
    cmd += shlex.split(args.extra_server_args)
    env["PYTHONPATH"] = os.pathsep.join(pp)
    return cmd, env


def arm_servers(arm: str, args, env0: dict, pd_env0: dict, common: Path, plugin_dir: Path) -> list[ServerSpec]:
    """The servers of an arm; a PD arm's prefill comes first, its decode (the server that decodes) last.

    PD servers get `pd_env0` (environment.mooncake_env) plus the fixture's registration trace and
    SGLang's bootstrap / waiting timeouts (--pd-timeout-s), so that a transfer that never comes fails
    the request instead of holding it for SGLang's default 300 s."""
    port = arm_port(args, arm)
    if arm not in PD_ARMS:
        return [ServerSpec("", *arm_spec(arm, args, env0, common, plugin_dir, port), port)]
    prefill_port, decode_port, bootstrap_port = pd_ports(args, arm)
    env = dict(pd_env0, HISPARSE_E2E_PD_TRACE="1",
               SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(int(args.pd_timeout_s)),
               SGLANG_DISAGGREGATION_WAITING_TIMEOUT=str(int(args.pd_timeout_s)))
    backend = ["--disaggregation-transfer-backend", PD_TRANSFER_BACKEND]
    prefill_cmd, prefill_env = arm_spec(PD_PREFILL_ARM[arm], args, env, common, plugin_dir, prefill_port,
                                        max_total_tokens=args.pd_prefill_max_total_tokens,
                                        mem_fraction_static=args.pd_mem_fraction_static)
    decode_cmd, decode_env = arm_spec(PD_DECODE_ARM[arm], args, env, common, plugin_dir, decode_port,
                                      max_total_tokens=args.pd_decode_max_total_tokens,
                                      mem_fraction_static=args.pd_mem_fraction_static)
    return [ServerSpec("prefill", prefill_cmd + ["--disaggregation-mode", "prefill", *backend,
                                                 "--disaggregation-bootstrap-port", str(bootstrap_port)],
                       prefill_env, prefill_port),
            ServerSpec("decode", decode_cmd + ["--disaggregation-mode", "decode", *backend], decode_env, decode_port)]
