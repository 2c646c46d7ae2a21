// Appended after kernels/nm_sparse_gemm.cu in the CPU build (tests/sparse_mma_emulator.hpp first): launches the
// GEMM over its grid (token blocks x row blocks x splits of K) by spemu::run_grid.
extern "C" const char* spemu_gemm_launch(unsigned gx, unsigned gy, unsigned gz, unsigned seed, const unsigned short* x,
                                         size_t x_bytes, const unsigned short* values, size_t values_bytes,
                                         const unsigned* meta, size_t meta_bytes, const unsigned short* bias,
                                         size_t bias_bytes, unsigned short* y, size_t y_bytes, float* partial,
                                         size_t partial_bytes, int* counters, size_t counters_bytes, const int* perm,
                                         size_t perm_bytes, int T, int R, int C, int xs, int KS,
                                         unsigned shared_bytes) {
  spemu_begin_launch({{x, x_bytes}, {values, values_bytes}, {meta, meta_bytes}, {bias, bias_bytes}, {y, y_bytes},
                      {partial, partial_bytes}, {counters, counters_bytes}, {perm, perm_bytes}});
  spemu::run_grid({gx, gy, gz}, THREADS, seed, shared_bytes,
                  [&] { nm_sparse_gemm(x, values, meta, bias, y, partial, counters, perm, T, R, C, xs, KS); });
  return spemu::error.empty() ? nullptr : spemu::error.c_str();
}

// The 16-byte chunk (its offset in 16-bit units) where the kernel stages kept-value chunk `chunk` of CTA row `row`,
// and input chunk `chunk` of token `token`: the tests check that each ldmatrix phase's 8 rows hit 32 banks.
extern "C" int spemu_a_offset(int row, int chunk) { return sp_a_offset(row, chunk); }
extern "C" int spemu_x_offset(int token, int chunk) { return sp_x_offset(token, chunk); }
