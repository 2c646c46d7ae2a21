// Appended after scripts/mma_ceiling.cu in the CPU build (tests/sparse_mma_emulator.hpp first): its grid by
// spemu::run_grid.
extern "C" const char* spemu_ceiling_launch(unsigned grid, const unsigned* in, size_t in_bytes, float* out,
                                            size_t out_bytes, int iters) {
  spemu_begin_launch({{in, in_bytes}, {out, out_bytes}});
  spemu::run_grid({grid, 1, 1}, THREADS, 0, 0, [&] { mma_ceiling(in, out, iters); });
  return spemu::error.empty() ? nullptr : spemu::error.c_str();
}
