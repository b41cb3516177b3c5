"""SGLang's own benchmark client against a running server: ``python -m sglang.bench_serving``, one run
per concurrency level, each with ``--output-file``; the parsed results come back.

The server must serve a tokenizer (no ``--skip-tokenizer-init``): bench_serving's ``sglang`` backend
sends text and counts the streamed ``text`` chunks, and it loads the tokenizer itself (the tiny models
carry one: benchmarks/models/build_tokenizer.py). ``--dataset-name random`` draws its prompts from a
ShareGPT-format file, which bench_serving would download; the GPU machine is offline, so this module
writes one (made-up text from the tokenizer's generator, seeded) and passes it as ``--dataset-path``.
Each prompt is that text's tokens repeated up to ``input_len`` and decoded, so the server, which
encodes it again (adding ``<bos>``), sees exactly ``input_len`` tokens with the tiny tokenizer.

Usage from the harness (``env``: the servers' environment with the bundle's site on PYTHONPATH)::

    levels = run_bench_serving(python=args.python, port=target.endpoint.port, model_dir=args.model_dir,
                               levels=[1, 8, 32], out_dir=state / "bench_serving" / arm,
                               env=dict(env0, PYTHONPATH=str(args.site)), log=run.log)
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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


def run_bench_serving(
    *, python: str, port: int, model_dir: Path, levels: list[int], out_dir: Path, env: dict | None = None,
    input_len: int = 16384, output_len: int = 1024, prompts_per_level=lambda concurrency: 2 * concurrency,
    dataset_name: str = "random", seed: int = 1, host: str = HOST, timeout_s: float = 600.0,
    time_left=None, output_details: bool = False, ready_timeout_s: int = 60, log=print,
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
        timeout_s: the longest one level may run; ``time_left`` (a function returning seconds) lowers it.
        ready_timeout_s: how long bench_serving waits for the server's /v1/models before giving up.
    Returns:
        one dict per level: ``max_concurrency``, ``num_prompts``, ``rc``, ``wall_s``, ``output_file``,
        ``log_file``, ``ok`` (exit 0, a result and every request completed), ``summary`` (the figures of
        SUMMARY_KEYS), ``result`` (bench_serving's whole JSON line, None without one) and, when not ok,
        ``error`` (the end of its console output).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    dataset_path = None
    if dataset_name == "random":
        dataset_path = write_sharegpt_dataset(out_dir / "sharegpt_synthetic.json", seed)
    env = dict(os.environ if env is None else env)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    rows = []
    for concurrency in levels:
        num_prompts = int(prompts_per_level(concurrency))
        output_file = out_dir / f"level_{concurrency}.jsonl"
        log_file = out_dir / f"level_{concurrency}.log"
        output_file.unlink(missing_ok=True)  # bench_serving appends
        cmd = bench_serving_command(
            python, port, model_dir, concurrency, num_prompts, output_file, dataset_name=dataset_name,
            dataset_path=dataset_path, input_len=input_len, output_len=output_len, seed=seed + concurrency,
            host=host, output_details=output_details, ready_timeout_s=ready_timeout_s,
        )
        limit = timeout_s if time_left is None else max(1.0, min(timeout_s, time_left()))
        started = time.monotonic()
        with open(log_file, "wb") as console:
            try:
                rc = subprocess.run(cmd, env=env, stdout=console, stderr=subprocess.STDOUT, timeout=limit).returncode
            except subprocess.TimeoutExpired:
                rc = None
        row = {"max_concurrency": concurrency, "num_prompts": num_prompts, "rc": rc,
               "wall_s": round(time.monotonic() - started, 1), "output_file": str(output_file),
               "log_file": str(log_file), "cmd": cmd}
        try:
            result = read_result(output_file)
        except json.JSONDecodeError as exc:
            result, row["error"] = None, f"unreadable --output-file: {exc}"
        row["result"] = result
        row["summary"] = {key: result.get(key) for key in SUMMARY_KEYS} if result else None
        row["ok"] = rc == 0 and result is not None and result.get("completed") == num_prompts
        if not row["ok"]:
            tail = log_file.read_bytes()[-3000:].decode(errors="replace")
            reason = f"timed out after {limit:.0f} s" if rc is None else f"exit code {rc}"
            completed = result and result.get("completed")
            row["error"] = f"{row.get('error', reason)}; completed {completed} of {num_prompts}\n{tail}"
        log(f"  bench_serving c={concurrency}: " + (
            f"{row['summary']['output_throughput']:.1f} out tok/s, median TPOT "
            f"{row['summary']['median_tpot_ms']:.2f} ms, median TTFT {row['summary']['median_ttft_ms']:.0f} ms "
            f"({num_prompts} requests, {row['wall_s']} s)"
            if row["ok"] else f"FAILED ({row['error'].splitlines()[0]})"))
        rows.append(row)
    return rows


if __name__ == "__main__":
    # python benchmarks/e2e/bench_serving_phase.py PORT MODEL_DIR OUT_DIR LEVEL [LEVEL ...]
    port_arg, model_arg, out_arg, *level_args = sys.argv[1:]
    results = run_bench_serving(python=sys.executable, port=int(port_arg), model_dir=Path(model_arg),
                                levels=[int(level) for level in level_args], out_dir=Path(out_arg))
    print(json.dumps([{key: row[key] for key in ("max_concurrency", "ok", "summary")} for row in results], indent=1))
    sys.exit(0 if all(row["ok"] for row in results) else 1)
