"""The tiny models' tokenizer (benchmarks/models/build_tokenizer.py) as SGLang and its benchmark client load
it, and benchmarks/e2e/bench_serving_phase.py driving the installed release's real ``sglang.bench_serving``
against a small HTTP server that answers like SGLang's ``/generate`` (CPU, no model)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[2]
MODELS = [REPO / "benchmarks" / "models" / name for name in ("tiny-dsv32", "tiny-glm5")]
sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))
import bench_serving_phase  # noqa: E402


@pytest.mark.parametrize("model_dir", MODELS, ids=lambda path: path.name)
def test_sglang_loads_the_tokenizer_with_the_models_vocabulary(model_dir):
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    for tokenizer in (AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True), get_tokenizer(str(model_dir))):
        assert len(tokenizer) == tokenizer.vocab_size == config["vocab_size"]
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
        text = "Tralo shen 42, bea stou! Unseen words: quixotic zebra."
        ids = tokenizer.encode(text)
        assert ids[0] == config["bos_token_id"] and ids.count(config["bos_token_id"]) == 1
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert all(0 <= token < config["vocab_size"] for token in ids)
        # every id decodes (bench_serving's random-ids dataset draws from the whole vocabulary)
        assert tokenizer.decode(list(range(config["vocab_size"] - 300, config["vocab_size"])))


def test_committed_tokenizer_files_are_what_the_script_builds():
    completed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "models" / "build_tokenizer.py"), "--check"],
        capture_output=True, text=True,
    )
    assert completed.returncode == 0, completed.stderr


@pytest.mark.parametrize("dataset_name", ["random", "random-ids"])
def test_bench_serving_random_datasets_sample_prompts_of_the_requested_length(tmp_path, dataset_name):
    from sglang.benchmark.datasets import get_dataset
    from sglang.benchmark.utils import get_tokenizer

    tokenizer = get_tokenizer(str(MODELS[0]))
    dataset = bench_serving_phase.write_sharegpt_dataset(tmp_path / "sharegpt.json")
    args = argparse.Namespace(
        dataset_name=dataset_name, random_input_len=16384, random_output_len=1024, num_prompts=3,
        random_range_ratio=1.0, dataset_path=str(dataset), tokenize_prompt=False,
    )
    rows = get_dataset(args, tokenizer)
    assert [row.output_len for row in rows] == [1024] * 3
    served = [len(tokenizer.encode(row.prompt)) for row in rows]  # what the server's tokenizer makes of it
    if dataset_name == "random":
        assert served == [16384] * 3
    else:  # decoded random ids re-encode into somewhat more tokens
        assert all(16384 <= length <= 1.15 * 16384 for length in served), served


class FakeSGLang(BaseHTTPRequestHandler):
    """What bench_serving's ``sglang`` backend asks of a server: /v1/models, /model_info, streaming
    /generate (``text`` and ``meta_info.completion_tokens`` per chunk), /server_info."""

    protocol_version = "HTTP/1.0"
    model_dir = ""
    received: list = []
    running = [0, 0]  # now, most at once
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _send_json(self, value):
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send_json({"object": "list", "data": [{"id": self.model_dir, "object": "model"}]})
        elif self.path == "/model_info":
            self._send_json({"model_path": self.model_dir, "tokenizer_path": self.model_dir})
        else:
            self._send_json({"version": "fake"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.received.append(body)
            self.running[0] += 1
            self.running[1] = max(self.running)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            new_tokens = body["sampling_params"]["max_new_tokens"]
            for count in range(1, new_tokens + 1):
                chunk = {"text": " bea" * count, "meta_info": {"completion_tokens": count, "prompt_tokens": 1}}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        finally:
            with self.lock:
                self.running[0] -= 1


@pytest.fixture
def fake_server():
    FakeSGLang.model_dir = str(MODELS[0])
    FakeSGLang.received = []
    FakeSGLang.running = [0, 0]
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSGLang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_phase_runs_bench_serving_per_level_and_returns_its_results(tmp_path, fake_server):
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    lines = []
    rows = bench_serving_phase.run_bench_serving(
        python=sys.executable, port=fake_server.server_address[1], model_dir=MODELS[0], levels=[1, 3],
        out_dir=tmp_path, input_len=600, output_len=5, log=lines.append, timeout_s=240,
    )
    assert [row["max_concurrency"] for row in rows] == [1, 3]
    for row in rows:
        assert row["ok"], row.get("error")
        assert row["result"]["max_concurrency"] == row["max_concurrency"]
        assert row["summary"]["completed"] == row["num_prompts"] == 2 * row["max_concurrency"]
        assert row["summary"]["total_output_tokens"] == 5 * row["num_prompts"]
        assert row["summary"]["output_throughput"] > 0
        assert Path(row["output_file"]).exists()
    # one warm-up request (32 tokens at most) per level, then the measured ones
    assert len(FakeSGLang.received) == sum(1 + row["num_prompts"] for row in rows)
    assert FakeSGLang.running[1] <= 3
    tokenizer = get_tokenizer(str(MODELS[0]))
    prompt_lengths = {len(tokenizer.encode(body["text"])) for body in FakeSGLang.received}
    assert prompt_lengths == {600}
    assert all(body["sampling_params"]["ignore_eos"] for body in FakeSGLang.received)
    assert len(lines) == 2 and "out tok/s" in lines[0]


def test_phase_reports_a_failed_level_with_the_clients_output(tmp_path):
    rows = bench_serving_phase.run_bench_serving(
        python=sys.executable, port=9, model_dir=MODELS[0], levels=[2], out_dir=tmp_path,
        input_len=64, output_len=2, log=lambda line: None, timeout_s=120, ready_timeout_s=2,
        # no server on port 9: bench_serving's readiness check gives up after 2 s
        dataset_name="random-ids",
    )
    assert not rows[0]["ok"] and rows[0]["result"] is None and rows[0]["rc"] not in (0, None)
    assert "completed None of 4" in rows[0]["error"]
