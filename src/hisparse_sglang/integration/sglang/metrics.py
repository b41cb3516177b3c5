"""HiSparse's decode log line and Prometheus metrics (scheduler process).

The log line follows SGLang's decode log line (every ``--decode-log-interval`` decode steps). With
``--enable-metrics`` the same figures are exported as ``hisparse:*`` metrics; SGLang serves every
process's metrics on its ``/metrics`` endpoint (multiprocess mode).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("hisparse_sglang")

_GAUGES = (
    ("hit_rate", "Share of top-k lookups of offloaded requests found in their GPU buffer (last interval)"),
    ("resident", "Requests whose whole KV is on the GPU"),
    ("offloaded", "Requests decoding from their GPU buffer"),
    ("demotions_per_min", "Resident-to-offloaded switches per minute (last interval)"),
    ("promotions_per_min", "Offloaded-to-resident switches per minute (last interval)"),
    ("switch_ms_max", "Longest host time one scheduler step spent switching modes (last interval), ms"),
    ("step_host_ms", "Mean host time of HiSparse's bookkeeping per decode step (last interval), ms"),
    ("step_host_ms_max", "Longest host time of HiSparse's bookkeeping in one decode step (last interval), ms"),
    ("device_rows_used", "GPU KV rows in use"),
    ("device_rows_total", "GPU KV rows in the pool"),
    ("host_rows_used", "Host KV rows in use"),
    ("host_rows_total", "Host KV rows in the pool"),
    ("host_rows_quarantined", "Host KV rows (whole pages) held back after PD transfers that did not complete"),
)
_COUNTERS = (
    ("lookups", "Top-k entries (not the newest token) looked up for offloaded requests"),
    ("misses", "Top-k tokens copied host -> device"),
    ("bytes_moved", "Bytes copied host -> device by the swap-in"),
)


def report(coordinator, log: bool, prometheus_labels: dict | None) -> dict:
    values = coordinator.report()
    if log:
        hit = f"{100 * values['hit_rate']:.1f}%" if values["hit_rate"] is not None else "n/a"
        logger.info(
            "HiSparse: hit rate %s, moved %.1f MiB, resident %d, offloaded %d (promoting %d), "
            "demotions %.1f/min, promotions %.1f/min, device rows %d/%d, host rows %d/%d (quarantined %d), "
            "switch work max %.2f ms/step, step host work %.3f ms (max %.2f)",
            hit, values["bytes_moved"] / 2**20, values["resident"], values["offloaded"], values["promoting"],
            values["demotions_per_min"], values["promotions_per_min"], values["device_rows_used"],
            values["device_rows_total"], values["host_rows_used"], values["host_rows_total"],
            values["host_rows_quarantined"],
            values["switch_ms_max"], values["step_host_ms"], values["step_host_ms_max"],
        )
    if prometheus_labels is not None:
        runtime = coordinator.runtime
        if runtime.metrics is None:
            runtime.metrics = _create(sorted(prometheus_labels))
        _export(runtime.metrics, values, prometheus_labels)
    return values


def _create(label_names: list[str]) -> dict:
    """This process's hisparse:* metrics (imported here, in the scheduler process, after SGLang set
    PROMETHEUS_MULTIPROC_DIR)."""
    from prometheus_client import Counter, Gauge

    metrics = {
        name: Gauge(f"hisparse:{name}", doc, labelnames=label_names, multiprocess_mode="mostrecent")
        for name, doc in _GAUGES
    }
    metrics.update({name: Counter(f"hisparse:{name}", doc, labelnames=label_names) for name, doc in _COUNTERS})
    return metrics


def _export(metrics: dict, values: dict, labels: dict) -> None:
    for name, _ in _GAUGES:
        if values.get(name) is not None:
            metrics[name].labels(**labels).set(values[name])
    for name, _ in _COUNTERS:
        if values[name]:
            metrics[name].labels(**labels).inc(values[name])
