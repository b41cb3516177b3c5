"""The plugin's metrics as a server's ``/metrics`` endpoint shows them, checked against its log line.

    text = fetch_metrics(port)                      # GET http://127.0.0.1:<port>/metrics
    values = plugin_values(text)                    # {"hit_rate": 0.97, "resident": 3, ...}
    check = compare_with_log(values, log_text)      # {"mismatches": [...], "log": {...}, ...}

Metric names and the report keys they carry come from the plugin itself
(``hisparse_sglang.integration.sglang.metrics.METRICS``), so this module follows a rename. The log line
is the plugin's ``HiSparse: hit rate ...`` line (``metrics.report``). Both are written by the same
report call, the log line first: compare them while the server decodes nothing (after a phase's
requests finished), so that no report falls between reading the log and scraping. The gauges then
equal the last line's figures up to the line's rounding, and each counter of bytes equals the sum of
the ``moved`` figures of every line of the server's log (the swap-in since the server started).
Pure functions on text except :func:`fetch_metrics`; the plugin's metrics module imports no SGLang.
"""

from __future__ import annotations

import math
import re
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))
from hisparse_sglang.integration.sglang.metrics import METRICS  # noqa: E402

HOST = "127.0.0.1"
_SAMPLE_RE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
# The plugin's periodic line (metrics.report), every field captured.
LOG_LINE_RE = re.compile(
    r"HiSparse: hit rate (?:(?P<hit_rate_pct>[0-9.]+)%|n/a), moved (?P<moved_mib>[0-9.]+) MiB, "
    r"resident (?P<resident>\d+), offloaded (?P<offloaded>\d+) \(promoting (?P<promoting>\d+)\), "
    r"demotions (?P<demotions_per_min>[0-9.]+)/min, promotions (?P<promotions_per_min>[0-9.]+)/min, "
    r"device rows (?P<device_rows_used>\d+)/(?P<device_rows_total>\d+), "
    r"host rows (?P<host_rows_used>\d+)/(?P<host_rows_total>\d+) \(quarantined (?P<host_rows_quarantined>\d+)\), "
    r"switch work max (?P<switch_ms_max>[0-9.]+) ms/step, "
    r"step host work (?P<step_host_ms>[0-9.]+) ms \(max (?P<step_host_ms_max>[0-9.]+)\)"
    r"(?:, verify caps (?P<verify_rows_capped>\d+) \((?P<verify_drafts_dropped>\d+) drafts dropped\))?"
    r"(?:, prefills staged by DMA (?P<prefills_staged_by_dma>\d+), by kernel (?P<prefills_staged_by_kernel>\d+))?"
)
# Report keys of the log line and how far the line's rounding lets a figure stray from the metric.
LOG_TOLERANCE = {
    "hit_rate": 0.0005, "resident": 0, "offloaded": 0, "promoting": 0, "demotions_per_min": 0.05,
    "promotions_per_min": 0.05, "device_rows_used": 0, "device_rows_total": 0, "host_rows_used": 0,
    "host_rows_total": 0, "host_rows_quarantined": 0, "switch_ms_max": 0.005, "step_host_ms": 0.0005,
    "step_host_ms_max": 0.005,
}


def fetch_metrics(port: int, host: str = HOST, timeout: float = 10.0) -> str:
    """The text of ``http://host:port/metrics`` (SGLang serves it with ``--enable-metrics``)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as response:
        return response.read().decode()


def parse_samples(text: str) -> list[tuple[str, dict, float]]:
    """Every sample of a Prometheus text exposition: (name, labels, value); comments skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE_RE.match(line)
        if match is None:
            raise ValueError(f"not a Prometheus sample line: {line[:200]!r}")
        labels = {
            name: re.sub(r"\\[\\\"n]", lambda escape: _UNESCAPE[escape.group(0)], value)
            for name, value in _LABEL_RE.findall(match.group("labels") or "")
        }
        samples.append((match.group("name"), labels, float(match.group("value"))))
    return samples


def plugin_values(text: str, labels: dict | None = None) -> dict:
    """The plugin's figures in one label set, keyed like ``coordinator.report()`` (``hit_rate``,
    ``resident``, ..., ``lookups``, ``bytes_moved``, ``demotions_total``); a hit rate of NaN becomes None.

    Args:
        text: a ``/metrics`` text.
        labels: label values the series must have (e.g. ``{"tp_rank": "0"}``); None takes the only
            label set present.
    Raises:
        ValueError: no plugin metric matches, or several label sets do (name them in ``labels``).
    """
    wanted = {spec.name: spec.key for spec in METRICS}
    chosen: dict[tuple, dict] = {}
    for name, sample_labels, value in parse_samples(text):
        if name not in wanted or any(sample_labels.get(k) != str(v) for k, v in (labels or {}).items()):
            continue
        chosen.setdefault(tuple(sorted(sample_labels.items())), {})[wanted[name]] = value
    if not chosen:
        raise ValueError(f"no sglang:hisparse_* metric{' with ' + str(labels) if labels else ''} in the text")
    if len(chosen) > 1:
        raise ValueError(
            f"{len(chosen)} label sets carry the plugin's metrics; pick one with labels=: {sorted(chosen)}"
        )
    values = next(iter(chosen.values()))
    if "hit_rate" in values and math.isnan(values["hit_rate"]):
        values["hit_rate"] = None
    return values


def parse_log_lines(log_text: str) -> list[dict]:
    """Every plugin line of a server log, keyed like ``coordinator.report()`` (``bytes_moved`` from the
    line's MiB, so only to 0.05 MiB)."""
    lines = []
    for match in LOG_LINE_RE.finditer(log_text):
        fields = {key: value for key, value in match.groupdict().items() if value is not None}
        line = {key: (float(value) if "." in value else int(value)) for key, value in fields.items()}
        line["hit_rate"] = line.pop("hit_rate_pct") / 100 if "hit_rate_pct" in line else None
        line["bytes_moved"] = line.pop("moved_mib") * 2**20
        lines.append(line)
    return lines


def compare_with_log(values: dict, log_text: str) -> dict:
    """Check scraped values against the server's log (its whole text since start, or None of it).

    Returns:
        ``log`` (the last line's figures), ``lines`` (how many), ``mismatches`` (one sentence each: a
        gauge unlike the last line beyond its rounding, or the bytes counter unlike the sum of the lines'
        ``moved`` beyond 0.05 MiB per line); ``mismatches`` names a missing line or metric too.
    """
    lines = parse_log_lines(log_text)
    if not lines:
        return {"log": None, "lines": 0, "mismatches": ["no 'HiSparse: hit rate' line in the log"]}
    last, mismatches = lines[-1], []
    for key, tolerance in LOG_TOLERANCE.items():
        if key not in values:
            mismatches.append(f"{key}: not among the scraped metrics")
            continue
        scraped, logged = values[key], last[key]
        if scraped is None or logged is None:
            if scraped is not logged:
                mismatches.append(f"{key}: metric {scraped}, log {logged}")
        elif abs(scraped - logged) > tolerance + 1e-9:
            mismatches.append(f"{key}: metric {scraped:g}, log {logged:g} (tolerance {tolerance:g})")
    if "bytes_moved" in values:
        logged_bytes = sum(line["bytes_moved"] for line in lines)
        if abs(values["bytes_moved"] - logged_bytes) > 0.05 * 2**20 * len(lines) + 1:
            mismatches.append(
                f"bytes_moved: counter {values['bytes_moved'] / 2**20:.2f} MiB, the {len(lines)} log lines sum to "
                f"{logged_bytes / 2**20:.2f} MiB"
            )
    # speculative decoding: the cap counters against the sum of the lines' caps (lines without them: none)
    for key in ("verify_rows_capped", "verify_drafts_dropped"):
        if f"{key}_total" in values and any(key in line for line in lines):
            logged = sum(line.get(key, 0) for line in lines)
            if values[f"{key}_total"] != logged:
                mismatches.append(f"{key}: counter {values[f'{key}_total']:g}, the {len(lines)} log lines sum to {logged}")
    return {"log": last, "lines": len(lines), "mismatches": mismatches}


def scrape_and_compare(port: int, log_text: str, labels: dict | None = None, host: str = HOST) -> dict:
    """:func:`fetch_metrics`, :func:`plugin_values` and :func:`compare_with_log` in one call; ``metrics``
    holds the scraped values."""
    values = plugin_values(fetch_metrics(port, host), labels)
    return {"metrics": values, **compare_with_log(values, log_text)}
