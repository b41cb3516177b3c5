"""HiSparse's decode log line and Prometheus metrics (scheduler process).

The log line follows SGLang's decode log line (every ``--decode-log-interval`` decode steps). With
``--enable-metrics`` the same figures are exported the way SGLang exports its own scheduler metrics:
named ``sglang:hisparse_<what>`` (counters end in ``_total``, sizes in ``_tokens``, times in ``_ms``),
labelled with the labels of SGLang's scheduler metrics collector (``model_name``, ``engine_type``,
``tp_rank``, ``pp_rank``, ``moe_ep_rank``, and ``dp_rank``, ``priority`` and ``--extra-metric-labels``
where SGLang adds them: the hook passes the collector's own label dict), gauges in SGLang's
``mostrecent`` multiprocess mode. SGLang serves every process's metrics on its ``/metrics`` endpoint
(multiprocess mode). docs/metrics.md lists them with a PromQL example per dashboard panel.
"""

from __future__ import annotations

import dataclasses
import logging
import math

logger = logging.getLogger("hisparse_sglang")

__all__ = ["METRICS", "MetricSpec", "PrometheusExporter", "report"]


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    """One exported metric.

    Attributes:
        name: the exported name (a counter's samples carry exactly this name).
        kind: ``gauge`` (set to the latest report's value) or ``counter`` (increased by the report's delta).
        key: the key of ``SGLangHiSparseCoordinator.report()`` it comes from; for a counter either a
            per-report delta or, with ``cumulative``, a total since start.
        doc: the help text.
        cumulative: the key is a running total; the counter is increased by its change.
    """

    name: str
    kind: str
    key: str
    doc: str
    cumulative: bool = False


def _gauge(what: str, key: str, doc: str) -> MetricSpec:
    return MetricSpec(f"sglang:hisparse_{what}", "gauge", key, doc)


def _counter(what: str, key: str, doc: str, cumulative: bool = False) -> MetricSpec:
    return MetricSpec(f"sglang:hisparse_{what}_total", "counter", key, doc, cumulative)


METRICS = (
    _gauge("hit_rate", "hit_rate",
           "Share of the top-k lookups of offloaded requests found in their GPU buffer, over the last log "
           "interval (NaN when the interval had no lookups)."),
    _gauge("num_resident_reqs", "resident", "Requests whose whole KV is on the GPU."),
    _gauge("num_offloaded_reqs", "offloaded", "Requests decoding from their GPU buffer (KV in host memory)."),
    _gauge("num_promoting_reqs", "promoting", "Offloaded requests whose KV is being copied back to the GPU."),
    _gauge("demotions_per_min", "demotions_per_min", "Resident-to-offloaded switches per minute, last log interval."),
    _gauge("promotions_per_min", "promotions_per_min", "Offloaded-to-resident switches per minute, last log interval."),
    _gauge("switch_time_max_ms", "switch_ms_max",
           "Longest host time one scheduler step spent switching modes, last log interval, in ms."),
    _gauge("step_host_time_ms", "step_host_ms",
           "Mean host time of HiSparse's bookkeeping per decode step, last log interval, in ms."),
    _gauge("step_host_time_max_ms", "step_host_ms_max",
           "Longest host time of HiSparse's bookkeeping in one decode step, last log interval, in ms."),
    _gauge("device_used_tokens", "device_rows_used", "GPU KV pool rows (tokens) in use."),
    _gauge("device_total_tokens", "device_rows_total", "GPU KV pool rows (tokens)."),
    _gauge("host_used_tokens", "host_rows_used", "Host KV pool rows (tokens) in use."),
    _gauge("host_total_tokens", "host_rows_total", "Host KV pool rows (tokens)."),
    _gauge("host_quarantined_tokens", "host_rows_quarantined",
           "Host KV rows (whole pages) held back after PD transfers that did not complete (pd_quarantine_s)."),
    _counter("lookups", "lookups", "Top-k entries (all but the newest token) looked up in the GPU buffers of offloaded "
             "requests, summed over layers."),
    _counter("misses", "misses", "Top-k tokens copied host -> device by the swap-in, summed over layers."),
    _counter("swap_in_bytes", "bytes_moved", "Bytes copied host -> device by the swap-in."),
    _counter("demotions", "demotions_total", "Resident-to-offloaded switches.", cumulative=True),
    _counter("promotions", "promotions_total", "Offloaded-to-resident switches.", cumulative=True),
    _counter("verify_capped_reqs", "verify_rows_capped_total",
             "Speculative decoding: verify steps of a request whose accept length was capped because its GPU buffer "
             "could not hold every verify position's top-k (the later positions were left out).", cumulative=True),
    _counter("verify_dropped_drafts", "verify_drafts_dropped_total",
             "Speculative decoding: draft tokens SGLang accepted that those caps dropped.", cumulative=True),
)


class PrometheusExporter:
    """This process's metrics and the running totals already added to the cumulative counters."""

    def __init__(self, label_names: list[str]) -> None:
        # Imported here, in the scheduler process, after SGLang set PROMETHEUS_MULTIPROC_DIR.
        from prometheus_client import Counter, Gauge

        self.metrics = {
            spec.name: (
                Gauge(spec.name, spec.doc, labelnames=label_names, multiprocess_mode="mostrecent")
                if spec.kind == "gauge"
                else Counter(spec.name, spec.doc, labelnames=label_names)
            )
            for spec in METRICS
        }
        self.exported_totals = {spec.key: 0 for spec in METRICS if spec.cumulative}

    def export(self, values: dict, labels: dict) -> None:
        for spec in METRICS:
            metric = self.metrics[spec.name].labels(**labels)
            value = values[spec.key]
            if spec.kind == "gauge":
                metric.set(math.nan if value is None else value)
                continue
            if spec.cumulative:
                value, self.exported_totals[spec.key] = value - self.exported_totals[spec.key], value
            if value > 0:
                metric.inc(value)


def report(coordinator, log: bool, prometheus_labels: dict | None) -> dict:
    """Log the coordinator's figures since the previous report and/or export them.

    Args:
        coordinator: the process's SGLangHiSparseCoordinator.
        log: write the ``HiSparse: hit rate ...`` line (SGLang's stats-logging rank).
        prometheus_labels: the labels of SGLang's scheduler metrics collector, or None when this
            process exports no metrics.
    Returns:
        ``coordinator.report()``'s values.
    """
    values = coordinator.report()
    if log:
        hit = f"{100 * values['hit_rate']:.1f}%" if values["hit_rate"] is not None else "n/a"
        # with speculative decoding: verify steps capped (a request's positions named more tokens than its GPU
        # buffer holds; docs/speculative.md 2.9) and the accepted drafts those caps dropped
        caps = "" if values["verify_rows_capped"] is None else (
            f", verify caps {values['verify_rows_capped']} ({values['verify_drafts_dropped']} drafts dropped)"
        )
        logger.info(
            "HiSparse: hit rate %s, moved %.1f MiB, resident %d, offloaded %d (promoting %d), "
            "demotions %.1f/min, promotions %.1f/min, device rows %d/%d, host rows %d/%d (quarantined %d), "
            "switch work max %.2f ms/step, step host work %.3f ms (max %.2f)%s, "
            "prefills staged by DMA %d, by kernel %d",
            hit, values["bytes_moved"] / 2**20, values["resident"], values["offloaded"], values["promoting"],
            values["demotions_per_min"], values["promotions_per_min"], values["device_rows_used"],
            values["device_rows_total"], values["host_rows_used"], values["host_rows_total"],
            values["host_rows_quarantined"],
            values["switch_ms_max"], values["step_host_ms"], values["step_host_ms_max"], caps,
            values["prefills_staged_by_dma_total"], values["prefills_staged_by_kernel_total"],
        )
    if prometheus_labels is not None:
        from hisparse_sglang.integration.sglang.runtime import runtime_of

        runtime_of(coordinator).export_metrics(values, prometheus_labels)
    return values
