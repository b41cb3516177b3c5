"""Hook body for metrics (``hooks.HOOKS`` declares it): the HiSparse log line and Prometheus
metrics with SGLang's decode statistics.

Imports of sglang and of the adapters happen lazily, in the process that runs the hook.
"""

from __future__ import annotations

from hisparse_sglang.integration.sglang.hook_lookup import coordinator_of


def _report_decode_stats_after(result, self, *args, **kwargs):
    """AFTER SchedulerMetricsReporter.report_decode_stats: the HiSparse log line and metrics. (Its
    third parameter is ``num_correct_drafts`` up to 0.5.19, ``num_generated_tokens`` from 0.5.20.)"""
    coordinator = coordinator_of(self.scheduler)
    if coordinator is None or self.forward_ct_decode % self.decode_log_interval != 0:
        return result
    if not (self.is_stats_logging_rank or self.current_scheduler_metrics_enabled):
        return result
    from hisparse_sglang.integration.sglang import metrics

    labels = getattr(self.metrics_collector, "labels", None) if self.current_scheduler_metrics_enabled else None
    metrics.report(coordinator, log=self.is_stats_logging_rank, prometheus_labels=labels)
    return result
