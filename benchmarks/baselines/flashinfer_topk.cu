// A C entry point to FlashInfer's per-row top-k (include/flashinfer/topk.cuh, Apache-2.0), built from a fetched
// FlashInfer checkout by build_flashinfer_topk.sh, so that benchmarks/suite_topk.py can time the fastest public
// per-row top-k we can build next to ours in one process. Benchmark-only: nothing in the library links it.
#include <cstdint>

#include <flashinfer/math.cuh>  // topk.cuh uses math:: without including it (FlashInfer includes sampling.cuh first)
#include <flashinfer/topk.cuh>

extern "C" {

// Bytes of the multi-CTA path's row state (zeroed once by the caller; the kernels leave it zero again).
size_t tsi_fi_row_states_bytes() { return 1024 * 1024; }

// The ragged transform: out[r, :k] = offsets[r] + the positions of row r's k largest among its first lengths[r]
// columns (unordered), as vLLM's and SGLang's indexers call it. in: [rows, max_len] fp32, contiguous; out:
// [rows, k] int32. FlashInfer picks FilteredTopK or the multi-CTA radix select from the shape
// (FLASHINFER_TOPK_ALGO=filtered|multi_cta forces one); deterministic with tie_break 1 is its exact mode (ties
// to the lower position). Returns a cudaError_t.
int tsi_fi_topk_ragged(float* in, int32_t* out, const int32_t* offsets, int32_t* lengths, uint32_t rows,
                       uint32_t max_len, uint32_t k, void* row_states, int deterministic, int tie_break,
                       cudaStream_t stream) {
  using namespace flashinfer::sampling;
  const TopKTieBreak tb = tie_break == 1 ? TopKTieBreak::Small : tie_break == 2 ? TopKTieBreak::Large
                                                                                : TopKTieBreak::None;
  return (int)TopKRaggedTransformDispatch<float, int32_t>(in, out, offsets, lengths, nullptr, rows, k, max_len,
                                                          static_cast<RadixRowState*>(row_states),
                                                          deterministic != 0, tb, stream, false);
}

}  // extern "C"
