"""One scheduler process's metrics, end to end on the CPU (run by test_metrics_sglang.py in a fresh process,
because prometheus_client picks multiprocess mode when it is first imported).

    PROMETHEUS_MULTIPROC_DIR=<dir> python metrics_peer.py OUT.json

SGLang's scheduler metrics collector is built with the labels SGLang gives it (names and order as
``SchedulerMetricsCollector.init_new`` builds them in 0.5.17-0.5.23, plus an ``--extra-metric-labels``
entry and ``dp_rank``); our coordinator (SGLang's pools on CPU tensors, the Stack of
test_coordinator_sglang.py) decodes, demotes and swaps in, and ``metrics.report`` runs as the decode-stats
hook runs it, with the collector's label dict. The ``/metrics`` text is what SGLang's own route serves
(``add_prometheus_middleware`` on an app, read with a test client). OUT.json receives that text, the
plugin's log lines, every report's values, the collector's labels, and the text after the first report.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys

assert os.environ.get("PROMETHEUS_MULTIPROC_DIR"), "set PROMETHEUS_MULTIPROC_DIR before prometheus_client is imported"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_coordinator_sglang import PAGE, Stack, publish_server_args  # noqa: E402

from hisparse_sglang.integration.sglang import compat, metrics  # noqa: E402

# SGLang's scheduler labels, in init_new's order: model_name, engine_type, tp_rank, pp_rank, moe_ep_rank,
# then dp_rank (DP attention) and the user's --extra-metric-labels.
SGLANG_LABELS = {"model_name": "tiny-dsv32", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0,
                 "dp_rank": 0, "cluster": "lab \"a\"\\b"}


def main(out_path: str) -> None:
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector
    from sglang.srt.utils.common import add_prometheus_middleware
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    server_args = publish_server_args(enable_metrics=True)
    collector = SchedulerMetricsCollector(labels=dict(SGLANG_LABELS), server_args=server_args)
    collector.num_running_reqs.labels(**collector.labels).set(3)  # one of SGLang's own series, to compare labels

    log_text = io.StringIO()
    handler = logging.StreamHandler(log_text)
    logging.getLogger("hisparse_sglang").addHandler(handler)
    logging.getLogger("hisparse_sglang").setLevel(logging.INFO)

    app = Starlette()
    add_prometheus_middleware(app)
    client = TestClient(app)

    stack = Stack(resident_first=True, device_tokens=PAGE * 36)
    reports = [metrics.report(stack.coordinator, log=True, prometheus_labels=collector.labels)]  # nothing yet
    first_text = client.get("/metrics").text
    reqs = [stack.new_req(f"r{i}", 800) for i in range(3)]
    for req in reqs[:2]:
        stack.prefill(req, 800)
    running = stack.coordinator.collect_ready_reqs()
    stack.decode(running)
    reports.append(metrics.report(stack.coordinator, log=True, prometheus_labels=collector.labels))
    stack.prefill(reqs[2], 800)  # needs pages that only a demotion frees
    running += stack.coordinator.collect_ready_reqs()
    for _ in range(6):
        stack.decode(running)
    reports.append(metrics.report(stack.coordinator, log=True, prometheus_labels=collector.labels))
    for _ in range(3):
        stack.decode(running)
    reports.append(metrics.report(stack.coordinator, log=True, prometheus_labels=collector.labels))

    response = client.get("/metrics")
    assert response.status_code == 200, response.status_code
    with open(out_path, "w") as out:
        json.dump({"metrics_text": response.text, "metrics_text_first": first_text,
                   "log_text": log_text.getvalue(), "reports": reports,
                   "labels": {key: str(value) for key, value in collector.labels.items()},
                   "sglang_version": compat.sglang_version()}, out)


if __name__ == "__main__":
    main(sys.argv[1])
