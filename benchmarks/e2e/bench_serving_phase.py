"""SGLang's own benchmark client against a running server: ``python -m sglang.bench_serving``, one run
per concurrency level, each with ``--output-file``; the parsed results come back. Also the harness's
``serving`` phase built on it, the ``/metrics`` check of the plugin arms, and their report sections.

The server must serve a tokenizer (no ``--skip-tokenizer-init``): bench_serving's ``sglang`` backend
sends text and counts the streamed ``text`` chunks, and it loads the tokenizer itself (the tiny models
carry one: benchmarks/models/build_tokenizer.py). ``--dataset-name random`` draws its prompts from a
ShareGPT-format file, which bench_serving would download; the GPU machine is offline, so this module
writes one (made-up text from the tokenizer's generator, seeded) and passes it as ``--dataset-path``.
Each prompt is that text's tokens repeated up to ``input_len`` and decoded, so the server, which
encodes it again (adding ``<bos>``), sees exactly ``input_len`` tokens with the tiny tokenizer.

In the harness (run_e2e.py ``--phases ...,serving``): every co-located arm's server then starts without
``--skip-tokenizer-init`` (the harness's own client sends token ids and reads ``completion_tokens``,
which work either way) and, while ``--scrape-metrics`` is on (the default with this phase), with
``--enable-metrics``; after the throughput, serving and lowload phases of the arms with our plugin,
``/metrics`` is scraped and checked against the plugin's ``HiSparse:`` log lines (scrape.py). The
levels run in one Python process by default (benchmarks/e2e/bench_serving_levels.py executes the module
``sglang.bench_serving`` with each level's argv, as ``python -m`` does, importing SGLang once instead of
once per level: ~30 s per level on the GPU machine); ``--bs-process-per-level`` runs each level as its
own ``python -m sglang.bench_serving``.

Usage outside the harness (``env``: an environment whose Python imports sglang)::

    levels = run_bench_serving(python=sys.executable, port=30000, model_dir=Path("benchmarks/models/tiny-dsv32"),
                               levels=[1, 8, 32], out_dir=Path("/tmp/bench_serving"))
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import scrape
from arms import PLUGIN_ARMS
from logs import log_since_start

REPO = Path(__file__).resolve().parents[2]
LEVELS_DRIVER = Path(__file__).resolve().parent / "bench_serving_levels.py"
TOKENIZER_BUILDER = REPO / "benchmarks" / "models" / "build_tokenizer.py"
HOST = "127.0.0.1"
# The figures of a level copied to its summary (bench_serving's result keys).
SUMMARY_KEYS = (
    "completed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
    "input_throughput", "output_throughput", "total_throughput", "median_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
    "median_e2e_latency_ms", "concurrency", "max_concurrent_requests",
)
# Conversations of the generated dataset and words per prompt (bench_serving repeats a prompt's tokens
# up to the input length, so short prompts suffice).
DATASET_CONVERSATIONS = 64
DATASET_WORDS = (120, 400)


def _text_generator():
    """``synthetic_text`` of benchmarks/models/build_tokenizer.py (the language the tokenizer learnt)."""
    spec = importlib.util.spec_from_file_location("hisparse_tiny_tokenizer", TOKENIZER_BUILDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.synthetic_text


def write_sharegpt_dataset(path: Path, seed: int = 1) -> Path:
    """A ShareGPT-format JSON (``[{"conversations": [{"from", "value"}, ...]}]``, two turns each) of made-up
    text, the same for the same seed: what ``--dataset-name random`` samples its prompts from."""
    synthetic_text = _text_generator()
    rng = random.Random(seed)
    words = synthetic_text(seed=seed, words=DATASET_CONVERSATIONS * DATASET_WORDS[1] * 2, lexicon_words=20_000).split()
    conversations, start = [], 0
    for _ in range(DATASET_CONVERSATIONS):
        question, answer = rng.randint(*DATASET_WORDS), rng.randint(*DATASET_WORDS)
        human = " ".join(words[start : start + question])
        gpt = " ".join(words[start + question : start + question + answer])
        start += question + answer
        conversations.append({"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(conversations))
    return path


def bench_serving_command(
    python: str, port: int, model_dir: Path, concurrency: int, num_prompts: int, output_file: Path, *,
    dataset_name: str = "random", dataset_path: Path | None = None, input_len: int = 16384,
    output_len: int = 1024, seed: int = 1, host: str = HOST, output_details: bool = False, ready_timeout_s: int = 60,
) -> list[str]:
    """The argv of one bench_serving run (flags of SGLang 0.5.17 to 0.5.23)."""
    cmd = [
        python, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", host, "--port", str(port),
        "--model", str(model_dir), "--tokenizer", str(model_dir),
        "--dataset-name", dataset_name, "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        # 1.0: every request has exactly these lengths (the default 0.0 draws them from [1, length])
        "--random-range-ratio", "1.0",
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
        "--seed", str(seed), "--output-file", str(output_file), "--disable-tqdm",
        "--ready-check-timeout-sec", str(ready_timeout_s),
    ]
    if dataset_path is not None:
        cmd += ["--dataset-path", str(dataset_path)]
    if output_details:
        cmd.append("--output-details")
    return cmd


def read_result(output_file: Path) -> dict | None:
    """The last JSON line bench_serving appended to ``output_file`` (None if it wrote none)."""
    if not output_file.exists():
        return None
    lines = [line for line in output_file.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1]) if lines else None


def _level_row(concurrency: int, num_prompts: int, cmd: list[str], output_file: Path, log_file: Path,
               rc: int | None, wall_s: float, limit: float | None) -> dict:
    """One level's result from its exit code and its --output-file (see run_bench_serving)."""
    row = {"max_concurrency": concurrency, "num_prompts": num_prompts, "rc": rc, "wall_s": round(wall_s, 1),
           "output_file": str(output_file), "log_file": str(log_file), "cmd": cmd}
    try:
        result = read_result(output_file)
    except json.JSONDecodeError as exc:
        result, row["error"] = None, f"unreadable --output-file: {exc}"
    row["result"] = result
    row["summary"] = {key: result.get(key) for key in SUMMARY_KEYS} if result else None
    row["ok"] = rc == 0 and result is not None and result.get("completed") == num_prompts
    if not row["ok"]:
        tail = log_file.read_bytes()[-3000:].decode(errors="replace") if log_file.exists() else ""
        reason = (f"timed out after {limit:.0f} s" if limit else "not run (time ran out)") if rc is None \
            else f"exit code {rc}"
        completed = result and result.get("completed")
        row["error"] = f"{row.get('error', reason)}; completed {completed} of {num_prompts}\n{tail}"
    return row


def _log_level(row: dict, log) -> None:
    summary = row["summary"]
    log(f"  bench_serving c={row['max_concurrency']}: " + (
        f"{summary['output_throughput']:.1f} out tok/s, median TPOT {summary['median_tpot_ms']:.2f} ms, "
        f"median TTFT {summary['median_ttft_ms']:.0f} ms ({row['num_prompts']} requests, {row['wall_s']} s)"
        if row["ok"] else f"FAILED ({row['error'].splitlines()[0]})"))


def run_bench_serving(
    *, python: str, port: int, model_dir: Path, levels: list[int], out_dir: Path, env: dict | None = None,
    input_len: int = 16384, output_len: int = 1024, prompts_per_level=lambda concurrency: 2 * concurrency,
    dataset_name: str = "random", seed: int = 1, host: str = HOST, timeout_s: float = 600.0,
    time_left=None, output_details: bool = False, ready_timeout_s: int = 60, log=print,
    one_process: bool = False, after_level=None,
) -> list[dict]:
    """Run bench_serving once per concurrency level, in order, against the server on ``host:port``.

    Args:
        python: the interpreter that has SGLang (the harness's ``args.python``).
        port: the server's HTTP port.
        model_dir: the served model's directory; bench_serving loads its tokenizer from it.
        levels: ``--max-concurrency`` values, one run each.
        out_dir: where the dataset, each level's ``--output-file`` (``level_<N>.jsonl``) and its console
            output (``level_<N>.log``) go.
        env: the environment of the runs (None: this process's); it must let ``python`` import sglang.
        input_len, output_len: tokens per request (``--random-input-len``, ``--random-output-len``).
        prompts_per_level: ``--num-prompts`` of a level from its concurrency (default twice as many).
        dataset_name: ``random`` (prompts from the generated ShareGPT-format file) or ``random-ids``
            (random token ids; the server's re-encoding makes them 6-9 % longer with the tiny tokenizer).
        timeout_s: the longest one level may run; ``time_left`` (a function returning seconds) lowers it,
            and a level is not started with less than 10 s left.
        ready_timeout_s: how long bench_serving waits for the server's /v1/models before giving up.
        one_process: run every level in one Python process (bench_serving_levels.py: the module
            ``sglang.bench_serving`` executed with each level's argv, SGLang imported once); the limit is
            then ``timeout_s`` per level for all of them together.
        after_level: called with each level's row as soon as it is known.
    Returns:
        one dict per level: ``max_concurrency``, ``num_prompts``, ``rc`` (None: timed out or not run),
        ``wall_s``, ``output_file``, ``log_file``, ``cmd`` (the argv of ``python -m sglang.bench_serving``),
        ``ok`` (exit 0, a result and every request completed), ``summary`` (the figures of SUMMARY_KEYS),
        ``result`` (bench_serving's whole JSON line, None without one) and, when not ok, ``error`` (the end
        of its console output).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    dataset_path = None
    if dataset_name == "random":
        dataset_path = write_sharegpt_dataset(out_dir / "sharegpt_synthetic.json", seed)
    env = dict(os.environ if env is None else env)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    plan = []
    for concurrency in levels:
        num_prompts = int(prompts_per_level(concurrency))
        output_file = out_dir / f"level_{concurrency}.jsonl"
        output_file.unlink(missing_ok=True)  # bench_serving appends
        cmd = bench_serving_command(
            python, port, model_dir, concurrency, num_prompts, output_file, dataset_name=dataset_name,
            dataset_path=dataset_path, input_len=input_len, output_len=output_len, seed=seed + concurrency,
            host=host, output_details=output_details, ready_timeout_s=ready_timeout_s,
        )
        plan.append((concurrency, num_prompts, cmd, output_file, out_dir / f"level_{concurrency}.log"))

    def limit_of(seconds: float) -> float | None:
        left = seconds if time_left is None else min(seconds, time_left())
        return left if left >= 10 else None

    rows = []

    def done(row: dict) -> None:
        _log_level(row, log)
        rows.append(row)
        if after_level is not None:
            after_level(row)

    if not one_process:
        for concurrency, num_prompts, cmd, output_file, log_file in plan:
            limit = limit_of(timeout_s)
            started, rc = time.monotonic(), None
            if limit is not None:
                with open(log_file, "wb") as console:
                    try:
                        rc = subprocess.run(cmd, env=env, stdout=console, stderr=subprocess.STDOUT,
                                            timeout=limit).returncode
                    except subprocess.TimeoutExpired:
                        rc = None
            done(_level_row(concurrency, num_prompts, cmd, output_file, log_file, rc, time.monotonic() - started, limit))
        return rows
    # one process: the driver runs the levels in order and appends {"index", "rc", "wall_s"} per level
    status_file = out_dir / "levels_status.jsonl"
    status_file.unlink(missing_ok=True)
    plan_file = out_dir / "levels_plan.json"
    plan_file.write_text(json.dumps([{"argv": cmd[3:], "log": str(log_file)} for *_, cmd, _, log_file in plan]))
    limit = limit_of(timeout_s * len(plan))
    started = time.monotonic()
    driver_log = out_dir / "levels_driver.log"
    if limit is not None:
        with open(driver_log, "wb") as console:
            try:
                subprocess.run([python, str(LEVELS_DRIVER), str(plan_file), str(status_file)], env=env,
                               stdout=console, stderr=subprocess.STDOUT, timeout=limit)
            except subprocess.TimeoutExpired:
                pass
    status = {}
    if status_file.exists():
        for line in status_file.read_text().splitlines():
            if line.strip():
                item = json.loads(line)
                status[item["index"]] = item
    for index, (concurrency, num_prompts, cmd, output_file, log_file) in enumerate(plan):
        item = status.get(index, {})
        row = _level_row(concurrency, num_prompts, cmd, output_file, log_file, item.get("rc"),
                         item.get("wall_s", 0.0), limit)
        if index not in status and driver_log.exists() and not row["ok"]:
            row["error"] += "\n--- driver output\n" + driver_log.read_bytes()[-2000:].decode(errors="replace")
        done(row)
    log(f"  bench_serving: {len(plan)} levels in one process, {time.monotonic() - started:.1f} s")
    return rows


# ------------------------------------------------------------------------------------------------
# The harness's `serving` phase (run_e2e.py), its options, its servers' flags, the /metrics check
# and the report sections.

# Phases after which the plugin arms' /metrics are checked against the log (their requests all
# complete, so the server decodes nothing when the phase returns).
SCRAPED_PHASES = ("throughput", "serving", "lowload")
# bench_serving and the own client "differ" on a figure when their ratio leaves 1 +- this
DIFF_TOLERANCE = 0.15


def add_options(ap) -> None:
    """The serving phase's flags (options.parse_args)."""
    g = ap.add_argument_group("serving (opt-in phase: python -m sglang.bench_serving against every co-located arm)")
    g.add_argument("--bs-levels", default="1,8,32",
                   help="--max-concurrency of each bench_serving run (default %(default)s: the throughput phase's "
                        "levels without 'max', so that the report sets the two clients side by side)")
    g.add_argument("--bs-input-len", type=int, default=16384, help="--random-input-len (default %(default)s)")
    g.add_argument("--bs-output-len", type=int, default=1024, help="--random-output-len (default %(default)s)")
    g.add_argument("--bs-prompts-per-level", type=int, default=2,
                   help="--num-prompts of a level = this x its concurrency (default %(default)s)")
    g.add_argument("--bs-dataset", choices=("random", "random-ids"), default="random",
                   help="--dataset-name: random (text from a generated ShareGPT-format file, nothing downloaded; "
                        "the server sees exactly --bs-input-len tokens) or random-ids (default %(default)s)")
    g.add_argument("--bs-level-timeout", type=float, default=240, help="seconds for one level (default %(default)s)")
    g.add_argument("--bs-process-per-level", action="store_true",
                   help="run every level as its own `python -m sglang.bench_serving` (default: all levels in one "
                        "process that imports SGLang once; the same module and argv)")
    g.add_argument("--bs-python", default=None, help="python of bench_serving (default: --python)")
    g.add_argument("--bs-site", type=Path, default=None,
                   help="PYTHONPATH of bench_serving (default: --site, the bundle)")
    g.add_argument("--scrape-metrics", action=argparse.BooleanOptionalAction, default=None,
                   help="start every co-located arm with --enable-metrics and check the plugin arms' /metrics "
                        "against the plugin's log line after the throughput, serving and lowload phases "
                        "(default: on with the serving phase; --no-scrape-metrics turns it off)")


def check_options(args, ap) -> None:
    """Parse and check the serving flags after parse_args (errors through ``ap.error``)."""
    try:
        args.bs_levels = [int(tok) for tok in str(args.bs_levels).split(",") if tok.strip()]
    except ValueError:
        ap.error(f"--bs-levels takes numbers only: {args.bs_levels!r}")
    if not args.bs_levels or min(args.bs_levels) < 1:
        ap.error("--bs-levels needs concurrency levels >= 1")
    if min(args.bs_input_len, args.bs_output_len, args.bs_prompts_per_level) < 1 or args.bs_level_timeout <= 0:
        ap.error("--bs-input-len, --bs-output-len, --bs-prompts-per-level and --bs-level-timeout must be >= 1")
    if "serving" in args.phases and args.bs_input_len + args.bs_output_len > args.context_length:
        ap.error("--bs-input-len + --bs-output-len exceeds --context-length")
    if args.scrape_metrics is None:
        args.scrape_metrics = "serving" in args.phases


def server_specs(arm: str, specs: list, args) -> list:
    """An arm's servers as the requested phases need them: with the serving phase every co-located server
    loads the tokenizer (no --skip-tokenizer-init: bench_serving sends text and counts streamed text); with
    --scrape-metrics it gets --enable-metrics. PD arms (no serving phase: they need a router) are unchanged."""
    if len(specs) != 1 or specs[0].role:
        return specs
    spec = specs[0]
    if "serving" in args.phases:
        spec.cmd = [x for x in spec.cmd if x != "--skip-tokenizer-init"]
    if args.scrape_metrics and "--enable-metrics" not in spec.cmd:
        spec.cmd = spec.cmd + ["--enable-metrics"]
    return specs


def phase_serving(target, run, keep) -> dict:
    """bench_serving at every --bs-levels level against the arm's server; keep(partial) after each level."""
    args, dl, log = run.args, run.deadline, run.log
    settings = {"levels": list(args.bs_levels), "input_len": args.bs_input_len, "output_len": args.bs_output_len,
                "prompts_per_level": args.bs_prompts_per_level, "dataset": args.bs_dataset, "random_range_ratio": 1.0,
                "one_process": not args.bs_process_per_level}
    res = {"settings": settings, "invocation": run.started, "levels": [],
           # the own client's phases that ran on this very server (same start, same flags)
           "same_server_phases": [p for p in ("throughput", "lowload") if p in args.phases]}
    if len(target.servers) != 1:
        return {"not_applicable": "bench_serving needs one server (a PD arm needs a router in front)"}
    if "--skip-tokenizer-init" in target.decoder.cmd:
        return res | {"error": "the server runs with --skip-tokenizer-init: bench_serving reads the streamed text"}
    if dl.left() < args.reserve_s + 30:
        return res | {"skipped": "deadline"}
    env = dict(target.decoder.env, PYTHONPATH=str(args.bs_site or args.site))

    def after(row: dict) -> None:
        res["levels"].append({key: row[key] for key in ("max_concurrency", "num_prompts", "rc", "wall_s", "ok",
                                                        "summary", "result")}
                             | {"cmd": shlex.join(row["cmd"])} | ({"error": row["error"][:3000]} if not row["ok"] else {}))
        keep(res)

    rows = run_bench_serving(
        python=args.bs_python or args.python, port=target.decoder.port, model_dir=args.model_dir,
        levels=list(args.bs_levels), out_dir=args.state_dir / "bench_serving" / target.arm, env=env,
        input_len=args.bs_input_len, output_len=args.bs_output_len,
        prompts_per_level=lambda concurrency: args.bs_prompts_per_level * concurrency, dataset_name=args.bs_dataset,
        timeout_s=args.bs_level_timeout, time_left=lambda: dl.left() - args.reserve_s - 5,
        one_process=not args.bs_process_per_level, log=log, after_level=after,
    )
    if any(row["rc"] is None for row in rows):
        res["skipped_rest"] = "deadline"
    target.check()
    return res


def metrics_check(port: int, log_path: Path, attempts: int = 3) -> dict:
    """Scrape /metrics of an idle server and compare with its log since start (scrape.compare_with_log).

    The plugin writes its log line, then its metrics; a line logged between reading the log and scraping
    would set them apart, so the log is read before and after the scrape and the check repeated (up to
    ``attempts`` times) while the count of plugin lines changed. Returns ``ok``, ``mismatches``, ``lines``,
    ``metrics`` (the scraped values), ``log`` (the last line's figures) or ``error``."""
    for attempt in range(attempts):  # noqa: B007 (reported after the loop)
        before = len(scrape.parse_log_lines(log_since_start(log_path)))
        try:
            values = scrape.plugin_values(scrape.fetch_metrics(port))
        except Exception as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                    "mismatches": [f"/metrics: {type(exc).__name__}: {exc}"]}
        text = log_since_start(log_path)
        if len(scrape.parse_log_lines(text)) == before:
            break
        time.sleep(1.0)
    compared = scrape.compare_with_log(values, text)
    return {"ok": not compared["mismatches"], "mismatches": compared["mismatches"], "lines": compared["lines"],
            "attempts": attempt + 1, "metrics": values, "log": compared["log"]}


def scrape_after_phase(target, run, result: dict, phase: str) -> None:
    """After a phase of a plugin arm (--scrape-metrics): its /metrics against its log, kept as the phase
    result's ``metrics_check``."""
    phase_result = result.get(phase)
    if not run.args.scrape_metrics or phase not in SCRAPED_PHASES or target.arm not in PLUGIN_ARMS \
            or len(target.servers) != 1 or not isinstance(phase_result, dict) or phase_result.get("not_applicable"):
        return
    check = metrics_check(target.decoder.port, target.log_path)
    phase_result["metrics_check"] = check
    values = check.get("metrics") or {}
    run.log(f"  /metrics after {phase}: " + ("agrees" if check["ok"] else "DISAGREES") + " with the plugin's "
            f"{check.get('lines', 0)} log lines (resident {values.get('resident')}, offloaded {values.get('offloaded')}, "
            f"hit rate {values.get('hit_rate')}, swap-in {values.get('bytes_moved', 0) / 2**20:.1f} MiB)"
            + ("" if check["ok"] else f": {'; '.join(check['mismatches'])}"))


def record_check_failures(result: dict, phases, log) -> list[str]:
    """The /metrics checks of this run's phases that failed, kept as the arm's ``check_failures``."""
    failures = []
    for phase in phases:
        phase_result = result.get(phase)
        check = phase_result.get("metrics_check") if isinstance(phase_result, dict) else None
        if check and not check["ok"]:
            failures.append(f"{phase}: /metrics disagrees with the plugin's log line: {'; '.join(check['mismatches'])}")
    if failures:
        result["check_failures"] = failures
        for line in failures:
            log(f"arm {result.get('arm')}: CHECK FAILED: {line}")
    else:
        result.pop("check_failures", None)
    return failures


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def own_client_figures(arm_result: dict, concurrency: int, output_len: int) -> dict | None:
    """The harness's own client at this concurrency (every request of the level completed): the throughput
    phase's levels or the lowload phase's runs, medians over their repeats; the phase whose output length
    equals ``output_len`` first."""
    found = []
    for phase, rows_key in (("throughput", "levels"), ("lowload", "runs")):
        res = arm_result.get(phase) or {}
        rows = [r for r in res.get(rows_key) or [] if r.get("concurrency") == concurrency and r.get("ok") == concurrency]
        if not rows:
            continue
        lengths = res.get("settings") or res
        found.append({"phase": phase, "input_len": lengths.get("input_len"), "output_len": lengths.get("output_len"),
                      "runs": len(rows), "output_tok_s": _median([r.get("output_tok_s") for r in rows]),
                      "tpot_ms": _median([r.get("tpot_ms_median") for r in rows]),
                      "ttft_ms": _median([1000 * r["ttft_s_median"] for r in rows if r.get("ttft_s_median") is not None])})
    found.sort(key=lambda f: f["output_len"] != output_len)
    return found[0] if found else None


def compare_clients(arm_result: dict) -> list[dict]:
    """Per bench_serving level of an arm: its figures, the own client's at that concurrency, their ratios,
    which differ by more than DIFF_TOLERANCE and the differences of setting that explain it."""
    serving = arm_result.get("serving") or {}
    st = serving.get("settings") or {}
    capacity = (arm_result.get("capacity") or {}).get("max_running")
    rows = []
    for level in serving.get("levels") or []:
        n, summary = level["max_concurrency"], level.get("summary") or {}
        row = {"concurrency": n, "ok": level.get("ok"), "requests": level.get("num_prompts"),
               "completed": summary.get("completed"),
               "bench": {"output_tok_s": summary.get("output_throughput"), "tpot_ms": summary.get("median_tpot_ms"),
                         "ttft_ms": summary.get("median_ttft_ms")}}
        own = own_client_figures(arm_result, n, st.get("output_len"))
        row["own"] = own
        if own and level.get("ok"):
            row["ratio"] = {k: round(row["bench"][k] / own[k], 3) if row["bench"].get(k) and own.get(k) else None
                            for k in ("output_tok_s", "tpot_ms", "ttft_ms")}
            row["differs"] = [k for k, r in row["ratio"].items() if r is not None and abs(r - 1) > DIFF_TOLERANCE]
            why = []
            if own["output_len"] != st.get("output_len") or own["input_len"] != st.get("input_len"):
                why.append(f"the lengths differ (bench_serving {st.get('input_len')}+{st.get('output_len')}, own "
                           f"{own['input_len']}+{own['output_len']}): the prefill's share of the wall time, and with "
                           "it output tok/s, depends on them")
            if n > 1 and level.get("num_prompts", n) > n:
                why.append(f"bench_serving sends {level['num_prompts']} requests keeping {n} in flight: a request "
                           "that replaces a finished one prefills while the others decode (their TPOT rises) and "
                           f"queues behind no other prefill (its TTFT falls); the own client sends its {n} at once, "
                           f"so its TTFT includes up to {n - 1} other prefills")
            if capacity and capacity < n:
                why.append(f"the server runs at most {capacity} such requests at once, the rest queue (both clients)")
            if own["phase"] not in serving.get("same_server_phases", []):
                why.append(f"the own client's {own['phase']} phase ran on another start of the server (maybe with "
                           "--skip-tokenizer-init: no detokenizer)")
            row["why"] = why
        rows.append(row)
    return rows


def _f(value, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def render_serving(arms: dict, present: list[str]) -> list[str]:
    """results.md: bench_serving beside the own client per arm and level; the /metrics checks."""
    out = []
    have = [x for x in present if ((arms[x].get("serving") or {}).get("levels"))]
    if have:
        st = arms[have[0]]["serving"]["settings"]
        out += ["", "## bench_serving (SGLang's client) beside the harness's own client",
                "",
                f"`python -m sglang.bench_serving --backend sglang --dataset-name {st['dataset']} --random-input-len "
                f"{st['input_len']} --random-output-len {st['output_len']} --random-range-ratio 1 --num-prompts "
                f"{st['prompts_per_level']}N --max-concurrency N --request-rate inf` against each arm's server (tokenizer "
                "loaded, prompts from a generated ShareGPT-format file: nothing downloaded; range ratio 1: every "
                "request has exactly these lengths, bench_serving's default 0 draws them from [1, length]). Own client: "
                "the throughput phase (N requests sent at once) or, at a level it lacks, the lowload phase (median "
                "over its repeats), token ids in, streamed. Both define TPOT as (last token − first token) / (tokens − "
                "1) per request and TTFT from sending to the first token; output tok/s is output tokens / wall time.",
                "", "| arm | N | bench_serving requests ok | output tok/s: bench_serving / own | median TPOT ms: "
                    "bench_serving / own | median TTFT ms: bench_serving / own | own client: phase, tokens | differs "
                    f"by more than {DIFF_TOLERANCE:.0%} |",
                "|---|---|---|---|---|---|---|---|"]
        notes = []
        for x in have:
            for row in compare_clients(arms[x]):
                bench, own = row["bench"], row["own"] or {}
                where = f"{own['phase']}, {own['input_len']}+{own['output_len']}" if own else "–"
                differs = ", ".join(row.get("differs") or []) or ("no" if "differs" in row else "–")
                out.append(f"| {x} | {row['concurrency']} | {_f(row['completed'], 0) if row['completed'] is not None else '–'}"
                           f" of {row['requests']} | {_f(bench['output_tok_s'])} / {_f(own.get('output_tok_s'))} | "
                           f"{_f(bench['tpot_ms'], 2)} / {_f(own.get('tpot_ms'), 2)} | {_f(bench['ttft_ms'], 0)} / "
                           f"{_f(own.get('ttft_ms'), 0)} | {where} | {differs} |")
                if row.get("differs"):
                    ratios = ", ".join(f"{k} {row['ratio'][k]:.2f}" for k in row["differs"])
                    notes.append(f"- {x}, N={row['concurrency']}: bench_serving / own {ratios}. "
                                 + ("; ".join(row["why"]) + "." if row["why"] else
                                    "No difference of setting explains it: the clients themselves (bench_serving's "
                                    "one asyncio process, text in and detokenized text out; the own client's threads, "
                                    "token ids) or the machine."))
        if notes:
            out += ["", "Where they differ, and the differences of setting between the two measurements:", ""] + notes
    checked = [(x, phase, arms[x][phase]["metrics_check"]) for x in present for phase in SCRAPED_PHASES
               if isinstance(arms[x].get(phase), dict) and arms[x][phase].get("metrics_check")]
    if checked:
        out += ["", "## /metrics against the plugin's log line (docs/metrics.md)", "",
                "Scraped after the phase (the server idle): gauges against the last `HiSparse:` line within its "
                "rounding, the swap-in bytes counter against the sum of every line's `moved` since the server started.",
                "", "| arm | after phase | agree | log lines | resident / offloaded | hit rate | device rows used | "
                    "host rows used | swap-in MiB | mismatches |", "|---|---|---|---|---|---|---|---|---|---|"]
        for x, phase, check in checked:
            m = check.get("metrics") or {}
            hit = m.get("hit_rate")
            out.append(f"| {x} | {phase} | {'yes' if check['ok'] else 'NO'} | {check.get('lines', '–')} | "
                       f"{_f(m.get('resident'), 0)} / {_f(m.get('offloaded'), 0)} | "
                       f"{'n/a' if hit is None else f'{100 * hit:.1f} %'} | {_f(m.get('device_rows_used'), 0)} | "
                       f"{_f(m.get('host_rows_used'), 0)} | {_f((m.get('bytes_moved') or 0) / 2**20, 1)} | "
                       f"{'; '.join(check.get('mismatches') or []) or '–'} |")
    return out


if __name__ == "__main__":
    # python benchmarks/e2e/bench_serving_phase.py PORT MODEL_DIR OUT_DIR LEVEL [LEVEL ...]
    port_arg, model_arg, out_arg, *level_args = sys.argv[1:]
    results = run_bench_serving(python=sys.executable, port=int(port_arg), model_dir=Path(model_arg),
                                levels=[int(level) for level in level_args], out_dir=Path(out_arg))
    print(json.dumps([{key: row[key] for key in ("max_concurrency", "ok", "summary")} for row in results], indent=1))
    sys.exit(0 if all(row["ok"] for row in results) else 1)
