"""Block-causal attention for rows that pack several documents (data.packing = "document"): a query attends to
the keys of its own document at or before its position, never across a document boundary.

One switch picks the kernel (`document_attention_kernel`): on CUDA, flex_attention with a block mask built from
the document ids (its blocks fully outside every document are skipped, so the cost is per document, not per row);
elsewhere (CPU: torch 2.13 has no flex_attention backward there), SDPA with a boolean (B, 1, S, S) mask, which
costs the whole row's S x S. SCALETRAIN_DOCUMENT_ATTENTION=sdpa|flex forces one (auto: the rule above).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

KERNELS = ("auto", "sdpa", "flex")
_compiled_flex: Any = None


def document_attention_kernel(device: torch.device) -> str:
    """'flex' or 'sdpa' for document masks on `device` (SCALETRAIN_DOCUMENT_ATTENTION overrides auto)."""
    chosen = os.environ.get("SCALETRAIN_DOCUMENT_ATTENTION", "auto")
    if chosen not in KERNELS:
        raise ValueError(f"SCALETRAIN_DOCUMENT_ATTENTION: {chosen!r} is not one of {', '.join(KERNELS)}")
    if chosen != "auto":
        return chosen
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - torch builds without it
        return "sdpa"
    return "flex" if device.type == "cuda" else "sdpa"


class DocumentMask:
    """Which keys each query may see, from (B, S) document ids: built once per forward, on first use, and shared by
    the blocks: `allowed()` (B, 1, S, S) bool for SDPA, or `block_mask()` for flex_attention (`kernel`). A core
    that sees other keys than the local sequence's (context parallelism) builds its own from `documents`, kept by
    `cached`."""

    def __init__(self, documents: torch.Tensor, kernel: str | None = None):
        self.documents = documents
        self.kernel = kernel or document_attention_kernel(documents.device)
        self._built: dict[Any, Any] = {}

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        if key not in self._built:
            self._built[key] = build()
        return self._built[key]

    def allowed(self) -> torch.Tensor:
        def build() -> torch.Tensor:
            docs, s = self.documents, self.documents.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=docs.device).tril()
            return ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]

        return self.cached("allowed", build)

    def block_mask(self) -> Any:
        def build() -> Any:
            from torch.nn.attention.flex_attention import create_block_mask

            docs = self.documents
            b, s = docs.shape

            def same_document_causal(batch, head, q, kv):
                return (q >= kv) & (docs[batch, q] == docs[batch, kv])

            return create_block_mask(same_document_causal, b, None, s, s, device=docs.device)

        return self.cached("block_mask", build)


def document_mask(documents: torch.Tensor, kernel: str | None = None) -> DocumentMask:
    """The block-causal mask of rows whose token t belongs to document documents[b, t] (int64, (B, S))."""
    return DocumentMask(documents, kernel)


def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask, gqa_in_kernel: bool
) -> torch.Tensor:
    """Attention of q (B, H, S, D) over k, v (B, H_kv, S, D) under a document mask; k/v are repeated to H heads
    first unless `gqa_in_kernel` (the kernel takes them unrepeated)."""
    global _compiled_flex
    rep = q.shape[1] // k.shape[1]
    if mask.kernel == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        if _compiled_flex is None:  # flex_attention runs its fused kernel only compiled
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(q, k, v, block_mask=mask.block_mask(), enable_gqa=rep > 1)
    if rep > 1 and gqa_in_kernel:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.allowed(), enable_gqa=True)
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.allowed())
