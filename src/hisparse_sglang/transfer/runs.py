"""The write entries of a request: which source bytes go to which decode rows, merged into runs.

A transfer is a list of entries ``(src, dst, length)``: absolute addresses in the prefill process
(``src``) and in the decode process (``dst``, from the decode's :class:`DecodeLayout`).
:func:`page_write_entries` makes one entry per page and layer, layer-major; :func:`merge_runs`
merges entries whose source and destination both continue the previous one (consecutive source
pages granted consecutive decode pages become one large write).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from hisparse_sglang.transfer.errors import TransferSetupError
from hisparse_sglang.transfer.protocol import DecodeLayout, PagedRegions, TransferGrant

__all__ = ["KVSource", "merge_runs", "page_write_entries"]


@dataclasses.dataclass(frozen=True)
class KVSource(PagedRegions):
    """The prefill's KV pool: one region per layer (host memory, or GPU memory the NIC reaches).

    Attributes:
        layer_bases: address of row 0 of every layer region, in this process.
        num_rows, row_bytes, page_size: rows per region, bytes per row, rows per page.
    """

    def region_infos(self) -> tuple[list[int], list[int]]:
        """Per-layer base addresses and byte lengths (for registration)."""
        return list(self.layer_bases), [self.num_rows * self.row_bytes] * self.layer_num

    @classmethod
    def from_host_pool(cls, pool, page_size: int = 64) -> KVSource:
        """A :class:`~hisparse_sglang.memory.HostKVPool` as the source."""
        pointers, _ = pool.region_infos()
        return cls(tuple(pointers), pool.num_rows, pool.item_bytes, page_size)


def merge_runs(
    src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor, lengths: Sequence[int] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop empty entries and merge each entry into the previous one when both ranges continue it.

    Args:
        src, dst, lengths: ``[n]`` addresses and byte counts (int64-convertible).

    Returns:
        ``(src, dst, lengths)`` int64 CPU tensors ``[m]``, ``m <= n``, in the original order.

    Raises:
        TransferSetupError: the three lists differ in length, or a length is negative.
    """
    src = torch.as_tensor(src, dtype=torch.int64).reshape(-1)
    dst = torch.as_tensor(dst, dtype=torch.int64).reshape(-1)
    lengths = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1)
    if not src.numel() == dst.numel() == lengths.numel():
        raise TransferSetupError(
            f"write has {src.numel()} source addresses, {dst.numel()} destinations and {lengths.numel()} lengths; "
            f"pass one of each per entry."
        )
    if lengths.numel() and int(lengths.min()) < 0:
        raise TransferSetupError(f"write has a negative length ({int(lengths.min())}); lengths are byte counts >= 0.")
    keep = lengths > 0
    src, dst, lengths = src[keep], dst[keep], lengths[keep]
    if src.numel() <= 1:
        return src, dst, lengths
    continues = (src[1:] == src[:-1] + lengths[:-1]) & (dst[1:] == dst[:-1] + lengths[:-1])
    starts = torch.cat([torch.ones(1, dtype=torch.bool), ~continues])
    run = torch.cumsum(starts.to(torch.int64), 0) - 1
    merged = torch.zeros(int(starts.sum()), dtype=torch.int64).index_add_(0, run, lengths)
    return src[starts], dst[starts], merged


def page_write_entries(
    source: KVSource,
    layout: DecodeLayout,
    grant: TransferGrant,
    src_pages: Sequence[int] | torch.Tensor,
    layers: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(src, dst, lengths)`` int64 ``[len(layers) * pages]``: one entry per page and layer, layer-major.

    Token ``t`` of layer ``l`` moves from source row ``src_pages[t // P] * P + t % P`` to decode row
    ``grant.page_ids[t // P] * P + t % P``. Every page moves whole except the last, which moves
    only the request's remaining tokens (the rest of that decode page stays untouched).

    Raises:
        LayoutMismatchError: the source and the layout differ in shape.
        TransferSetupError: source pages out of range or of the wrong count, or a bad layer id.
    """
    layout.check_source(source.layer_num, source.row_bytes, source.page_size, grant.request_id)
    pages = len(grant.page_ids)
    src_pages = torch.as_tensor(src_pages, dtype=torch.int64).reshape(-1)
    if src_pages.numel() != pages:
        raise TransferSetupError(
            f"request {grant.request_id!r} has {pages} granted pages ({grant.num_tokens} tokens) but "
            f"{src_pages.numel()} source pages were given; pass the request's source pages in token order.",
            request_id=grant.request_id,
        )
    if pages and (int(src_pages.min()) < 0 or int(src_pages.max()) >= source.num_pages):
        raise TransferSetupError(
            f"request {grant.request_id!r}: source pages {int(src_pages.min())}..{int(src_pages.max())} are outside "
            f"the source pool's pages [0, {source.num_pages}).",
            request_id=grant.request_id,
        )
    layer_ids = list(range(source.layer_num)) if layers is None else [int(layer) for layer in layers]
    if any(not 0 <= layer < source.layer_num for layer in layer_ids):
        raise TransferSetupError(
            f"layers {layer_ids} must lie in [0, {source.layer_num}).", request_id=grant.request_id
        )
    page_bytes = source.page_size * source.row_bytes
    page_lengths = torch.full((pages,), page_bytes, dtype=torch.int64)
    if pages:
        page_lengths[-1] = (grant.num_tokens - (pages - 1) * source.page_size) * source.row_bytes
    index = torch.tensor(layer_ids, dtype=torch.int64)
    src_bases = torch.tensor(source.layer_bases, dtype=torch.int64)[index]
    dst_bases = torch.tensor(layout.layer_bases, dtype=torch.int64)[index]
    dst_pages = torch.tensor(grant.page_ids, dtype=torch.int64)
    src = (src_bases[:, None] + src_pages[None, :] * page_bytes).reshape(-1)
    dst = (dst_bases[:, None] + dst_pages[None, :] * page_bytes).reshape(-1)
    return src, dst, page_lengths.repeat(len(layer_ids))
