"""Options of run_e2e.py: every flag, its default and the checks that reject a bad combination."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from pathlib import Path

import bench_serving_phase
from arms import (
    ALL_ARMS,
    ARM_HISPARSE_OVERRIDES,
    DEFAULT_HISPARSE_CONFIG,
    DEFAULT_MODEL,
    DSA_BACKEND_OF_KV_DTYPE,
    PD_ARMS,
    base_arm,
    hisparse_config_json,
    parse_env_assignments,
)
from chaos import add_chaos_args, check_chaos_args
from common import REPO
from hostpool import add_hostpool_args, check_hostpool_args
from storm import STORM_TPOT_FROM
from topk_workload_fixture import OFF as TOPK_OFF
from topk_workload_fixture import PROFILE_NAMES as TOPK_PROFILES

ALL_PHASES = ("preflight", "correctness", "capacity", "throughput", "serving", "lowload", "longprompt", "saturation",
              "storm", "chaos", "hostpool", "report")
# phases that need the arm's servers, in the order they run
ARM_PHASES = ("correctness", "capacity", "throughput", "serving", "lowload", "longprompt", "saturation", "storm",
              "chaos")
DEFAULT_PHASES = "preflight,correctness,capacity,throughput,report"
HELP = """End-to-end benchmark of HiSparse on SGLang 0.5.17 with a tiny DeepSeek-V3.2 (DSA) model.

Runs on the offline GPU machine after tools/gpu-bundle/install_part.sh has put the bundle into
/tmp/site.  Arms (served one after the other on 127.0.0.1, identical flags except):

  a  baseline         no HiSparse
  b  sglang-hisparse  SGLang's in-tree HiSparse: --enable-hisparse --hisparse-config <JSON>
  c  plugin           as b, plus our plugin: <repo>/src on PYTHONPATH and a generated
                      hisparse_sglang-0.0.0.dist-info whose entry_points.txt registers the
                      `sglang.srt.plugins` entry point of pyproject.toml (the package is not
                      pip-installed on the GPU machine); --plugin-env/--plugin-args add more
  d  plugin-offload   as c, with "resident_first": false added to the --hisparse-config JSON: every
                      request is offloaded, like the in-tree HiSparse (opt-in: --arms ...,d)
  pd-c, pd-b          (opt-in, issue #15) PD disaggregation on the one GPU: a prefill instance (arm a's
                      flags, --disaggregation-mode prefill) and a decode instance (arm c's / b's flags,
                      --disaggregation-mode decode), Mooncake over TCP on 127.0.0.1
                      (--disaggregation-transfer-backend mooncake_tcp; bundle part 2), both started at
                      once; every request goes to both with the same bootstrap host/port/room, as
                      SGLang's router sends it; the decode instance's answer is the request's

Per arm: start the server, wait for /health, warm up, then the selected phases:
  correctness  greedy decode (temperature 0, ignore_eos) of 8K-32K-token random prompts with
               return_logprob/top_logprobs_num=5, sequentially (bs 1, identical batches in all arms),
               every prompt --corr-decodes times (judge.py: the stack's own noise against the arms')
  capacity     N concurrent long requests; the most requests running at once (/v1/loads polling
               + `#running-req` of the server log), then abort_all
  throughput   concurrency levels (1,8,32,max) with fixed input/output lengths, streaming client:
               TTFT, time per output token, output tok/s, server-log decode tok/s
  serving      (opt-in, issue #26) `python -m sglang.bench_serving --backend sglang --dataset-name
               random` at --bs-levels (--max-concurrency N, 2N prompts); the arm's server then loads the
               tokenizer and runs with --enable-metrics; the report sets its figures beside the own
               client's and checks the plugin's /metrics against its log line (bench_serving_phase.py)
  lowload      (opt-in, issue #16) concurrency 1, 2, 4, 8, each level --ll-repeats times with new
               16K-token prompts and 1024 output tokens: time per output token (median and spread
               over the repeats), decode tok/s (client and server log), the plugin's host time per
               decode step, whether every running request stayed resident; ratios c/a, d/a, d/b
  longprompt   (opt-in, PD arms) a prompt longer than the decode instance's GPU KV pool
  saturation   (opt-in) TPOT at concurrency 1 and --sat-requests long requests at once: how many
               run, decode tok/s (client and server log)
  storm        (opt-in) one streaming request decodes; after --storm-after-tokens tokens a burst of
               --storm-requests long requests arrives at once; how long the decoding request stalls
               (token gaps in the burst window against its TPOT before), prefill batches and the
               plugin's `HiSparse:` log line (switch work, demotions) in that window
  chaos        (opt-in, issue #27) faults while --chaos-requests long requests decode (disconnects,
               abort_all, oversize prompt, max_new_tokens beyond the context, PD prefill killed, decode
               killed): the others complete, the failed ones say why, the server serves and its
               accounting returns to the idle baseline (benchmarks/e2e/chaos.py)
  hostpool     (opt-in, issue #27; starts its own server, no arm needed) the plugin's server with a
               --hostpool-gib host pool: pinning time and rate, SIGTERM and SIGKILL teardown
Then `report`: cross-arm comparison (token mismatches, max |dlogprob|) -> results.json + results.md.

Everything is written incrementally: per-arm JSON in --state-dir (default /tmp/hisparse_e2e, which
survives between back-to-back device runs), and results.json, results.md, harness.log and
server-<arm>.log in $OUT (at most 8 files) after every phase, so a timeout still returns data.
A later run with other --arms merges into the same state dir, e.g.
    python3 benchmarks/e2e/run_e2e.py --arms a        # run 1
    python3 benchmarks/e2e/run_e2e.py --arms b,c      # run 2: report covers a, b and c

Weights: --load-format dummy plus a fixture plugin (hisparse_e2e_fixture.py) in every arm that, by
default (--weight-init scaled), replaces SGLang's degenerate U(-1e-3,1e-3) dummy init by a seeded
N(0, 1/fan_in) init so that outputs depend on the long context; it logs a weight fingerprint that
the report compares across arms.  --weight-init sglang keeps SGLang's init.

See docs/gpu-e2e.md for the device-run recipe.
"""


def parse_levels(spec: str) -> list:
    out = []
    for tok in spec.split(","):
        tok = tok.strip().lower()
        if not tok:
            continue
        if tok == "max":
            out.append("max")
        else:
            v = int(tok)
            if v < 1:
                raise ValueError(f"concurrency level must be >= 1: {tok}")
            out.append(v)
    if not out:
        raise ValueError("no concurrency levels")
    return out


def parse_csv(spec: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [s.strip().lower() for s in spec.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad:
        raise ValueError(f"unknown {what}: {bad} (choose from {','.join(allowed)})")
    return [s for s in allowed if s in items]  # canonical order, deduplicated


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("what to run")
    g.add_argument("--arms", default="a,b,c",
                   help="comma list of " + ",".join(ALL_ARMS) + " (default %(default)s; d = plugin with "
                        '"resident_first": false is opt-in); they run in that order, whatever order is given, '
                        "so put a late arm in a call of its own when the deadline is tight")
    g.add_argument("--phases", default=DEFAULT_PHASES,
                   help="comma list of " + ",".join(ALL_PHASES) + " (default %(default)s; the others are opt-in)")
    g.add_argument("--deadline-s", type=float, default=560,
                   help="wall-clock budget of this invocation; arms/phases that no longer fit are skipped (default %(default)s)")
    g.add_argument("--reserve-s", type=float, default=35, help="time kept for shutdown + writing results")
    g.add_argument("--arm-min-s", type=float, default=150, help="do not start an arm with less time left")
    g.add_argument("--dry-run", action="store_true", help="print the server commands/env and exit")
    g.add_argument("--fresh", action="store_true", help="delete earlier results in the state dir first")
    g.add_argument("--import-results", action="append", default=[], type=Path,
                   help="merge arms from an earlier results.json (arms in the state dir win)")
    g = ap.add_argument_group("paths")
    g.add_argument("--state-dir", type=Path, default=Path(os.environ.get("HISPARSE_E2E_STATE", "/tmp/hisparse_e2e")))
    g.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                   help="mirror results here (default $OUT)")
    g.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where install_part.sh put the bundle")
    g.add_argument("--python", default=sys.executable, help="python of the servers (default: this one)")
    g.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    g.add_argument("--model-layers", type=int, default=0,
                   help="serve the model with this many decoder layers (a copy of --model-dir in the state dir, "
                        "dummy weights; 0: as it is), e.g. to give an MTP draft layer a real model's share of "
                        "the forward (arms.prepare_layered_model)")
    g.add_argument("--plugin-src", type=Path, default=REPO / "src", help="put on PYTHONPATH for arms c and d")
    g.add_argument("--mooncake-syslibs", type=Path, default=Path("/tmp/mooncake-sys"),
                   help="where install_part.sh put the Mooncake part's system libraries (its lib/ goes on the PD "
                        "servers' LD_LIBRARY_PATH)")
    g = ap.add_argument_group("server")
    g.add_argument("--port-base", type=int, default=31000,
                   help="arms a/b/c/d/pd-c/pd-b use base+0/+10/.../+50 (PD: prefill +0, decode +1, bootstrap +2)")
    g.add_argument("--max-total-tokens", type=int, default=131072)
    g.add_argument("--mem-fraction-static", type=float, default=0.5)
    g.add_argument("--context-length", type=int, default=65536)
    g.add_argument("--random-seed", type=int, default=1234)
    g.add_argument("--kv-cache-dtype", choices=sorted(DSA_BACKEND_OF_KV_DTYPE), default="bfloat16",
                   help="KV cache dtype of every arm; picks the DSA backend HiSparse supports for it "
                        "(bfloat16: flashmla_sparse, 1152-B rows; fp8_e4m3: flashmla_kv, 656-B rows)")
    g.add_argument("--hisparse-config", default=DEFAULT_HISPARSE_CONFIG)
    g.add_argument("--disable-cuda-graph", action="store_true")
    g.add_argument("--dense-attn-threshold", type=int, default=0,
                   help="SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD (must stay 0 without FA3)")
    g.add_argument("--extra-server-args", default="", help="appended to every arm (shell-quoted string)")
    g.add_argument("--health-timeout", type=float, default=420)
    g.add_argument("--no-jit-shim", action="store_true")
    g.add_argument("--weight-init", choices=("scaled", "sglang"), default="scaled")
    g.add_argument("--weight-seed", type=int, default=1234)
    g = ap.add_argument_group("arms c and d (plugin)")
    g.add_argument("--plugin-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the servers of arms c and d")
    g.add_argument("--plugin-args", default="", help="extra server args of arms c and d (shell-quoted string)")
    g.add_argument("--plugin-hisparse-config", default="", metavar="JSON",
                   help="keys merged into --hisparse-config for the plugin's arms only (c, d, pd-c's decode), e.g. "
                        "'{\"device_buffer_size\": 3072}' to size our buffers apart from the in-tree arm b's")
    g.add_argument("--plugin-no-enable-hisparse", action="store_true",
                   help="arm c without --enable-hisparse/--hisparse-config (not with arm d, which needs them)")
    g.add_argument("--allow-plugin-failure", action="store_true",
                   help="measure arms c/d even if the plugin failed to load")
    g.add_argument("--plugin-ep", default="", metavar="NAME=module:attr",
                   help="entry point to register (default: from pyproject.toml)")
    g = ap.add_argument_group("correctness")
    g.add_argument("--corr-lens", default="8192,16384,32768")
    g.add_argument("--corr-seeds", type=int, default=4,
                   help="prompts per length (with 3 lengths and the pair: 14 prompts; the judge needs 12)")
    g.add_argument("--corr-out", type=int, default=256)
    g.add_argument("--corr-decodes", type=int, default=3,
                   help="times every prompt is decoded by the same server (the judge needs 2; 3 gives it more pairs)")
    g.add_argument("--kv-check-every", type=int, default=0,
                   help="servers with the plugin check every N-th decode batch row by row against the host pool "
                        "(kv_check_fixture.py; slows decoding: use it for correctness runs; 0: off)")
    g.add_argument("--corr-pair-len", type=int, default=16384, help="0 disables the context-sensitivity pair")
    g = ap.add_argument_group("top-k workload (topk_workload_fixture.py, docs/workload.md)")
    g.add_argument("--topk-profile", choices=(TOPK_OFF,) + TOPK_PROFILES, default=TOPK_OFF,
                   help="every arm's decode top-k from this workload profile instead of the tiny model's indexer "
                        "(default %(default)s: the indexer's own)")
    g.add_argument("--topk-params", default="",
                   help='JSON object of workload parameters over the profile\'s, e.g. \'{"persistence": 0.6, '
                        '"context_len": 16384}\' (context_len: the prompt length the persistence is solved for)')
    g = ap.add_argument_group("speculative decoding (arms a+mtp, b+mtp, c+mtp, d+mtp, pd-c+mtp, dx+mtp; arms.py)")
    g.add_argument("--mtp-steps", type=int, default=1, choices=(1, 2, 3),
                   help="EAGLE / NextN draft steps S of the MTP arms, topk 1, S + 1 draft tokens (default %(default)s)")
    g.add_argument("--mtp-accept-len", type=float, default=0.0,
                   help="> 0: SGLang's acceptance simulation accepts this many tokens per verify (1 .. S + 1; "
                        "an integer is exact and the same in every arm) with the draft's real tokens; 0 (default): "
                        "what the dummy-weight draft really gets accepted (almost nothing)")
    g = ap.add_argument_group("capacity")
    g.add_argument("--cap-input-len", type=int, default=16384)
    g.add_argument("--cap-output-len", type=int, default=4096)
    g.add_argument("--cap-requests", type=int, default=64)
    g.add_argument("--cap-timeout", type=float, default=100)
    g.add_argument("--cap-plateau-s", type=float, default=10)
    g.add_argument("--cap-poll-s", type=float, default=0.5)
    g = ap.add_argument_group("throughput")
    g.add_argument("--tp-input-len", type=int, default=16384)
    g.add_argument("--tp-output-len", type=int, default=256)
    g.add_argument("--tp-levels", default="1,8,32,max")
    g.add_argument("--tp-repeats", type=int, default=1,
                   help="run every throughput level this many times in a row (new prompts each time)")
    g.add_argument("--tp-level-timeout", type=float, default=120)
    g.add_argument("--tp-max-fallback", type=int, default=64, help="'max' level if capacity was not measured")
    g = ap.add_argument_group("PD arms pd-c, pd-b (prefill + decode instance on the one GPU)")
    g.add_argument("--pd-prefill-max-total-tokens", type=int, default=131072)
    g.add_argument("--pd-decode-max-total-tokens", type=int, default=40960,
                   help="the decode instance's GPU KV pool; its logical (host) pool is host_to_device_ratio x this "
                        "(default %(default)s: the 32K correctness prompts fit it also without the plugin, the "
                        "--long-len prompt does not)")
    g.add_argument("--pd-mem-fraction-static", type=float, default=0.4,
                   help="of each instance (the two share the GPU; --max-total-tokens caps both pools)")
    g.add_argument("--pd-stagger-s", type=float, default=0.0,
                   help="start the decode instance this long after the prefill (default: both at once)")
    g.add_argument("--pd-timeout-s", type=float, default=120,
                   help="SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT / _WAITING_TIMEOUT of both instances")
    g.add_argument("--long-len", type=int, default=49152, help="phase longprompt: input tokens (default %(default)s)")
    g.add_argument("--long-out", type=int, default=256)
    g.add_argument("--long-timeout", type=float, default=150)
    g = ap.add_argument_group("saturation (opt-in phase)")
    g.add_argument("--sat-input-len", type=int, default=16384)
    g.add_argument("--sat-output-len", type=int, default=2048)
    g.add_argument("--sat-requests", type=int, default=16, help="sent at once (default %(default)s)")
    g.add_argument("--sat-tpot-repeats", type=int, default=3, help="requests at concurrency 1, one after the other")
    g.add_argument("--sat-timeout", type=float, default=240, help="seconds for one measurement")
    g = ap.add_argument_group("low load (opt-in phase lowload)")
    g.add_argument("--ll-levels", default="1,2,4,8", help="concurrency levels (default %(default)s)")
    g.add_argument("--ll-repeats", type=int, default=3,
                   help="runs of every level, interleaved across levels, new prompts each (default %(default)s)")
    g.add_argument("--ll-input-len", type=int, default=16384)
    g.add_argument("--ll-output-len", type=int, default=1024)
    g.add_argument("--ll-level-timeout", type=float, default=120, help="seconds for one run of a level")
    g = ap.add_argument_group("storm (opt-in phase)")
    g.add_argument("--storm-input-len", type=int, default=16384,
                   help="input tokens of the decoding request and of every burst request (default %(default)s)")
    g.add_argument("--storm-output-len", type=int, default=600,
                   help="output tokens of the decoding (streaming) request (default %(default)s)")
    g.add_argument("--storm-after-tokens", type=int, default=100,
                   help="the burst is sent when the decoding request has this many tokens; its TPOT before the "
                        f"burst is the median gap of tokens {STORM_TPOT_FROM + 1}..this (default %(default)s)")
    g.add_argument("--storm-requests", type=int, default=24, help="requests of the burst, sent at once (default %(default)s)")
    g.add_argument("--storm-burst-output-len", type=int, default=32,
                   help="output tokens of every burst request (default %(default)s)")
    g.add_argument("--storm-timeout", type=float, default=180,
                   help="seconds for the whole storm; then all requests are aborted and timed_out is set "
                        "(default %(default)s)")
    g.add_argument("--preflight-timeout", type=float, default=180)
    g.add_argument("--preflight-mooncake", action="store_true",
                   help="preflight also checks the Mooncake part (mooncake_check.py in the PD servers' environment)")
    g.add_argument("--allow-mooncake-failure", action="store_true",
                   help="start the PD arms even if the Mooncake preflight failed")
    add_chaos_args(ap)
    add_hostpool_args(ap)
    bench_serving_phase.add_options(ap)
    args = ap.parse_args(argv)
    try:
        args.arms = parse_csv(args.arms, ALL_ARMS, "arms")
        args.phases = parse_csv(args.phases, ALL_PHASES, "phases")
        args.tp_levels = parse_levels(args.tp_levels)
        args.ll_levels = parse_levels(args.ll_levels)
        if "max" in args.ll_levels:
            raise ValueError("--ll-levels takes numbers only (no 'max')")
        args.corr_lens = [int(x) for x in args.corr_lens.split(",") if x.strip()]
        parse_env_assignments(args.plugin_env)
        if args.topk_params and not isinstance(json.loads(args.topk_params), dict):
            raise ValueError(f"--topk-params must be a JSON object, got {args.topk_params!r}")
        for arm in ALL_ARMS:  # main() builds every arm's spec
            hisparse_config_json(args.hisparse_config, arm, args.plugin_hisparse_config)
        shlex.split(args.plugin_args)
        shlex.split(args.extra_server_args)
        if args.plugin_ep and not re.fullmatch(r"[\w.-]+=[\w.]+:[\w.]+", args.plugin_ep.replace(" ", "")):
            raise ValueError(f"--plugin-ep must look like name=module:attr, got {args.plugin_ep!r}")
    except (ValueError, json.JSONDecodeError) as e:
        ap.error(str(e))
    if max(args.corr_lens + [args.cap_input_len, args.tp_input_len, args.ll_input_len, args.storm_input_len,
                             args.sat_input_len, args.long_len]) + max(
            args.corr_out, args.cap_output_len, args.tp_output_len, args.ll_output_len, args.storm_output_len,
            args.storm_burst_output_len, args.sat_output_len, args.long_out) \
            > args.context_length:
        ap.error("input + output length exceeds --context-length")
    if args.kv_check_every < 0:
        ap.error("--kv-check-every must be >= 0")
    if args.mtp_accept_len and not 1 <= args.mtp_accept_len <= args.mtp_steps + 1:
        ap.error(f"--mtp-accept-len {args.mtp_accept_len} must be 0 or within 1 .. --mtp-steps + 1 = {args.mtp_steps + 1}")
    overridden = [arm for arm in args.arms if base_arm(arm) in ARM_HISPARSE_OVERRIDES]
    if overridden and args.plugin_no_enable_hisparse:
        ap.error(f"arm(s) {', '.join(overridden)} pass \"resident_first\": false through --hisparse-config; drop "
                 "--plugin-no-enable-hisparse")
    if any(a in args.arms for a in PD_ARMS):
        args.preflight_mooncake = True
        if args.pd_decode_max_total_tokens > args.pd_prefill_max_total_tokens:
            ap.error("--pd-decode-max-total-tokens must not exceed --pd-prefill-max-total-tokens")
    if min(args.sat_requests, args.sat_tpot_repeats, args.sat_input_len, args.sat_output_len, args.long_len,
           args.long_out) < 1:
        ap.error("--sat-requests, --sat-tpot-repeats, --sat-input-len, --sat-output-len, --long-len and --long-out "
                 "must be >= 1")
    if min(args.corr_decodes, args.corr_seeds, args.corr_out) < 1:
        ap.error("--corr-decodes, --corr-seeds and --corr-out must be >= 1")
    if min(args.ll_repeats, args.ll_input_len, args.ll_output_len) < 1:
        ap.error("--ll-repeats, --ll-input-len and --ll-output-len must be >= 1")
    if min(args.storm_input_len, args.storm_output_len, args.storm_requests, args.storm_burst_output_len) < 1:
        ap.error("--storm-input-len, --storm-output-len, --storm-requests and --storm-burst-output-len must be >= 1")
    if not STORM_TPOT_FROM < args.storm_after_tokens < args.storm_output_len:
        ap.error(f"--storm-after-tokens must be in ({STORM_TPOT_FROM}, --storm-output-len): "
                 f"the TPOT before the burst needs tokens {STORM_TPOT_FROM + 1}..after-tokens and the burst must "
                 "come before the request ends")
    check_chaos_args(ap, args)
    check_hostpool_args(ap, args)
    bench_serving_phase.check_options(args, ap)
    if args.model_layers < 0:
        ap.error(f"--model-layers must be >= 1, or 0 for the model as it is (got {args.model_layers})")
    args.model_dir = args.model_dir.resolve()
    return args

