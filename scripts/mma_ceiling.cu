// The tensor cores' ceiling through the two MMAs this project's CUDA kernels could issue, with nothing else in the way
// (scripts/mma_ceiling.py times it on a GPU): each warp issues ITERS x CHAINS MMAs on operands it holds in registers,
// its CHAINS accumulators independent of each other so the MMA's latency hides behind its issue rate. SPARSE 1: the
// 2:4 mma.sp m16n8k32 of nm_sparse_mma.cu and nm_sparse_gemm.cu (8192 dense-equivalent flops each); SPARSE 0: the
// dense mma m16n8k16 (4096 flops). Hopper's own wgmma is not here: cuBLAS's time is its measure.
//
// The operands come from `in` (nine words: A's four, B's four, the metadata), so the compiler folds nothing; each
// thread writes the sum of its accumulators to out[thread], which the host checks against what ITERS x CHAINS MMAs of
// those operands give, so no MMA was left out of the count the flops are worked out from.
//
// Compile-time parameters: SPARSE, CHAINS, THREADS, IS_BF16, ORDERED (the device prelude of kernels/nm_sparse_mma.py
// comes first on the GPU, with sp_mma_dense from scripts/mma_ceiling.py; tests/sparse_mma_emulator.hpp on the CPU).

extern "C" __global__ void SP_BOUNDS(THREADS) mma_ceiling(const unsigned* in, float* out, int iters) {
  unsigned a[4], b[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    a[k] = sp_ld32(in + k);
    b[k] = sp_ld32(in + 4 + k);
  }
  const unsigned e = sp_ld32(in + 8);
  float acc[CHAINS][4];
#pragma unroll
  for (int c = 0; c < CHAINS; ++c)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[c][j] = 0.f;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
#if SPARSE
      sp_mma<0>(acc[c], a, b, e);
#else
      sp_mma_dense(acc[c], a, b);
#endif
    }
  }
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < CHAINS; ++c)
#pragma unroll
    for (int j = 0; j < 4; ++j) s += acc[c][j];
  sp_st_float(out + blockIdx.x * THREADS + threadIdx.x, s);
}
