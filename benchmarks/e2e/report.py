"""Results: the per-arm JSON of the state dir merged into results.json, rendered as results.md, mirrored to $OUT."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from arms import ALL_ARMS, ARM_LABELS, DSA_BACKEND_OF_KV_DTYPE, MTP_ARMS, PD_ARMS
from bench_serving_phase import render_serving
from chaos import render_chaos
from common import atomic_write
from hostpool import render_hostpool
from judge import judge_correctness
from logs import same_weights
from lowload import lowload_ratios
from stats import compare_outputs

COMPARE_PAIRS = (("b", "a"), ("c", "a"), ("c", "b"), ("d", "a"), ("c", "d"), ("pd-c", "a"), ("pd-b", "a"),
                 ("pd-c", "pd-b"), ("dx", "a"),
                 ("c+mtp", "a+mtp"), ("d+mtp", "a+mtp"), ("b+mtp", "a+mtp"), ("a+mtp", "a"), ("c+mtp", "a"),
                 ("d+mtp", "a"), ("c+mtp", "c"), ("pd-c+mtp", "a+mtp"), ("pd-c+mtp", "a"), ("pd-c+mtp", "pd-c"),
                 ("dx+mtp", "a+mtp"))
BASELINE_ARMS = ("a", "a+mtp")  # the judge's verdict is given against these (judge.py)
MAX_OUT_FILES = 8  # what the device tool brings back from $OUT


def load_state(state: Path) -> dict:
    arms = {}
    for arm in ALL_ARMS:
        p = state / f"arm-{arm}.json"
        if p.exists():
            with contextlib.suppress(Exception):
                arms[arm] = json.loads(p.read_text())
    meta = {}
    if (state / "meta.json").exists():
        with contextlib.suppress(Exception):
            meta = json.loads((state / "meta.json").read_text())
    return {"meta": meta, "arms": arms}


def build_report(state: Path, imported: list[Path]) -> dict:
    data = load_state(state)
    for f in imported:
        with contextlib.suppress(Exception):
            other = json.loads(Path(f).read_text())
            for arm, r in other.get("arms", {}).items():
                data["arms"].setdefault(arm, r | {"imported_from": str(f)})
            for k, v in other.get("meta", {}).items():
                data["meta"].setdefault(k, v)
    arms = data["arms"]
    comp = {}
    for x, y in COMPARE_PAIRS:
        cx, cy = arms.get(x, {}).get("correctness"), arms.get(y, {}).get("correctness")
        if cx and cy:
            c = compare_outputs(cy, cx)
            c["same_weights"] = same_weights(arms[x].get("weight_fingerprints"), arms[y].get("weight_fingerprints"))
            if y in BASELINE_ARMS:
                c["verdict"] = judge_correctness(cx, cy, c["same_weights"])
            comp[f"{x}_vs_{y}"] = c
    data["compare"] = comp
    data["lowload_ratios"] = lowload_ratios(arms)
    return data


def fmt(v, nd=1):
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def render_markdown(data: dict) -> str:
    meta, arms, comp = data.get("meta", {}), data.get("arms", {}), data.get("compare", {})
    pf = meta.get("preflight", {})
    model = Path(str(meta.get("args", {}).get("model_dir") or "tiny-dsv32")).name
    sglang = (pf.get("versions") or {}).get("sglang") or "?"
    lines = [f"# HiSparse end-to-end benchmark (SGLang {sglang}, model {model}, dummy weights)", ""]
    lines.append(f"- date: {meta.get('date', '?')}; GPU: {', '.join(pf.get('gpu') or ['?'])}")
    v = pf.get("versions") or {}
    lines.append("- versions: " + ", ".join(f"{k} {v[k]}" for k in sorted(v) if v[k]) + f"; python {pf.get('python', '?')}")
    a = meta.get("args", {})
    kv_dtype = a.get("kv_cache_dtype", "bfloat16")
    lines.append(f"- server: dsa + {DSA_BACKEND_OF_KV_DTYPE.get(kv_dtype, '?')} prefill/decode, {kv_dtype} KV, CUDA graph "
                 f"{'off' if a.get('disable_cuda_graph') else 'on'}, radix cache off, --max-total-tokens "
                 f"{a.get('max_total_tokens')}, --mem-fraction-static {a.get('mem_fraction_static')}, context "
                 f"{a.get('context_length')}; HiSparse config `{a.get('hisparse_config')}`"
                 + (f" (the plugin's arms: with `{a['plugin_hisparse_config']}`)" if a.get("plugin_hisparse_config") else "")
                 + "; weights: dummy, "
                 f"init `{a.get('weight_init')}`")
    present = [x for x in ALL_ARMS if x in arms]
    mtp = any(x in MTP_ARMS for x in present)
    if mtp:
        steps, accept = a.get("mtp_steps", 1), a.get("mtp_accept_len") or 0
        lines.append(f"- MTP arms (+mtp): EAGLE / NextN, one NextN layer, {steps} draft step(s), topk 1, {steps + 1} "
                     "draft tokens; acceptance: " + (f"SGLang's simulation, {accept} tokens per verify, the draft's "
                     "real tokens (SGLANG_SIMULATE_ACC_LEN)" if accept else "the dummy-weight draft's own"))
    lines.append("")
    lines += render_hostpool(meta)
    if not present:
        return "\n".join(lines + ["(no arm results yet)", ""])
    hdr = "| | " + " | ".join(f"{x}: {ARM_LABELS[x]}" for x in present) + " |"
    lines += [hdr, "|---|" + "---|" * len(present)]

    def row(title, fn):
        vals = []
        for x in present:
            try:
                vals.append(fn(arms[x]))
            except Exception:
                vals.append("–")
        lines.append(f"| {title} | " + " | ".join(vals) + " |")

    row("status", lambda r: r.get("status", "?"))
    row("server start (s)", lambda r: fmt(r.get("startup_s")))
    row("device KV pool (max_total_num_tokens)", lambda r: fmt(r.get("log", {}).get("max_total_num_tokens")))
    row("weight fingerprint", lambda r: ", ".join(r.get("weight_fingerprints") or ["–"])[:40])
    row("correctness prompts ok / distinct outputs", lambda r: f"{r['correctness']['prompts_ok']} / {r['correctness']['distinct_outputs']}")
    row("outputs depend on far context", lambda r: fmt(r["correctness"].get("context_sensitive")))
    if mtp:
        row("MTP: accept length / drafts accepted per step (correctness prompts)",
            lambda r: spec_cell(r["correctness"].get("speculative")))
    row("in-server KV check: rows compared / mismatches (checks)", kv_check_cell)
    cap_len = next((arms[x]["capacity"].get("input_len") for x in present if arms[x].get("capacity")), None)
    if cap_len:
        row(f"max concurrent {cap_len}-token requests running", capacity_cell)
    levels = []
    for x in present:
        for lv in (arms[x].get("throughput") or {}).get("levels", []):
            key = (lv["level"], lv.get("repeat", 0))
            if key not in levels:
                levels.append(key)

    def lvl(r, key):
        return next((v for v in r["throughput"]["levels"] if (v["level"], v.get("repeat", 0)) == key), None)

    for key in levels:
        name = f"c={key[0]}" + (f" (run {key[1] + 1})" if any(k[1] for k in levels) else "")
        row(f"{name}: output tok/s (client)", lambda r, k=key: f"{fmt(lvl(r, k)['output_tok_s'])} (c={lvl(r, k)['concurrency']})")
        row(f"{name}: TPOT median / p90 (ms)", lambda r, k=key: f"{fmt(lvl(r, k)['tpot_ms_median'], 2)} / {fmt(lvl(r, k)['tpot_ms_p90'], 2)}")
        row(f"{name}: decode tok/s (server log, median)", lambda r, k=key: fmt(lvl(r, k)["log_gen_tput_median"]))
        row(f"{name}: TTFT median / max (s)",
            lambda r, k=key: f"{fmt(lvl(r, k)['ttft_s_median'], 2)} / {fmt(lvl(r, k).get('ttft_s_max'), 2)}")
        row(f"{name}: HiSparse host work per decode step (ms, median)",
            lambda r, k=key: fmt(lvl(r, k).get("hisparse_step_host_ms_median"), 3))
        if mtp:
            row(f"{name}: MTP accept length / drafts accepted per step", lambda r, k=key: spec_cell(lvl(r, k).get("speculative")))
    tp = next((arms[x]["throughput"] for x in present if arms[x].get("throughput")), None)
    if tp:
        lines.append(f"\nThroughput: {tp.get('input_len')} input + {tp.get('output_len')} output tokens per request, "
                     "streaming client, all requests sent at once per level.")
    lines += render_serving(arms, present)
    lines += render_lowload(arms, present, data.get("lowload_ratios") or {})
    lines += render_pd(arms, present)
    lines += render_storm(arms, present)
    lines += render_chaos(arms, present)
    if comp:
        lines += ["", "## Greedy outputs compared (token ids, logprobs before the first divergence)", "",
                  "| pair | prompts identical | mismatched tokens | max abs dlogprob | max abs dtop5 | same weights "
                  "| decodes like the baseline (tests/e2e rule) |",
                  "|---|---|---|---|---|---|---|"]
        for k, c in comp.items():
            v = c.get("verdict")
            verdict = "–" if v is None else ("yes" if v["ok"] else "NO: " + "; ".join(v["failures"]))
            if v and v.get("rule") == "noise":
                cross, own, p = v["cross"], v["base_own"], v["p"]
                verdict += (f" (top-5 distance through the first divergence: median {cross['score_median']:.3g}, max "
                            f"{cross['score_max']:.3g}, baseline's own {own['score_median']:.3g} / {own['score_max']:.3g}; "
                            f"first divergence median {cross['first_median']} / own {own['first_median']}; "
                            f"p {p['score']:.2g} / {p['first']:.2g} / {p['own_score']:.2g})")
            lines.append(f"| {k} | {c['prompts_identical']}/{c['prompts_compared']} | {c['mismatched_tokens']} | "
                         f"{c['max_abs_dlogprob_before_divergence']:.3g} | {c['max_abs_dtop5_before_divergence']:.3g} | "
                         f"{fmt(c.get('same_weights'))} | {verdict} |")
    errs = [(x, arms[x].get("error")) for x in present if arms[x].get("error")]
    errs += [(x, failure) for x in present for failure in arms[x].get("check_failures") or []]
    if errs:
        lines += ["", "## Errors", ""]
        for x, e in errs:
            lines.append(f"- arm {x}: " + str(e).splitlines()[0][:300])
    return "\n".join(lines) + "\n"


def capacity_cell(r: dict) -> str:
    """Most requests running at once, and how many finished their output during the phase (then the count
    is a moving window, not only what memory holds: raise --cap-output-len)."""
    cap = r["capacity"]
    done = sum(n for reason, n in (cap.get("finish_reasons") or {}).items() if "'length'" in reason)
    cell = f"{cap['max_running']} of {cap['requests']}"
    return cell + (f" ({done} finished during the phase)" if done else "")


def spec_cell(spec: dict | None) -> str:
    """An MTP arm's accept length (tokens per verify step, the bonus included) and the histogram of the drafts
    accepted per step (0, 1, ...: step counts), from SGLang's per-request meta_info."""
    if not spec:
        return "–"
    return f"{spec['accept_length']:.2f} / {spec['drafts_accepted_histogram']} ({spec['verify_steps']} steps)"


def kv_check_cell(r: dict) -> str:
    """The in-server KV check's totals of an arm (kv_check_fixture.py), from the server that decodes."""
    kv = r.get("log", {}).get("kv_check")
    if not kv:
        return "–"
    given = kv.get("given_query_rows")
    # query rows whose top-k entries were device rows (the fused verify top-k): checked by the position each stands for
    return f"{kv['rows']} / {kv['mismatches']} ({kv['checks']})" + (f", {given} query rows of device rows" if given else "")


def spread(r: dict, key: str, nd: int = 2) -> str:
    """`median [min-max]` of a low-load figure over its repeats."""
    if r.get(key) is None:
        return "–"
    return f"{fmt(r[key], nd)} [{fmt(r.get(key + '_min'), nd)}–{fmt(r.get(key + '_max'), nd)}]"


def render_lowload(arms: dict, present: list[str], ratios: dict) -> list[str]:
    """The low-load tables: one row per level, one column per arm; then the ratios per level."""
    have = [x for x in present if (arms[x].get("lowload") or {}).get("levels")]
    if not have:
        return []
    st = arms[have[0]]["lowload"]["settings"]
    out = ["", f"## Low load: {st['input_len']} input + {st['output_len']} output tokens, all requests of a level at "
               f"once, {st['repeats']} repeats per level (median [min–max] over the repeats)", ""]
    levels = sorted({lv["level"] for x in have for lv in arms[x]["lowload"]["levels"]})

    def level_of(x: str, c: int) -> dict:
        return next((lv for lv in arms[x]["lowload"]["levels"] if lv["level"] == c), {})

    for title, fn in (
            ("time per output token, ms (per repeat: median over its requests)", lambda r: spread(r, "tpot_ms")),
            ("time per output token while every request of the level decodes, ms", lambda r: spread(r, "steady_tpot_ms")),
            ("decode tok/s, client (output tokens / wall time of the level)", lambda r: spread(r, "output_tok_s", 1)),
            ("decode tok/s, server log (`gen throughput`, median of the level's lines)", lambda r: spread(r, "log_gen_tput", 1)),
            ("HiSparse host work per decode step, ms (plugin log line)", lambda r: spread(r, "step_host_ms", 3)),
            ("MTP accept length (tokens per verify step, median over the repeats)", lambda r: fmt(r.get("accept_length"), 2)),
            ("every running request resident (plugin log: offloaded 0 on every line)",
             lambda r: f"{fmt(r.get('all_resident'))} (offloaded max {fmt(r.get('offloaded_max'))})"
             if r.get("all_resident") is not None else "–")):
        out += [f"**{title}**", "", "| concurrency | " + " | ".join(f"{x}: {ARM_LABELS[x]}" for x in have) + " |",
                "|---|" + "---|" * len(have)]
        for c in levels:
            out.append(f"| {c} | " + " | ".join(fn(level_of(x, c)) if level_of(x, c) else "–" for x in have) + " |")
        out.append("")
    if ratios:
        out += ["**Ratios per level** (time per output token: lower is faster; decode tok/s: higher is faster)", "",
                "| concurrency | " + " | ".join(f"{k} TPOT | {k} steady TPOT | {k} tok/s (client)" for k in ratios) + " |",
                "|---|" + "---|" * (3 * len(ratios))]
        for c in levels:
            cells = []
            for rt in ratios.values():
                r = next((lv for lv in rt["levels"] if lv["level"] == c), {})
                cells += [fmt(r.get("tpot_ms"), 3), fmt(r.get("steady_tpot_ms"), 3), fmt(r.get("output_tok_s"), 3)]
            out.append(f"| {c} | " + " | ".join(cells) + " |")
        other = [k for k, rt in ratios.items() if not rt.get("same_invocation")]
        if other:
            out.append(f"\n{', '.join(other)}: the two arms ran in different invocations (same settings).")
    resident = [lv["level"] for lv in (arms.get("c") or {}).get("lowload", {}).get("levels", []) if lv.get("all_resident")]
    if "c" in have:
        out.append(f"\nArm c kept every running request resident at concurrency: {', '.join(map(str, resident)) or 'none'}.")
    return out


def render_pd(arms: dict, present: list[str]) -> list[str]:
    """Long prompt, concurrency 1 and saturation of every arm that has them; the PD evidence."""
    have = [x for x in present if arms[x].get("longprompt") or arms[x].get("saturation") or arms[x].get("pd")]
    if not have:
        return []
    out = ["", "## PD disaggregation (prefill and decode instance on one GPU, Mooncake over TCP on 127.0.0.1, no RDMA)", "",
           "| | " + " | ".join(f"{x}: {ARM_LABELS[x]}" for x in have) + " |", "|---|" + "---|" * len(have)]

    def row(title, fn):
        cells = []
        for x in have:
            try:
                cells.append(fn(arms[x]))
            except (KeyError, TypeError, IndexError):
                cells.append("–")
        out.append(f"| {title} | " + " | ".join(cells) + " |")

    row("server start (s, per server)", lambda r: str(r.get("startup_s_per_server") or fmt(r.get("startup_s"))))
    row("GPU KV pool of the server that decodes (tokens)", lambda r: fmt(r["log"].get("max_total_num_tokens")))
    row("KV regions registered with Mooncake on the decode, bytes by memory kind",
        lambda r: str(r["pd"]["decode_registered"]["kv"]["by_kind"]))
    lp = next((arms[x]["longprompt"] for x in have if arms[x].get("longprompt")), None)
    if lp:
        row(f"{lp['input_len']}-token prompt (+{lp['output_len']}): admitted and decoded",
            lambda r: "n/a" if r["longprompt"].get("not_applicable") else
            f"{fmt(r['longprompt'].get('admitted_and_decoded'))} ({fmt(r['longprompt'].get('tokens'))} tokens, "
            f"{fmt(r['longprompt'].get('e2e_s'), 1)} s)" + (f": {str(r['longprompt']['error'])[:160]}"
                                                           if r["longprompt"].get("error") else ""))
        row("  plugin log during it: host / device rows in use (max)",
            lambda r: f"{fmt(r['longprompt']['decode_log']['hisparse']['host_rows_used_max'])} / "
                      f"{fmt(r['longprompt']['decode_log']['hisparse']['device_rows_used_max'])}")
    sat = next((arms[x]["saturation"] for x in have if arms[x].get("saturation")), None)
    if sat:
        row(f"TPOT at concurrency 1, {sat['input_len']}+{sat['output_len']} (ms, median [min–max])",
            lambda r: spread(r["saturation"]["concurrency_1"], "tpot_ms"))
        row(f"{sat['requests']} requests at once: most running", lambda r: fmt(r["saturation"]["saturated"]["max_running"]))
        row("  output tok/s (client) / decode tok/s at the most running (server log)",
            lambda r: f"{fmt(r['saturation']['saturated']['output_tok_s'])} / "
                      f"{fmt(r['saturation']['saturated']['log_gen_tput_at_max'])}")
        row("  TPOT median (ms) / ok", lambda r: f"{fmt(r['saturation']['saturated']['tpot_ms_median'], 2)} / "
                                             f"{r['saturation']['saturated']['ok']}")
    for x in have:
        if x in PD_ARMS and arms[x].get("pd"):
            out += ["", f"Where the KV lands, arm {x}:"] + [f"- {line}" for line in arms[x]["pd"]["statements"]]
    return out


def render_storm(arms: dict, present: list[str]) -> list[str]:
    """The storm table (one row per arm that has a storm result); [] if none has."""
    have = [x for x in present if (arms[x].get("storm") or {}).get("requests")]
    if not have:
        return []
    st = arms[have[0]]["storm"]
    out = ["", f"## Storm: {st['requests']} new {st['input_len']}-token requests (+{st.get('burst_output_len')} output) "
               f"arrive while one request decodes (after its token {st.get('after_tokens')})", "",
           "| arm | TPOT before (ms) | max gap (ms) | p99 gap (ms) | stall (ms) | gaps > 2x TPOT | TPOT after (ms) "
           "| window (s) | burst latency median / max (s) | prefill batches in window | HiSparse switch work max (ms/step) "
           "| HiSparse demotions/min max |",
           "|---|" + "---|" * 11]
    for x in have:
        r = arms[x]["storm"]
        # the first HiSparse line after the burst start covers the window (the plugin reports maxima per interval)
        hs = r.get("hisparse_after_burst_start") or r.get("hisparse_window") or {}
        note = " (timed out)" if r.get("timed_out") else (" (skipped)" if r.get("skipped") else "")
        out.append(f"| {x}{note} | {fmt(r.get('tpot_before_ms'), 2)} | {fmt(r.get('max_gap_ms'))} | {fmt(r.get('p99_gap_ms'))} | "
                   f"{fmt(r.get('stall_ms'))} | {fmt(r.get('gaps_over_2x'))} | {fmt(r.get('tpot_after_ms'), 2)} | "
                   f"{fmt(r.get('window_s'), 2)} | {fmt(r.get('burst_latency_s_median'), 2)} / {fmt(r.get('burst_latency_s_max'), 2)} | "
                   f"{fmt(r.get('prefill_batches_window'))} | {fmt(hs.get('switch_work_max_ms'), 2)} | "
                   f"{fmt(hs.get('demotions_per_min_max'))} |")
    out.append("\nGaps: time between streamed tokens of the decoding request; a chunk of k tokens gives each the gap/k. "
               "Window: first burst request sent .. last burst request done. Stall: sum over the window of "
               "max(0, gap - TPOT before). HiSparse columns: the plugin's `HiSparse:` log lines from the burst start to "
               "the end of the decoding request (– where the arm logs none).")
    return out


def out_name(log: Path) -> str:
    """A log's name in $OUT: this run's harness.log is harness-all-runs.log there, and an MTP arm's
    "+" becomes "_" (server-c_mtp.log), since the device tool brings back no name with a "+"."""
    return "harness-all-runs.log" if log.name == "harness.log" else log.name.replace("+", "_")


class Outputs:
    """Writes results to the state dir and mirrors results/logs to $OUT: results.json, results.md,
    harness.log (this run; the Log writes it), then the server logs of this run's arms, the harness
    log of all runs and the other arms' server logs, as many as fit MAX_OUT_FILES."""

    def __init__(self, state: Path, out: Path | None, imported: list[Path], arms: list[str] | None = None):
        self.state, self.out, self.imported, self.arms = state, out, imported, list(arms or [])

    def server_logs(self) -> list[Path]:
        mine = [p for arm in self.arms for p in sorted(self.state.glob(f"server-{arm}*.log"))
                if p.stem[len("server-"):].removesuffix("-prefill").removesuffix("-decode") == arm]
        others = [p for p in sorted(self.state.glob("server-*.log")) if p not in mine]
        return mine + [self.state / "harness.log"] + others

    def publish(self) -> dict:
        data = build_report(self.state, self.imported)
        text = json.dumps(data, indent=1, default=str)
        md = render_markdown(data)
        atomic_write(self.state / "results.json", text)
        atomic_write(self.state / "results.md", md)
        if self.out:
            atomic_write(self.out / "results.json", text)
            atomic_write(self.out / "results.md", md)
            room = MAX_OUT_FILES - 3  # results.json, results.md, harness.log
            chosen = {out_name(src): src for src in [p for p in self.server_logs() if p.exists()][:room]}
            for stale in list(self.out.glob("server-*.log")) + [self.out / "harness-all-runs.log"]:
                if stale.name not in chosen:  # pushed out by a log of this run's arms
                    with contextlib.suppress(OSError):
                        stale.unlink()
            for name, src in chosen.items():
                self.copy_log(src, self.out / name)
        return data

    @staticmethod
    def copy_log(src: Path, dst: Path, limit: int = 15 << 20) -> None:
        if not src.exists():
            return
        size = src.stat().st_size
        with contextlib.suppress(OSError):
            if size <= limit:
                shutil.copyfile(src, dst)
            else:  # keep the head (startup) and the tail
                with open(src, "rb") as f, open(dst, "wb") as g:
                    g.write(f.read(1 << 20))
                    g.write(f"\n\n[... {size - limit} bytes cut by run_e2e.py ...]\n\n".encode())
                    f.seek(size - (limit - (1 << 20)))
                    g.write(f.read())
