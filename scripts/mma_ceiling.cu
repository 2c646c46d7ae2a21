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
// Compile-time parameters: SPARSE, CHAINS, THREADS, IS_BF16, ORDERED, WGMMA (the wgmma part below instead; with GROUP
// and WG_SMEM_BYTES) (the device prelude of kernels/nm_sparse_mma.py
// comes first on the GPU, with sp_mma_dense from scripts/mma_ceiling.py; tests/sparse_mma_emulator.hpp on the CPU).

#if !WGMMA
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
#endif

#if WGMMA
// Hopper's own MMA (sm_90a, scripts/mma_ceiling.py builds this part only for a GPU of compute capability 9.0): each
// warpgroup issues GROUP wgmma.mma_async of m64n128 (SPARSE: the 2:4 m64n128k32; else the dense m64n128k16) into its
// 64 accumulators a thread, commits them and waits, ITERS times. A and B come from shared memory through matrix
// descriptors over WG_SMEM_BYTES of bf16 ones, so whatever layout the descriptors name reads ones and each output
// gains 16 a wgmma; the metadata keeps positions 0 and 1 of every group, valid in any lane's reading. sp_wgmma (the
// instruction in inline PTX, its 64 accumulator operands written out) comes from mma_ceiling.py.
extern "C" __global__ void __launch_bounds__(THREADS) wgmma_ceiling(const unsigned* in, float* out, int iters) {
  extern __shared__ __align__(1024) unsigned tiles[];
  for (int i = threadIdx.x; i < WG_SMEM_BYTES / 4; i += THREADS) tiles[i] = in[0];
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // ordinary stores the tensor cores read next
  __syncthreads();
  // start address >> 4 (bits 0-13), leading-dimension offset 128 B and stride offset 256 B (>> 4), no swizzle
  unsigned long long desc = (((unsigned)__cvta_generic_to_shared(tiles) >> 4) & 0x3FFFull) | (8ull << 16) |
                            (16ull << 32);
  const unsigned e = in[8];
  float d[64];
#pragma unroll
  for (int j = 0; j < 64; ++j) d[j] = 0.f;
  for (int it = 0; it < iters; ++it) {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int g = 0; g < GROUP; ++g) sp_wgmma(d, desc, desc, e);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  }
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 64; ++j) s += d[j];
  out[blockIdx.x * THREADS + threadIdx.x] = s;
}
#endif
