// Appended after kernels/nm_sparse_mma.cu in the CPU build (tests/sparse_mma_emulator.hpp first): launches
// the kernel over a grid, one CTA at a time in a seeded shuffled order, its threads as std::threads.
extern "C" const char* spemu_launch(unsigned gx, unsigned gy, unsigned threads, unsigned seed,
                                    const unsigned short* x, size_t x_bytes, const unsigned short* values,
                                    size_t values_bytes, const unsigned* meta, size_t meta_bytes, const int* perm,
                                    size_t perm_bytes, const unsigned short* bias, size_t bias_bytes, unsigned short* y, size_t y_bytes,
                                    float* partial, size_t partial_bytes, int* counters, size_t counters_bytes,
                                    int T, int R, int C, int xs, int KS, unsigned shared_bytes) {
  spemu_begin_launch({{x, x_bytes}, {values, values_bytes}, {meta, meta_bytes}, {perm, perm_bytes}, {bias, bias_bytes},
                      {y, y_bytes}, {partial, partial_bytes}, {counters, counters_bytes}});
  spemu::run_grid({gx, gy, 1}, threads, seed, shared_bytes,
                  [&] { nm_sparse_mma(x, values, meta, perm, bias, y, partial, counters, T, R, C, xs, KS); });
  return spemu::error.empty() ? nullptr : spemu::error.c_str();
}

// The staged word a B load of lane `lane` reads for n-tile n, block, half and register reg of a step at column 0
// (the kernel's own sp_b_column and sp_staged_word): the tests check that a warp's 32 loads hit 32 banks.
extern "C" int spemu_staged_word(int n, int block, int half, int reg, int lane) {
  int token = 8 * n + (lane >> 2);
  return sp_staged_word(token, sp_b_column(0, block, half, reg, lane & 3), 0);
}

// The last launch's L2 prefetch addresses (at most `cap` into `out`) and their count.
extern "C" size_t spemu_prefetches(const void** out, size_t cap) {
  for (size_t i = 0; i < spemu_prefetched.size() && i < cap; ++i) out[i] = spemu_prefetched[i];
  return spemu_prefetched.size();
}

// A B register's input column as the layout assigns it (sp_b_column), as the loads split it (the lane's column plus a
// constant), and its staged word as the staged loads work it out (sp_staged_word_at, with the lane's sp_staged_key), for the tests to compare.
extern "C" int spemu_b_column(int c0, int block, int half, int reg, int lane) {
  return (int)sp_b_column(c0, block, half, reg, lane & 3);
}
extern "C" int spemu_b_column_split(int c0, int block, int half, int reg, int lane) {
  return c0 + sp_lane_column(lane & 3) + sp_b_offset(block, half, reg);
}
extern "C" int spemu_staged_word_of(int token, int col) { return sp_staged_word(token, (unsigned)col, 0); }
extern "C" int spemu_staged_b_word(int token, int c0, int block, int half, int reg, int lane) {
  return sp_staged_word_at(c0, block, half, reg, sp_staged_key(token, lane));
}
