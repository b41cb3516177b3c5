"""The chaos phase (issue #27, item 2): faults injected while many long requests decode, and whether the
server, the other requests and the plugin's accounting come through each one.

Per arm (meant for c, d and pd-c; other arms get the same faults without the plugin's accounting checks):
`--chaos-requests` streaming requests of `--chaos-input-len` + `--chaos-output-len` tokens decode; when every
one has `--chaos-inject-after` tokens (the PD kills: as soon as the first has a token, so that the others are
still being transferred) one fault is injected:

  disconnect       the client closes the streaming connections of every other request
  abort_all        POST /abort_request {"abort_all": true} (both instances in PD)
  oversize_prompt  one request whose prompt is longer than the context and every KV pool of the arm
  max_new_tokens   one request whose max_new_tokens is beyond the context length
  prefill_kill     (PD) SIGKILL of the prefill server mid-transfer, then it is started again
  decode_kill      SIGKILL of the server that decodes (the server itself when co-located), then started again

After each fault it checks that only the requests the fault touches fail, each with a status and a message
(recorded); that the server serves (a fresh short request decodes its full length); and that the server
comes back to its idle baseline within `--chaos-settle-s` (+ pd_quarantine_s and --pd-timeout-s in PD):

* /v1/loads of every server: no request running or waiting, `num_used_tokens` as before the first fault;
* the plugin's accounting: the plugin logs its `HiSparse: ...` line only while requests decode, so a probe
  request (`--chaos-probe-len` + `--chaos-probe-out`) decodes alone and its lines must show what the same
  probe showed before the first fault: one request, host and device rows within `--chaos-row-tolerance`,
  no more quarantined rows; the probe is repeated until that holds or the time is up;
* with `--enable-metrics` on the server (`--plugin-args --enable-metrics`): the `sglang:hisparse_*` gauges
  agree with the log line (scrape.compare_with_log) and hold no quarantined rows beyond the baseline.

Every fault's result is saved as soon as it is known; a fault that no longer fits `--deadline-s` is skipped
(`skipped_rest`, exit code 3).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import threading
import time

import scrape
from arms import PD_ARMS, PLUGIN_ARMS, pd_ports
from client import HTTPStatusError, PDPair, finish_type, generate_body, http_json, make_prompt, stream_events
from client import loads as loads_of
from common import HOST, Run, atomic_write
from hostpool import live_pids
from logs import file_size, log_since_start, read_from
from servers import Server, ServerDied, port_free

FAULTS = ("disconnect", "abort_all", "oversize_prompt", "max_new_tokens", "prefill_kill", "decode_kill")
PD_ONLY_FAULTS = ("prefill_kill",)
FAULT_WHAT = {
    "disconnect": "the client closes the streaming connections of every other request mid-stream",
    "abort_all": 'POST /abort_request {"abort_all": true} (to both instances in PD)',
    "oversize_prompt": "one more request whose prompt is longer than the context and every KV pool of the arm",
    "max_new_tokens": "one more request whose max_new_tokens is beyond the context length",
    "prefill_kill": "SIGKILL of the prefill server while requests are transferred to the decode, then a restart",
    "decode_kill": "SIGKILL of the server that decodes while requests decode, then a restart",
}
LOADS_KEYS = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "token_usage")


# ---------------------------------------------------------------------------------------------- options
def add_chaos_args(ap) -> None:
    g = ap.add_argument_group("chaos (opt-in phase, issue #27: faults while requests decode)")
    g.add_argument("--chaos-faults", default=",".join(FAULTS),
                   help="comma list of " + ",".join(FAULTS) + " (default: all; prefill_kill runs on PD arms only)")
    g.add_argument("--chaos-requests", type=int, default=32, help="streaming requests decoding at every fault")
    g.add_argument("--chaos-input-len", type=int, default=6144,
                   help="their input tokens (default %(default)s: 32 x 8K tokens fit pd-c's 327,680 logical tokens "
                        "and exceed arm c's 131,072 GPU tokens, so some are offloaded)")
    g.add_argument("--chaos-output-len", type=int, default=2048,
                   help="their output tokens (long enough that the survivors of a disconnect still decode when "
                        "SGLang drops the disconnected ones, 2 s after the close)")
    g.add_argument("--chaos-inject-after", type=int, default=32,
                   help="inject when every request has streamed this many tokens (default %(default)s)")
    g.add_argument("--chaos-inject-timeout", type=float, default=90,
                   help="inject anyway after this long (the result says how many requests had tokens)")
    g.add_argument("--chaos-request-timeout", type=float, default=180,
                   help="seconds for the fault's requests to end; then they are aborted and the fault fails")
    g.add_argument("--chaos-fresh-len", type=int, default=1024, help="input tokens of the fresh request after a fault")
    g.add_argument("--chaos-fresh-out", type=int, default=64, help="its output tokens, all of which must arrive")
    g.add_argument("--chaos-probe-len", type=int, default=6144,
                   help="input tokens of the probe that decodes alone so that the plugin logs its accounting")
    g.add_argument("--chaos-probe-out", type=int, default=256,
                   help="its output tokens (several --decode-log-interval's worth, 40 by default)")
    g.add_argument("--chaos-oversize-len", type=int, default=0,
                   help="prompt of the oversize_prompt fault (0: one token more than the context and every KV pool)")
    g.add_argument("--chaos-settle-s", type=float, default=60,
                   help="seconds for the server to come back to its idle baseline after a fault; PD arms add "
                        "pd_quarantine_s of the HiSparse config and --pd-timeout-s")
    g.add_argument("--chaos-release-s", type=float, default=20,
                   help="disconnect: seconds for the server to drop the closed requests")
    g.add_argument("--chaos-row-tolerance", type=int, default=128,
                   help="host / device rows the probe may show beyond the baseline probe's (its log lines fall at "
                        "other tokens: at most --decode-log-interval tokens and a 64-token page apart)")
    g.add_argument("--chaos-fault-min-s", type=float, default=60,
                   help="time a fault needs before the first one measured it (deadline planning)")
    g.add_argument("--chaos-restart-s", type=float, default=150,
                   help="time a server restart is planned with (the kill faults)")


def check_chaos_args(ap, args) -> None:
    try:
        args.chaos_faults = parse_faults(args.chaos_faults)
    except ValueError as e:
        ap.error(str(e))
    if min(args.chaos_requests, args.chaos_input_len, args.chaos_output_len, args.chaos_inject_after,
           args.chaos_fresh_len, args.chaos_fresh_out, args.chaos_probe_len, args.chaos_probe_out) < 1:
        ap.error("--chaos-requests, --chaos-*-len, --chaos-*-out and --chaos-inject-after must be >= 1")
    if args.chaos_requests < 2:
        ap.error("--chaos-requests must be >= 2 (the disconnect closes half of them)")
    if args.chaos_inject_after >= args.chaos_output_len:
        ap.error("--chaos-inject-after must be below --chaos-output-len (the faults hit requests that still decode)")
    if max(args.chaos_input_len + args.chaos_output_len, args.chaos_probe_len + args.chaos_probe_out,
           args.chaos_fresh_len + args.chaos_fresh_out) > args.context_length:
        ap.error("a chaos request (input + output) exceeds --context-length")
    if args.chaos_row_tolerance < 0 or args.chaos_settle_s <= 0 or args.chaos_release_s <= 0:
        ap.error("--chaos-row-tolerance must be >= 0, --chaos-settle-s and --chaos-release-s > 0")


def parse_faults(spec) -> list[str]:
    if isinstance(spec, list):
        return spec
    items = [s.strip().lower() for s in str(spec).split(",") if s.strip()]
    bad = [s for s in items if s not in FAULTS]
    if bad or not items:
        raise ValueError(f"unknown or no chaos faults: {bad or spec!r} (choose from {','.join(FAULTS)})")
    return [f for f in FAULTS if f in items]


# ---------------------------------------------------------------------------------------------- streams
class Stream:
    """One streaming /generate on the server that decodes (PD: the body also goes to the prefill, as
    client.PDPair sends it), read on its own thread; close() drops the connection like a client that
    goes away."""

    def __init__(self, endpoint, ids: list[int], max_new: int, rid: str, timeout: float):
        self.max_new, self.rid = max_new, rid
        self.tokens, self.status, self.finish, self.error = 0, None, None, None
        self.closed, self.closed_at_tokens, self.ended_at = False, None, None
        self.done = threading.Event()
        self.conn: http.client.HTTPConnection | None = None
        self.resp = self.sock = None
        body = generate_body(ids, max_new, stream=True, rid=rid)
        self.prefill = None
        if isinstance(endpoint, PDPair):
            body = endpoint.routed(body, rid)
            self.prefill = endpoint._to_prefill(body, timeout)  # (thread, outcome)
            self.port = endpoint.decode_port
        else:
            self.port = endpoint.port
        self.body, self.timeout = json.dumps(body).encode(), timeout
        self.thread = threading.Thread(target=self._run, name=f"chaos-{rid}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.conn = http.client.HTTPConnection(HOST, self.port, timeout=self.timeout)
            self.conn.request("POST", "/generate", self.body, {"Content-Type": "application/json"})
            self.sock = self.conn.sock  # getresponse() drops conn.sock when the server closes after the response
            self.resp = resp = self.conn.getresponse()
            self.status = resp.status
            if resp.status != 200:
                self.error = resp.read()[:400].decode("utf-8", "replace")
                return
            for obj in stream_events(resp):
                if "error" in obj:
                    err = obj["error"]
                    self.error = str(err.get("message") if isinstance(err, dict) else err)[:400]
                    break
                meta = obj.get("meta_info", {})
                self.tokens = max(self.tokens, int(meta.get("completion_tokens") or len(obj.get("output_ids") or [])))
                if meta.get("finish_reason"):
                    self.finish = meta["finish_reason"]
        except Exception as e:
            if not self.closed:
                self.error = f"{type(e).__name__}: {e}"[:400]
        finally:
            self.ended_at = time.monotonic()
            with contextlib.suppress(Exception):
                self.resp.close()  # the response holds the socket open after conn.close()
            with contextlib.suppress(Exception):
                self.conn.close()
            self.done.set()

    def close(self) -> None:
        """Drop the connection mid-stream (the server sees the client go away)."""
        self.closed, self.closed_at_tokens = True, self.tokens
        with contextlib.suppress(Exception):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(Exception):
            self.conn.close()

    def outcome(self) -> dict:
        """completed / aborted / error / closed / running, with the status and message that came back."""
        fin = self.finish if isinstance(self.finish, dict) else ({"type": self.finish} if self.finish else {})
        row = {"rid": self.rid, "tokens": self.tokens, "status": self.status}
        if self.closed:
            row.update(outcome="closed", closed_at_tokens=self.closed_at_tokens)
        elif not self.done.is_set():
            row["outcome"] = "running"
        elif self.error is not None:
            row.update(outcome="error", message=self.error)
        elif fin.get("type") == "length" and self.tokens == self.max_new:
            row["outcome"] = "completed"
        elif fin.get("type") == "abort":
            row.update(outcome="aborted", message=str(fin.get("message") or ""),
                       finish_status=fin.get("status_code"))
        elif fin:
            row.update(outcome="error", message=f"finished {fin.get('type')} after {self.tokens} of {self.max_new} tokens")
        else:
            row.update(outcome="error", message=f"the stream ended without a finish reason after {self.tokens} tokens "
                                                f"(connection closed by the server)")
        if self.prefill is not None and not self.prefill[0].is_alive() and self.prefill[1].get("error"):
            row["prefill_error"] = self.prefill[1]["error"][:300]
        return row


def count_outcomes(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        out[r["outcome"]] = out.get(r["outcome"], 0) + 1
    return out


# ---------------------------------------------------------------------------------------------- checks
def check_row(name: str, ok: bool, detail: str) -> dict:
    return {"check": name, "ok": bool(ok), "detail": detail}


def probe_figures(lines: list[dict]) -> dict:
    """What a probe's plugin lines show (scrape.parse_log_lines rows). The plugin logs one more line as
    the finished probe leaves (no request, no rows in use): that line is the server going idle, so the
    request count is taken over the other lines; a line without requests but with rows in use counts."""
    if not lines:
        return {"lines": 0}

    def top(key, fn=max):
        vals = [ln[key] for ln in lines if ln.get(key) is not None]
        return fn(vals) if vals else None

    def requests(ln):
        return ln.get("resident", 0) + ln.get("offloaded", 0)

    busy = [ln for ln in lines if requests(ln) or ln.get("host_rows_used") or ln.get("device_rows_used")]
    counts = [requests(ln) for ln in busy] or [0]
    return {"lines": len(lines), "idle_lines": len(lines) - len(busy),
            "requests_min": min(counts), "requests_max": max(counts),
            "host_rows_used_max": top("host_rows_used"), "device_rows_used_max": top("device_rows_used"),
            "quarantined_max": top("host_rows_quarantined"), "host_rows_total": top("host_rows_total"),
            "device_rows_total": top("device_rows_total")}


def compare_probe(probe: dict, base: dict | None, tolerance: int) -> tuple[bool, str, dict]:
    """Whether a probe after a fault shows the baseline probe's accounting: (ok, sentence, numbers)."""
    if not base or not base.get("lines"):
        return False, "no baseline probe with HiSparse lines to compare with", {}
    if probe.get("error"):
        return False, f"the probe failed: {probe['error']}", {}
    if not probe.get("lines"):
        return False, (f"no HiSparse line while the probe decoded {probe.get('tokens')} tokens (is "
                       f"--decode-log-interval above --chaos-probe-out?)"), {}
    nums = {"host_rows_excess": probe["host_rows_used_max"] - base["host_rows_used_max"],
            "device_rows_excess": probe["device_rows_used_max"] - base["device_rows_used_max"],
            "quarantined": probe["quarantined_max"], "quarantined_baseline": base["quarantined_max"],
            "requests_max": probe["requests_max"], "requests_min": probe["requests_min"],
            "host_rows_used_max": probe["host_rows_used_max"], "device_rows_used_max": probe["device_rows_used_max"]}
    bad = []
    if nums["host_rows_excess"] > tolerance:
        bad.append(f"host rows {probe['host_rows_used_max']} vs {base['host_rows_used_max']} at the baseline "
                   f"(+{nums['host_rows_excess']} > {tolerance})")
    if nums["device_rows_excess"] > tolerance:
        bad.append(f"device rows {probe['device_rows_used_max']} vs {base['device_rows_used_max']} "
                   f"(+{nums['device_rows_excess']} > {tolerance})")
    if (nums["quarantined"] or 0) > (nums["quarantined_baseline"] or 0):
        bad.append(f"quarantined rows {nums['quarantined']} vs {nums['quarantined_baseline']}")
    if nums["requests_max"] != 1 or nums["requests_min"] != 1:
        bad.append(f"the probe alone is counted as {nums['requests_min']}..{nums['requests_max']} requests "
                   f"(resident + offloaded)")
    if probe.get("tokens") != base.get("tokens"):
        bad.append(f"the probe decoded {probe.get('tokens')} tokens, {base.get('tokens')} at the baseline")
    if bad:
        return False, "; ".join(bad), nums
    return True, (f"host rows {probe['host_rows_used_max']} (baseline {base['host_rows_used_max']}), device rows "
                  f"{probe['device_rows_used_max']} (baseline {base['device_rows_used_max']}), quarantined "
                  f"{nums['quarantined']}, 1 request"), nums


def loads_summary(ld: dict | None) -> dict | None:
    if ld is None:
        return None
    out = {k: ld.get(k) for k in LOADS_KEYS if k in ld}
    dis = ld.get("disaggregation")
    if isinstance(dis, dict):
        out["queues"] = {k: v for k, v in dis.items() if k.endswith("_reqs") and v}
    return out


def loads_idle(ld: dict | None, base: dict | None) -> bool:
    if ld is None:
        return False
    if ld.get("num_running_reqs", 0) or ld.get("num_waiting_reqs", 0):
        return False
    if base and base.get("num_used_tokens") is not None and ld.get("num_used_tokens") is not None:
        return ld["num_used_tokens"] <= base["num_used_tokens"]
    return True


def verdict(res: dict) -> str:
    faults = res.get("faults", [])
    if res.get("baseline", {}).get("ok") is False or any(f.get("ok") is False for f in faults):
        return "fail"
    if res.get("skipped_rest") or any(f.get("skipped") for f in faults) or not faults:
        return "incomplete"
    return "pass"


# ---------------------------------------------------------------------------------------------- the phase
class Chaos:
    def __init__(self, target, run: Run, res: dict):
        self.target, self.run, self.res = target, run, res
        self.args, self.dl, self.log = run.args, run.deadline, run.log
        self.arm = target.arm
        self.pd = self.arm in PD_ARMS
        self.plugin = self.arm in PLUGIN_ARMS
        self.endpoint = target.endpoint
        self.decoder: Server = target.decoder
        self.prefill: Server | None = target.servers[0] if self.pd else None
        self.n_probe = 0
        self.fault_s: list[float] = []
        cfg = json.loads(self.args.hisparse_config)
        self.quarantine_s = float(cfg.get("pd_quarantine_s", 60.0)) if self.pd else 0.0
        self.settle_s = self.args.chaos_settle_s + (self.quarantine_s + self.args.pd_timeout_s if self.pd else 0.0)

    # ----------------------------------------------------------------- plumbing
    def budget(self, want: float) -> float:
        return max(5.0, min(want, self.dl.left() - self.args.reserve_s))

    def all_loads(self) -> dict:
        out = {"decode" if self.pd else "server": loads_summary(self.endpoint.loads())}
        if self.pd:
            out["prefill"] = loads_summary(loads_of(self.prefill.port))
        return out

    def wait_idle(self, timeout: float, base: dict | None) -> dict:
        """Poll /v1/loads of every server until none runs or waits a request and the token count is back."""
        t0 = time.monotonic()
        while True:
            now = self.all_loads()
            idle = all(loads_idle(v, (base or {}).get(k)) for k, v in now.items())
            if idle or time.monotonic() - t0 > timeout:
                return {"idle": idle, "after_s": round(time.monotonic() - t0, 2), "loads": now}
            time.sleep(0.25)

    def probe(self) -> dict:
        """One request decodes alone; the plugin's lines logged meanwhile."""
        self.n_probe += 1
        off = file_size(self.target.log_path)
        t0 = time.monotonic()
        ids = make_prompt(770_001, self.args.chaos_probe_len, self.run.vocab)
        try:
            out = self.endpoint.generate(ids, self.args.chaos_probe_out, rid=f"chaos-probe-{self.arm}-{self.n_probe}",
                                         timeout=self.budget(120))
            row = {"tokens": len(out.get("output_ids") or []), "finish": finish_type(out)}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"[:300], "lines": 0}
        row["s"] = round(time.monotonic() - t0, 2)
        if self.plugin:
            time.sleep(0.3)  # the line of the last interval
            row.update(probe_figures(scrape.parse_log_lines(read_from(self.target.log_path, off))))
        return row

    def scrape_metrics(self) -> dict | None:
        """The plugin's gauges on /metrics and their agreement with the log since the server's last start;
        None when the server exports none (no --enable-metrics)."""
        if not self.plugin:
            return None
        try:
            values = scrape.plugin_values(scrape.fetch_metrics(self.decoder.port))
        except Exception as e:
            return {"unavailable": f"{type(e).__name__}: {e}"[:200]}
        cmp = scrape.compare_with_log(values, log_since_start(self.decoder.log_path))
        keys = ("num_resident_reqs", "num_offloaded_reqs", "host_used_tokens", "device_used_tokens",
                "host_quarantined_tokens")
        from_key = {"resident": "num_resident_reqs", "offloaded": "num_offloaded_reqs",
                    "host_rows_used": "host_used_tokens", "device_rows_used": "device_used_tokens",
                    "host_rows_quarantined": "host_quarantined_tokens"}
        gauges = {from_key[k]: values.get(k) for k in from_key}
        return {"gauges": {k: gauges[k] for k in keys}, "mismatches": cmp["mismatches"], "log_lines": cmp["lines"]}

    def servers_alive(self) -> list[str]:
        return [f"{srv.name} exited (rc={srv.proc.returncode if srv.proc else None})"
                for srv in self.target.servers if not srv.alive()]

    def kill(self, srv: Server) -> dict:
        """SIGKILL of the server's main process (its scheduler and detokenizer follow: SGLang starts them with
        PR_SET_PDEATHSIG); what is left of its process group after 20 s is killed and named."""
        pid = srv.proc.pid
        t0 = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            srv.proc.wait(timeout=30)
        while live_pids(pid) and time.monotonic() - t0 < 20:
            time.sleep(0.1)
        left = live_pids(pid)
        if left:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        row = {"pid": pid, "group_gone_s": round(time.monotonic() - t0, 2), "left_after_20s": left}
        with contextlib.suppress(Exception):
            srv.logf.close()
        with contextlib.suppress(OSError):
            srv.pidfile.unlink()
        srv.proc = None
        self.log(f"  chaos: SIGKILL {srv.name} (pid {pid}): group gone after {row['group_gone_s']} s"
                 + (f", killed leftovers {left}" if left else ""))
        return row

    def restart(self, srv: Server) -> dict:
        """Start a server again with its command; its ports must be free first."""
        ports = [srv.port]
        if self.pd and srv is self.prefill:
            ports.append(pd_ports(self.args, self.arm)[2])
        t0 = time.monotonic()
        while not all(port_free(p) for p in ports) and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        if srv.proc is not None:
            with contextlib.suppress(Exception):
                srv.logf.close()
            srv.proc = None
        srv.start()
        try:
            healthy = srv.wait_healthy(self.budget(self.args.health_timeout))
        except (ServerDied, TimeoutError) as e:
            return {"ok": False, "error": str(e)[:600], "s": round(time.monotonic() - t0, 1)}
        self.log(f"  chaos: {srv.name} restarted, healthy after {healthy:.1f} s")
        return {"ok": True, "healthy_s": round(healthy, 1), "s": round(time.monotonic() - t0, 1)}

    def fresh(self) -> dict:
        """A fresh short request: it must decode every token it asked for."""
        t0 = time.monotonic()
        ids = make_prompt(880_000 + len(self.res["faults"]), self.args.chaos_fresh_len, self.run.vocab)
        try:
            out = self.endpoint.generate(ids, self.args.chaos_fresh_out, rid=f"chaos-fresh-{self.arm}-{len(self.res['faults'])}",
                                         timeout=self.budget(120))
            row = {"tokens": len(out.get("output_ids") or []), "finish": finish_type(out)}
            if out.get("prefill_error"):
                row["prefill_error"] = out["prefill_error"][:300]
        except Exception as e:
            row = {"error": f"{type(e).__name__}: {e}"[:400]}
        row["s"] = round(time.monotonic() - t0, 2)
        row["ok"] = row.get("tokens") == self.args.chaos_fresh_out and row.get("finish") == "length"
        return row

    def bad_request(self, ids: list[int], max_new: int, rid: str) -> dict:
        """A request the server must refuse: status and message of every instance it went to."""
        body = generate_body(ids, max_new, rid=rid)
        targets = [("server", self.decoder.port)]
        if self.pd:
            body = self.endpoint.routed(body, rid)
            targets = [("decode", self.decoder.port), ("prefill", self.prefill.port)]
        out = {}
        for role, port in targets:
            t0 = time.monotonic()
            try:
                answer = http_json("POST", port, "/generate", body, timeout=self.budget(60))
                out[role] = {"status": 200, "finish": finish_type(answer),
                             "message": json.dumps((answer or {}).get("meta_info", {}).get("finish_reason"))[:300]}
            except HTTPStatusError as e:
                out[role] = {"status": e.status, "message": str(e)[:400]}
            except Exception as e:
                out[role] = {"status": None, "message": f"{type(e).__name__}: {e}"[:400]}
            out[role]["s"] = round(time.monotonic() - t0, 2)
            if role == "prefill" and out[role]["status"] in (200, None):  # accepted: it would wait for the decode
                with contextlib.suppress(Exception):
                    http_json("POST", port, "/abort_request", {"rid": rid}, timeout=10)
        return out

    # ----------------------------------------------------------------- baseline
    def baseline(self) -> dict:
        idle = self.wait_idle(self.budget(self.settle_s), None)
        probe = self.probe()
        metrics = self.scrape_metrics()
        problems = []
        if not idle["idle"]:
            problems.append(f"not idle before the first fault: {idle['loads']}")
        if probe.get("error") or probe.get("tokens") != self.args.chaos_probe_out:
            problems.append(f"the baseline probe did not decode: {probe}")
        elif self.plugin and not probe.get("lines"):
            problems.append("no HiSparse line during the baseline probe (plugin not logging?)")
        elif self.plugin and (probe["requests_min"] != 1 or probe["requests_max"] != 1):
            problems.append(f"the baseline probe alone is counted as {probe['requests_min']}..{probe['requests_max']} "
                            f"requests")
        b = {"loads": idle["loads"], "probe": probe, "metrics": metrics, "ok": not problems, "problems": problems}
        self.log(f"  chaos baseline: loads {idle['loads']}; probe {probe}; metrics "
                 f"{'none' if metrics is None or 'unavailable' in metrics else metrics['gauges']}"
                 + (f"; PROBLEMS: {problems}" if problems else ""))
        return b

    # ----------------------------------------------------------------- one fault
    def launch(self, fault: str) -> list[Stream]:
        a = self.args
        n = len(self.res["faults"])
        return [Stream(self.endpoint, make_prompt(600_000 + 1000 * n + i, a.chaos_input_len, self.run.vocab),
                       a.chaos_output_len, f"chaos-{self.arm}-{fault}-{i}", timeout=self.budget(a.chaos_request_timeout + 60))
                for i in range(a.chaos_requests)]

    def wait_trigger(self, streams: list[Stream], first_token: bool) -> dict:
        """Until every request has --chaos-inject-after tokens (first_token: until one has a token)."""
        t0 = time.monotonic()
        k = self.args.chaos_inject_after
        limit = self.budget(self.args.chaos_inject_timeout)
        while time.monotonic() - t0 < limit:
            if first_token and any(s.tokens > 0 for s in streams):
                break
            if not first_token and all(s.tokens >= k or s.done.is_set() for s in streams):
                break
            if any(not srv.alive() for srv in self.target.servers):
                break
            time.sleep(0.02)
        toks = [s.tokens for s in streams]

        return {"waited_s": round(time.monotonic() - t0, 2), "rule": "first token" if first_token else f">= {k} tokens each",
                "with_tokens": sum(1 for t in toks if t > 0), "tokens_min": min(toks), "tokens_max": max(toks),
                "ended_before": sum(1 for s in streams if s.done.is_set())}

    def wait_streams(self, streams: list[Stream], timeout: float) -> bool:
        t_end = time.monotonic() + self.budget(timeout)
        for s in streams:
            s.done.wait(max(0.0, t_end - time.monotonic()))
        return all(s.done.is_set() for s in streams)

    def watch_release(self, closed: list[Stream], survivors: list[Stream]) -> dict:
        """After the disconnect: until the server holds no more requests than survivors still decode."""
        t0 = time.monotonic()
        limit = self.budget(self.args.chaos_release_s)
        last = None
        while time.monotonic() - t0 < limit:
            open_n = sum(1 for s in survivors if not s.done.is_set())
            ld = self.endpoint.loads()
            if ld is not None:
                held = ld.get("num_running_reqs", 0) + ld.get("num_waiting_reqs", 0)
                last = {"held": held, "survivors_decoding": open_n}
                if open_n > 0 and held <= open_n:
                    return {"released": True, "after_s": round(time.monotonic() - t0, 2), **last}
                if open_n == 0:
                    return {"released": False, "after_s": round(time.monotonic() - t0, 2), **last,
                            "note": "every survivor finished before the server dropped the closed requests "
                                    "(raise --chaos-output-len)"}
            time.sleep(0.1)
        return {"released": False, "after_s": round(time.monotonic() - t0, 2), **(last or {}),
                "note": f"the server still held the closed requests after {limit:.0f} s"}

    def settle(self) -> dict:
        """Back to the idle baseline: /v1/loads idle, then probes until the accounting matches (or time is up)."""
        base = self.res["baseline"]
        t0 = time.monotonic()
        limit = self.budget(self.settle_s)
        idle = self.wait_idle(limit, base["loads"])
        attempts = []
        while True:
            probe = self.probe()
            if not self.plugin:
                ok, sentence, nums = (probe.get("tokens") == self.args.chaos_probe_out,
                                      f"probe decoded {probe.get('tokens')} tokens" + (f": {probe['error']}" if probe.get("error") else ""),
                                      {})
            else:
                ok, sentence, nums = compare_probe(probe, base["probe"], self.args.chaos_row_tolerance)
            attempts.append({"at_s": round(time.monotonic() - t0, 2), "ok": ok, **nums})
            if ok or time.monotonic() - t0 > limit:
                break
            time.sleep(2.0)
        out = {"idle": idle, "accounting_ok": ok, "accounting": sentence, "accounting_after_s": attempts[-1]["at_s"],
               "probes": len(attempts), "last_probe": probe, "attempts": attempts[-5:]}
        if base.get("metrics") and "gauges" in base["metrics"]:
            out["metrics"] = self.scrape_metrics()
        return out

    def run_fault(self, fault: str) -> dict:
        a = self.args
        t0 = time.monotonic()
        row = {"fault": fault, "what": FAULT_WHAT[fault], "run": self.run.started, "checks": []}
        self.res["faults"].append(row)  # kept (partly filled) if the server dies for good
        checks = row["checks"]
        streams = self.launch(fault)
        first_token = fault == "prefill_kill" or (fault == "decode_kill" and self.pd)
        row["injected"] = self.wait_trigger(streams, first_token)
        affected: set[int] = set()
        restarted: list[dict] = []
        unexpected_death = None
        if fault == "disconnect":
            closed, survivors = streams[::2], streams[1::2]
            for s in closed:
                s.close()
            affected = {i for i in range(0, len(streams), 2)}
            row["release"] = self.watch_release(closed, survivors)
            rel = row["release"]
            checks.append(check_row("the server dropped the closed requests while the others still decoded",
                                    rel["released"],
                                    f"{len(closed)} closed; after {rel['after_s']} s the server held {rel.get('held')} with "
                                    f"{rel.get('survivors_decoding')} survivors decoding" + (f"; {rel['note']}" if rel.get("note") else "")))
            row["fresh"] = self.fresh()
        elif fault == "abort_all":
            try:
                self.endpoint.abort_all()
                row["abort_call"] = "200"
            except Exception as e:
                row["abort_call"] = f"{type(e).__name__}: {e}"[:300]
            affected = set(range(len(streams)))
        elif fault in ("oversize_prompt", "max_new_tokens"):
            if fault == "oversize_prompt":
                n = a.chaos_oversize_len or self.oversize_len()
                row["bad_request"] = {"input_len": n, "max_new_tokens": 8, "pools": self.pools()}
                answers = self.bad_request(make_prompt(990_001, n, self.run.vocab), 8, f"chaos-{self.arm}-oversize")
            else:
                m = a.context_length + 1
                row["bad_request"] = {"input_len": a.chaos_fresh_len, "max_new_tokens": m, "context_length": a.context_length}
                answers = self.bad_request(make_prompt(990_002, a.chaos_fresh_len, self.run.vocab), m, f"chaos-{self.arm}-maxnew")
            row["bad_request"]["answers"] = answers
            for role, ans in answers.items():
                checks.append(check_row(f"the bad request is refused by the {role} with a 4xx and a message",
                                        ans["status"] is not None and 400 <= ans["status"] < 500 and bool(ans["message"]),
                                        f"HTTP {ans['status']} in {ans['s']} s: {ans['message'][:240]}"))
            row["fresh"] = self.fresh()
        elif fault == "prefill_kill":
            at_kill = [s.tokens for s in streams]
            row["kill"] = self.kill(self.prefill)
            affected = {i for i, t in enumerate(at_kill) if t == 0}
            checks.append(check_row("the kill caught requests mid-transfer", bool(affected),
                                    f"{len(affected)} of {len(streams)} requests had no token at the kill"))
            restarted.append({"server": self.prefill.name, **self.restart(self.prefill)})
        elif fault == "decode_kill":
            at_kill = [s.tokens for s in streams]
            affected = {i for i, s in enumerate(streams) if not s.done.is_set()}
            row["kill"] = self.kill(self.decoder)
            row["kill"]["tokens_at_kill"] = {"min": min(at_kill), "max": max(at_kill)}
            ended = self.wait_streams(streams, 30)
            checks.append(check_row("every client saw its request end within 30 s of the kill", ended,
                                    f"{sum(1 for s in streams if s.done.is_set())} of {len(streams)} ended"))
            restarted.append({"server": self.decoder.name, **self.restart(self.decoder)})
        if restarted:
            row["restart"] = restarted
            for r in restarted:
                checks.append(check_row(f"{r['server']} restarted and answered /health", r["ok"],
                                        f"healthy after {r.get('healthy_s')} s" if r["ok"] else r.get("error", "")[:300]))
        # every request of the fault ends
        ended = self.wait_streams(streams, a.chaos_request_timeout)
        if not ended:
            with contextlib.suppress(Exception):
                self.endpoint.abort_all()
            self.wait_streams(streams, 15)
        outcomes = [s.outcome() for s in streams]
        row["requests"] = count_outcomes(outcomes)
        checks.append(check_row("every request of the fault ended", ended,
                                f"{sum(1 for s in streams if s.done.is_set())} of {len(streams)} within "
                                f"{a.chaos_request_timeout:.0f} s" + ("" if ended else "; the rest were aborted")))
        self.outcome_checks(fault, outcomes, affected, checks)
        row["failed_requests"] = [o for o in outcomes if o["outcome"] not in ("completed", "closed")][:40]
        gone = self.servers_alive()
        if gone and fault not in ("prefill_kill", "decode_kill"):
            unexpected_death = gone
        if gone:
            for srv in self.target.servers:
                if not srv.alive():
                    r = self.restart(srv)
                    restarted.append({"server": srv.name, "after_unexpected_exit": True, **r})
                    if not r["ok"]:
                        row["ok"] = False
                        raise ServerDied(f"chaos {fault}: {srv.name} exited and did not restart: {r.get('error')}")
        checks.append(check_row("every server stayed up (the killed one came back)", not unexpected_death and not gone,
                                "; ".join(gone) if gone else "all alive"))
        if "fresh" not in row:
            row["fresh"] = self.fresh()
        fr = row["fresh"]
        checks.append(check_row("a fresh request decodes its full length", fr["ok"],
                                f"{fr.get('tokens')} of {a.chaos_fresh_out} tokens, finish {fr.get('finish')}, "
                                f"{fr['s']} s" + (f": {fr['error']}" if fr.get("error") else "")))
        row["settle"] = st = self.settle()
        idle = st["idle"]
        checks.append(check_row("every server idle again (/v1/loads: nothing running or waiting, tokens as at the baseline)",
                                idle["idle"], f"after {idle['after_s']} s: {idle['loads']}"))
        checks.append(check_row("the plugin's accounting back at its baseline (probe alone: host/device rows, "
                                "quarantine, requests)" if self.plugin else "a probe request decodes after the fault",
                                st["accounting_ok"], f"after {st['accounting_after_s']} s, {st['probes']} probe(s): "
                                                     f"{st['accounting']}"))
        m = st.get("metrics")
        if m is not None:
            base_q = (self.res["baseline"]["metrics"] or {}).get("gauges", {}).get("host_quarantined_tokens") or 0
            ok = "gauges" in m and not m["mismatches"] and (m["gauges"].get("host_quarantined_tokens") or 0) <= base_q
            checks.append(check_row("/metrics agrees with the log line and holds no quarantined rows beyond the baseline",
                                    ok, json.dumps(m)[:400]))
        row["ok"] = all(c["ok"] for c in checks)
        row["duration_s"] = round(time.monotonic() - t0, 1)
        return row

    def outcome_checks(self, fault: str, outcomes: list[dict], affected: set[int], checks: list) -> None:
        """Only the requests the fault touches fail, and each says why."""
        spared = [o for i, o in enumerate(outcomes) if i not in affected]
        hit = [o for i, o in enumerate(outcomes) if i in affected]
        bad_spared = [o for o in spared if o["outcome"] != "completed"]
        checks.append(check_row("the requests the fault does not touch complete", not bad_spared,
                                f"{len(spared) - len(bad_spared)} of {len(spared)} completed"
                                + (f"; e.g. {bad_spared[0]}" if bad_spared else "")))
        if not hit:
            return
        if fault == "disconnect":
            ok = all(o["outcome"] == "closed" for o in hit)
            detail = f"{sum(1 for o in hit if o['outcome'] == 'closed')} of {len(hit)} closed by the client"
        elif fault == "abort_all":
            aborted = [o for o in hit if o["outcome"] == "aborted"]
            wrong = [o for o in hit if o["outcome"] not in ("aborted", "completed") or
                     (o["outcome"] == "aborted" and not o.get("message"))]
            ok = bool(aborted) and not wrong
            msgs = sorted({o.get("message", "") for o in aborted})[:3]
            detail = (f"{len(aborted)} aborted, {sum(1 for o in hit if o['outcome'] == 'completed')} completed first; "
                      f"messages {msgs}" + (f"; unexpected {wrong[0]}" if wrong else ""))
        else:  # the kills: failed with a message, or completed (a transfer that finished at the kill)
            failed = [o for o in hit if o["outcome"] in ("aborted", "error")]
            wrong = [o for o in hit if o["outcome"] not in ("aborted", "error", "completed") or
                     (o["outcome"] in ("aborted", "error") and not o.get("message"))]
            ok = not wrong
            msgs = sorted({(str(o.get("finish_status") or o.get("status")), o.get("message", "")[:160]) for o in failed})[:3]
            detail = (f"{len(failed)} failed, {len(hit) - len(failed) - len(wrong)} completed; status/messages {msgs}"
                      + (f"; without a message or still running: {wrong[0]}" if wrong else ""))
        checks.append(check_row("the requests the fault touches end with a clear error", ok, detail))

    def pools(self) -> dict:
        """The KV pools (tokens) of the arm's servers as the options size them."""
        a = self.args
        ratio = int(json.loads(a.hisparse_config).get("host_to_device_ratio", 1)) if self.arm != "a" else 1
        if self.pd:
            return {"prefill_gpu": a.pd_prefill_max_total_tokens, "decode_gpu": a.pd_decode_max_total_tokens,
                    "decode_logical": a.pd_decode_max_total_tokens * ratio}
        return {"gpu": a.max_total_tokens, "logical": a.max_total_tokens * ratio}

    def oversize_len(self) -> int:
        return max([self.args.context_length] + list(self.pools().values())) + 1


SAME_SETTINGS = ("requests", "input_len", "output_len", "inject_after", "probe", "fresh", "row_tolerance")


def carried_faults(path, settings: dict, faults: list[str]) -> list[dict]:
    """Faults an earlier invocation measured on this arm (state dir, chaos-<arm>.json) with the same settings
    and that this one does not run again: a run cut by the deadline is completed with --chaos-faults."""
    try:
        prev = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if any(prev.get("settings", {}).get(k) != settings[k] for k in SAME_SETTINGS):
        return []
    return [f | {"run": f.get("run") or prev.get("run")} for f in prev.get("faults", [])
            if f["fault"] not in faults and not f.get("skipped") and "ok" in f]


def phase_chaos(target, run: Run, keep) -> dict:
    """keep(partial result) is called after the baseline and after every fault; the result is also kept in
    <state>/chaos-<arm>.json, from which a later invocation takes the faults it does not run again."""
    args, dl, log = run.args, run.deadline, run.log
    arm = target.arm
    pd = arm in PD_ARMS
    faults = [f for f in parse_faults(args.chaos_faults) if pd or f not in PD_ONLY_FAULTS]
    res = {"run": run.started,
           "settings": {"requests": args.chaos_requests, "input_len": args.chaos_input_len,
                        "output_len": args.chaos_output_len, "inject_after": args.chaos_inject_after,
                        "probe": [args.chaos_probe_len, args.chaos_probe_out],
                        "fresh": [args.chaos_fresh_len, args.chaos_fresh_out],
                        "row_tolerance": args.chaos_row_tolerance, "faults": faults,
                        "plugin_accounting": arm in PLUGIN_ARMS},
           "faults": []}
    side = args.state_dir / f"chaos-{arm}.json"
    carried = carried_faults(side, res["settings"], faults)
    res["faults"] = carried
    if carried:
        log(f"  chaos: {len(carried)} fault(s) measured by an earlier invocation kept: {[f['fault'] for f in carried]}")

    def save(partial: dict) -> None:
        atomic_write(side, json.dumps(partial, indent=1, default=str))
        keep(partial)

    not_run = [f for f in parse_faults(args.chaos_faults) if f not in faults]
    if not_run:
        res["not_applicable"] = {f: "PD arms only" for f in not_run}
    ctx = Chaos(target, run, res)
    res["settings"]["settle_s"] = ctx.settle_s
    if dl.left() < args.reserve_s + args.chaos_fault_min_s:
        res["skipped_rest"] = "deadline"
        res["verdict"] = verdict(res)
        return res
    res["baseline"] = ctx.baseline()
    save(res)
    for fault in faults:
        need = max([args.chaos_fault_min_s] + ctx.fault_s) + (args.chaos_restart_s if fault.endswith("_kill") else 0)
        if dl.left() - args.reserve_s < need:
            res["faults"].append({"fault": fault, "what": FAULT_WHAT[fault],
                                  "skipped": f"deadline: {dl.left() - args.reserve_s:.0f} s left < {need:.0f} s"})
            res["skipped_rest"] = "deadline"
            log(f"  chaos {fault}: SKIPPED ({res['faults'][-1]['skipped']})")
            save(res)
            continue
        log(f"  chaos {fault}: {FAULT_WHAT[fault]}")
        try:
            row = ctx.run_fault(fault)
        except ServerDied:
            res["faults"][-1]["ok"] = False
            res["verdict"] = "fail"
            save(res)
            raise
        if not fault.endswith("_kill"):
            ctx.fault_s.append(row["duration_s"])
        failed = [c for c in row["checks"] if not c["ok"]]
        log(f"  chaos {fault}: {'ok' if row['ok'] else 'FAILED'} in {row['duration_s']} s; requests {row['requests']}"
            + "".join(f"\n    FAILED {c['check']}: {c['detail']}" for c in failed))
        res["verdict"] = verdict(res)
        save(res)
    order = {f: i for i, f in enumerate(FAULTS)}
    res["faults"].sort(key=lambda f: order[f["fault"]])
    res["verdict"] = verdict(res)
    skipped = [f["fault"] for f in res["faults"] if f.get("skipped")]
    log(f"  chaos: verdict {res['verdict']} ({sum(1 for f in res['faults'] if f.get('ok'))} of {len(res['faults'])} "
        f"faults passed)" + (f"; to measure the skipped ones: --arms {arm} --phases chaos,report --chaos-faults "
                             f"{','.join(skipped)} (same state dir; the results merge)" if skipped else ""))
    save(res)
    return res


# ---------------------------------------------------------------------------------------------- report
def render_chaos(arms: dict, present: list[str]) -> list[str]:
    """The chaos section of results.md: per arm its faults, what each checked and the numbers."""
    have = [x for x in present if (arms[x].get("chaos") or {}).get("settings")]
    if not have:
        return []
    out = ["", "## Chaos: faults while requests decode (issue #27)", ""]
    for x in have:
        r = arms[x]["chaos"]
        st = r["settings"]
        out.append(f"**Arm {x}: verdict {str(r.get('verdict', '?')).upper()}.** {st['requests']} streaming requests of "
                   f"{st['input_len']} + {st['output_len']} tokens; each fault injected once every request had "
                   f"{st['inject_after']} tokens (the PD kills: at the first token, mid-transfer); back to the idle "
                   f"baseline within {st.get('settle_s')} s; a probe of {st['probe'][0]} + {st['probe'][1]} tokens "
                   f"decodes alone so that the plugin logs its accounting (rows within {st['row_tolerance']}).")
        b = r.get("baseline") or {}
        p = b.get("probe") or {}
        m = b.get("metrics")
        out.append(f"Baseline: loads {b.get('loads')}; probe: {p.get('tokens')} tokens, host rows "
                   f"{p.get('host_rows_used_max')}, device rows {p.get('device_rows_used_max')}, quarantined "
                   f"{p.get('quarantined_max')}, requests {p.get('requests_max')}; /metrics: "
                   f"{'not exported (no --enable-metrics)' if not m or 'gauges' not in m else m['gauges']}"
                   + (f"; PROBLEMS: {'; '.join(b['problems'])}" if b.get("problems") else ""))
        out += ["", "| fault | what | requests at the end | fresh request | idle again (s) | accounting back (s) | verdict |",
                "|---|---|---|---|---|---|---|"]
        for f in r.get("faults", []):
            if f.get("skipped"):
                out.append(f"| {f['fault']} | {f['what']} | – | – | – | – | skipped: {f['skipped']} |")
                continue
            fr, stl = f.get("fresh") or {}, f.get("settle") or {}
            req = ", ".join(f"{k} {v}" for k, v in sorted((f.get("requests") or {}).items()))
            earlier = f" (earlier run {f['run']})" if f.get("run") and f.get("run") != r.get("run") else ""
            out.append(f"| {f['fault']}{earlier} | {f['what']} | {req} | {fr.get('tokens')} tokens, {fr.get('finish')} | "
                       f"{(stl.get('idle') or {}).get('after_s')} | {stl.get('accounting_after_s')} | "
                       f"{'pass' if f.get('ok') else 'FAIL'} |")
        out.append("")
        for f in r.get("faults", []):
            if f.get("skipped"):
                continue
            out.append(f"- **{f['fault']}**: " + "; ".join(f"{'✓' if c['ok'] else '✗ FAIL'} {c['check']}: {c['detail']}"
                                                          for c in f.get("checks", [])))
        if r.get("not_applicable"):
            out.append(f"- not run on this arm: {r['not_applicable']}")
        out.append("")
    return out
