"""Request lifecycle of HiSparse: resident and offloaded requests, swap-in, eager backup.

Framework-free: requests are SGLang request-pool slots (ints) and token positions; the SGLang
adapter in ``integration/sglang`` translates SGLang's calls into these.

Modes of a decoding request:

* **resident**: every token has a device row (``KVAllocator.device_row_of_loc``); the swap-in op
  only translates positions to rows. Its KV is written through to the host pool (staging after
  prefill, then each new token by the forward that writes it), so it can be demoted at any step.
* **offloaded**: the request owns a device buffer (``DeviceBufferPool``) of ``D`` LRU slots plus a
  page whose first slot holds the newest token; the swap-in op copies missed tokens from host.

Policy (see docs/resident-first.md):

* ``resident_first`` on: requests stay resident while device pages last. When an allocation
  (a prefill, or resident requests starting new pages) lacks pages, in-flight promotions are
  cancelled and then resident requests are demoted, longest context first, preferring requests
  out of their cooldown, until enough pages are free. An offloaded request is promoted back
  (shortest first, at most ``max_switches_per_step`` per step) when, after the promotion,
  ``promote_free_fraction`` of the device pool stays free and its cooldown has passed.
  Promotion copies the KV host -> device on a side stream while the request keeps decoding
  offloaded, then switches at a later step.
* ``resident_first`` off: a request is demoted as soon as it outgrows its buffer (SGLang's
  in-tree behaviour) and never promoted.

Demotion needs no copy: the request keeps ``D`` of its resident rows (the most recent whole pages)
as LRU slots and the page of its newest token as the reserved page; the other pages are freed.

Host work per decode step (``prepare_decode``, on the scheduler's critical path): none for a
resident request whose new token continues a page (its page was mapped whole when it started);
one entry of one bind launch for a resident request starting a page and for every offloaded
request (its new token goes to slot ``D``). The eager backup of every new token runs inside the
forward: the swap-in of each layer first copies each request's newest token, which the layer
has just written, to its host row (``backup_newest``), so it is CUDA-graph captured and costs the
host nothing.

Speculative decoding (EAGLE / NextN MTP, ``speculative.py``, docs/speculative.md): a coordinator then
serves verify steps instead of decode steps (``prepare_verify``, ``swap_in_verify`` per layer,
``commit_verify``): each request verifies ``T`` positions per step, an offloaded one in buffer slots
``D + 1 .. D + T``, and only the accepted tokens' KV is backed up to the host, by the commit.
"""

from hisparse_sglang.coordinator.core import Coordinator
from hisparse_sglang.coordinator.policy import ModePolicy
from hisparse_sglang.coordinator.speculative import VerifyOps, VerifySteps
from hisparse_sglang.coordinator.state import OFFLOADED, RESIDENT, RequestRecord, SlotTable, SpecState
from hisparse_sglang.coordinator.telemetry import CoordinatorStats

__all__ = [
    "Coordinator", "CoordinatorStats", "ModePolicy", "RequestRecord", "SlotTable", "SpecState", "VerifyOps",
    "VerifySteps", "RESIDENT", "OFFLOADED",
]
