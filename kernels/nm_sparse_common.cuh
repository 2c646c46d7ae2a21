// What both kernels on the sparse tensor cores (nm_sparse_mma.cu, the decode; nm_sparse_gemm.cu, the prompt GEMM)
// share, after the side's prelude (kernels/nm_sparse_mma.py on the GPU, tests/sparse_mma_emulator.hpp on the CPU).

SP_DEV unsigned sp_codes_register(unsigned p) {
  // p's byte k holds slot k's codes of two rows as cuSPARSELt pairs them (row g + 8's << 4 | row g's): the MMA's
  // metadata register, row g's four codes in bits 0-15 and row g + 8's in 16-31 (the other way under META_HALF_SWAP)
  unsigned lo = p & 0x0F0F0F0Fu, hi = (p >> 4) & 0x0F0F0F0Fu;
  lo |= lo >> 4;
  hi |= hi >> 4;
#if META_HALF_SWAP
  return sp_byte_perm(hi, lo, 0x6420u);
#else
  return sp_byte_perm(lo, hi, 0x6420u);
#endif
}

template <int M, int N>
SP_DEV void sp_zero(float (&acc)[M][N][4]) {   // a warp's accumulators: M m-tiles x N n-tiles of 4 sums a lane
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][n][j] = 0.f;
}

SP_DEV void sp_store_output(unsigned short* y, const unsigned short* bias, int R, int token, int row, float sum) {
  // one output y[token][row], bias added, rounded to 16 bits
#if HAS_BIAS
  sum += sp_to_float(sp_ld16(bias + row));
#else
  (void)bias;
#endif
  sp_st16(y + (long long)token * R + row, sp_from_float(sum));
}
