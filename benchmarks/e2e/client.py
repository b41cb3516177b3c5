"""HTTP client of SGLang 0.5.17's native API as the harness uses it (token ids in, output_ids out).

Two endpoints with the same methods: Colocated (one server) and PDPair (a prefill and a decode instance,
each request sent to both as SGLang's router does)."""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import secrets
import threading
import time
import urllib.error
import urllib.request
from typing import Callable

from common import HOST


class HTTPStatusError(RuntimeError):
    """A response other than 2xx; the message carries the status and the start of the body (SGLang's error)."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:600].decode('utf-8', 'replace')}")
        self.status = status


def http_json(method: str, port: int, path: str, body: dict | None = None, timeout: float = 600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise HTTPStatusError(e.code, e.read()) from None
    return json.loads(raw) if raw else None


def http_status(port: int, path: str, timeout: float = 5) -> int:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:
        return 0


def make_prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(n)]  # 0/1 are bos/eos


def extract_logprobs(meta: dict) -> tuple[list, list]:
    """(chosen-token logprobs, top-k [[id, logprob], ...] per position) from a /generate meta_info.

    SGLang 0.5.17 returns output_token_logprobs as [[logprob, token_id, text|None], ...] and
    output_top_logprobs as [[[logprob, token_id, text|None] * k] | None, ...]."""
    lps = [(float(x[0]) if x[0] is not None else None) for x in meta.get("output_token_logprobs") or []]
    top = []
    for pos in meta.get("output_top_logprobs") or []:
        top.append([[int(e[1]), (float(e[0]) if e[0] is not None else None)] for e in pos] if pos else None)
    return lps, top


SPEC_META_KEYS = ("spec_verify_ct", "spec_num_correct_drafts", "spec_accept_histogram")


def spec_meta(meta: dict) -> dict:
    """A speculative request's counts from its final meta_info (SGLang's tokenizer manager): verify steps,
    accepted draft tokens, and the histogram of accepted drafts per verify step; {} without speculation."""
    return {k: meta[k] for k in SPEC_META_KEYS if meta.get(k) is not None}


def spec_summary(metas: list[dict]) -> dict | None:
    """Accepted tokens per verify step (the bonus token included, SGLang's "accept length") over requests, and
    their summed histogram of accepted drafts per step (index = drafts accepted); None without speculation."""
    metas = [m for m in metas if m.get("spec_verify_ct")]
    if not metas:
        return None
    steps = sum(m["spec_verify_ct"] for m in metas)
    drafts = sum(m.get("spec_num_correct_drafts", 0) for m in metas)
    hist: list[int] = []
    for m in metas:
        for i, n in enumerate(m.get("spec_accept_histogram") or []):
            hist += [0] * (i + 1 - len(hist))
            hist[i] += n
    return {"requests": len(metas), "verify_steps": steps, "accept_length": round(1 + drafts / steps, 3),
            "drafts_accepted_histogram": hist}


def finish_type(out: dict) -> str | None:
    """The finish_reason type of a /generate response ("length", "abort", ...)."""
    fin = (out or {}).get("meta_info", {}).get("finish_reason")
    return fin.get("type") if isinstance(fin, dict) else fin


def generate_body(ids: list[int], max_new: int, *, logprobs: bool = False, rid: str | None = None,
                  stream: bool = False) -> dict:
    """A greedy /generate request that decodes exactly `max_new` tokens."""
    body = {"input_ids": ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}}
    if stream:
        body["stream"] = True
    if logprobs:
        body.update({"return_logprob": True, "top_logprobs_num": 5, "logprob_start_len": -1})
    if rid:
        body["rid"] = rid
    return body


def generate(port: int, ids: list[int], max_new: int, *, logprobs: bool = False, rid: str | None = None,
             timeout: float = 900) -> dict:
    return http_json("POST", port, "/generate", generate_body(ids, max_new, logprobs=logprobs, rid=rid),
                     timeout=timeout)


def stream_events(resp):
    """The JSON objects of a streamed /generate response (its ``data:`` lines), up to ``[DONE]``."""
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


def read_stream(resp, t0: float, *, trace: bool = False, on_tokens: Callable[[int], None] | None = None) -> dict:
    """Per-request timings (TTFT, TPOT) and the token count of a streamed /generate response.

    The token count of a chunk is the cumulative `completion_tokens` of its meta_info (else the
    length of its cumulative `output_ids`, which --skip-tokenizer-init streams).  trace=True adds
    "t0" and "arrivals": [(time.perf_counter(), cumulative tokens)] for every chunk that brought
    tokens; on_tokens(cumulative tokens) is called for each such chunk, on the calling thread."""
    t_first = t_last = None
    n_first = n_last = 0
    finish = None
    spec: dict = {}
    arrivals: list[tuple[float, int]] = []
    try:
        for obj in stream_events(resp):
            if "error" in obj:
                return {"error": str(obj["error"])[:300]}
            meta = obj.get("meta_info", {})
            n = int(meta.get("completion_tokens") or len(obj.get("output_ids") or []))
            now = time.perf_counter()
            if n > 0 and t_first is None:
                t_first, n_first = now, n
            if n > n_last:
                t_last, n_last = now, n
                if trace:
                    arrivals.append((now, n))
                if on_tokens is not None:
                    on_tokens(n)
            if meta.get("finish_reason"):
                finish = meta["finish_reason"]
                spec = spec_meta(meta)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"} | ({"t0": t0, "arrivals": arrivals} if trace else {})
    out = {"tokens": n_last, "e2e_s": time.perf_counter() - t0,
           "ttft_s": (t_first - t0) if t_first else None, "finish": finish}
    if spec:
        out["spec"] = spec
    if trace:
        out.update(t0=t0, arrivals=arrivals)
    if t_first is not None and t_last is not None and n_last > n_first:
        out["tpot_s"] = (t_last - t_first) / (n_last - n_first)
    return out


def generate_stream(port: int, ids: list[int], max_new: int, timeout: float, *, trace: bool = False,
                    on_tokens: Callable[[int], None] | None = None) -> dict:
    """Streaming /generate: returns per-request timings (TTFT, TPOT) and the token count (read_stream)."""
    return stream_body(port, generate_body(ids, max_new, stream=True), timeout, trace=trace, on_tokens=on_tokens)


def stream_body(port: int, request: dict, timeout: float, *, trace: bool = False,
                on_tokens: Callable[[int], None] | None = None) -> dict:
    body = json.dumps(request).encode()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:300]!r}"}
        return read_stream(resp, t0, trace=trace, on_tokens=on_tokens)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"} | ({"t0": t0, "arrivals": []} if trace else {})
    finally:
        conn.close()


def loads(port: int) -> dict | None:
    try:
        data = http_json("GET", port, "/v1/loads?include=core", timeout=5)
        lst = data.get("loads") if isinstance(data, dict) else data
        return lst[0] if lst else None
    except Exception:
        return None


class Colocated:
    """Requests to one server that prefills and decodes (the arms a-d)."""

    def __init__(self, port: int):
        self.port = port

    def generate(self, ids: list[int], max_new: int, *, logprobs: bool = False, rid: str | None = None,
                 timeout: float = 900) -> dict:
        return generate(self.port, ids, max_new, logprobs=logprobs, rid=rid, timeout=timeout)

    def generate_stream(self, ids: list[int], max_new: int, timeout: float, *, trace: bool = False,
                        on_tokens: Callable[[int], None] | None = None) -> dict:
        return generate_stream(self.port, ids, max_new, timeout, trace=trace, on_tokens=on_tokens)

    def loads(self) -> dict | None:
        return loads(self.port)

    def abort_all(self) -> None:
        http_json("POST", self.port, "/abort_request", {"abort_all": True}, timeout=30)

    def server_info(self) -> dict:
        return http_json("GET", self.port, "/server_info", timeout=30)


class PDPair:
    """Requests as SGLang's router (mini load balancer) sends them in PD mode: one body with
    bootstrap_host (the prefill's host), bootstrap_port (its --disaggregation-bootstrap-port) and a
    random 63-bit bootstrap_room, POSTed to the prefill and the decode instance at once; the decode
    instance's response is the request's.  Both get the same rid, so that a request the decode rejects
    is aborted on the prefill (else it would wait there for a decode handshake until SGLang's bootstrap
    timeout).  The prefill's outcome is added as `prefill_error` when it failed."""

    def __init__(self, prefill_port: int, decode_port: int, bootstrap_port: int, prefill_wait_s: float = 30):
        self.port = decode_port  # loads, server info: the decode instance holds the running requests
        self.prefill_port, self.decode_port, self.bootstrap_port = prefill_port, decode_port, bootstrap_port
        self.prefill_wait_s = prefill_wait_s

    def routed(self, body: dict, rid: str | None) -> dict:
        room = secrets.randbits(63)
        return body | {"bootstrap_host": HOST, "bootstrap_port": self.bootstrap_port, "bootstrap_room": room,
                       "rid": rid or f"pd-{room}"}

    def _to_prefill(self, body: dict, timeout: float) -> tuple[threading.Thread, dict]:
        """POST to the prefill in a thread; reads the whole response (a stream too) and keeps only its outcome."""
        outcome: dict = {}

        def post() -> None:
            req = urllib.request.Request(f"http://{HOST}:{self.prefill_port}/generate", data=json.dumps(body).encode(),
                                         method="POST", headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    r.read()
                    outcome["status"] = r.status
            except urllib.error.HTTPError as e:
                outcome["error"] = str(HTTPStatusError(e.code, e.read()))
            except Exception as e:
                outcome["error"] = f"{type(e).__name__}: {e}"

        thread = threading.Thread(target=post, name=f"prefill-{body['rid']}", daemon=True)
        thread.start()
        return thread, outcome

    def _finish_prefill(self, thread: threading.Thread, outcome: dict, rid: str, decode_failed: bool) -> str | None:
        if decode_failed:
            with contextlib.suppress(Exception):
                http_json("POST", self.prefill_port, "/abort_request", {"rid": rid}, timeout=10)
        thread.join(self.prefill_wait_s)
        if thread.is_alive():
            return f"prefill still running {self.prefill_wait_s:.0f} s after the decode answered"
        return outcome.get("error")

    def generate(self, ids: list[int], max_new: int, *, logprobs: bool = False, rid: str | None = None,
                 timeout: float = 900) -> dict:
        body = self.routed(generate_body(ids, max_new, logprobs=logprobs), rid)
        thread, outcome = self._to_prefill(body, timeout)
        try:
            out = http_json("POST", self.decode_port, "/generate", body, timeout=timeout)
        except Exception:
            self._finish_prefill(thread, outcome, body["rid"], True)
            raise
        prefill_error = self._finish_prefill(thread, outcome, body["rid"], finish_type(out) == "abort")
        return out | ({"prefill_error": prefill_error} if prefill_error else {})

    def generate_stream(self, ids: list[int], max_new: int, timeout: float, *, trace: bool = False,
                        on_tokens: Callable[[int], None] | None = None) -> dict:
        body = self.routed(generate_body(ids, max_new, stream=True), None)
        thread, outcome = self._to_prefill(body, timeout)
        out = stream_body(self.decode_port, body, timeout, trace=trace, on_tokens=on_tokens)
        prefill_error = self._finish_prefill(thread, outcome, body["rid"], "error" in out)
        return out | ({"prefill_error": prefill_error} if prefill_error else {})

    def loads(self) -> dict | None:
        return loads(self.decode_port)

    def abort_all(self) -> None:
        for port in (self.decode_port, self.prefill_port):
            http_json("POST", port, "/abort_request", {"abort_all": True}, timeout=30)

    def server_info(self) -> dict:
        return http_json("GET", self.decode_port, "/server_info", timeout=30)
