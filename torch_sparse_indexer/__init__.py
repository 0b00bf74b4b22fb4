"""torch_sparse_indexer: torch.compile- and CUDA-graph-friendly DeepSeek sparse-attention indexer ops.

Ops live under ``torch.ops.sparse_indexer`` (schemas, validation and fakes: :mod:`.ops`); the functional
wrappers below allocate their outputs. Reference semantics: :mod:`.reference`; formats: :mod:`.formats`;
backends and dispatch: :mod:`.backends`; GPU kernels: :mod:`.kernels`.
"""
from . import formats, backends, workspace, reference, pipeline, ops  # noqa: F401  (ops registers the library)
from . import kernels  # noqa: F401  (registers whatever GPU backends this machine can run)
from .backends import set_backend, use_backend, disable_backend
from .functional import (
    write_k_cache, gather_k, quantize_q, mqa_logits, paged_mqa_logits, sparse_mqa_logits,
    paged_sparse_mqa_logits, topk, sparse_topk, block_topk, indexer_prefill, indexer_decode,
    sparse_indexer_prefill, sparse_indexer_decode,
)
from .metadata import IndexerCapacities, IndexerMetadata, IndexerMetadataBuilder
from .layers import IndexerKCache, MQAIndexer, SparseMQAIndexer

__version__ = "0.1.0"

__all__ = [
    "formats", "backends", "workspace", "reference", "ops", "set_backend", "use_backend", "disable_backend",
    "write_k_cache", "gather_k", "quantize_q", "mqa_logits", "paged_mqa_logits", "sparse_mqa_logits",
    "paged_sparse_mqa_logits", "topk", "sparse_topk", "block_topk", "indexer_prefill", "indexer_decode",
    "sparse_indexer_prefill", "sparse_indexer_decode",
    "IndexerCapacities", "IndexerMetadata", "IndexerMetadataBuilder", "IndexerKCache", "MQAIndexer",
    "SparseMQAIndexer",
]
