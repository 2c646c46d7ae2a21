// Appended after kernels/nm_sparse_gemm.cu in the CPU build (tests/sparse_mma_emulator.hpp first): launches the
// GEMM over its grid (token blocks x row blocks x splits of K), one CTA at a time in a seeded shuffled order, its threads as
// std::threads.
extern "C" const char* spemu_gemm_launch(unsigned gx, unsigned gy, unsigned gz, unsigned seed, const unsigned short* x,
                                         size_t x_bytes, const unsigned short* values, size_t values_bytes,
                                         const unsigned* meta, size_t meta_bytes, const unsigned short* bias,
                                         size_t bias_bytes, unsigned short* y, size_t y_bytes, float* partial,
                                         size_t partial_bytes, int* counters, size_t counters_bytes, int T, int R,
                                         int C, int xs, int KS, unsigned shared_bytes) {
  auto range = [](const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    return spemu::Range{c, c + n};
  };
  spemu::error.clear();
  spemu_stored.clear();
  spemu::ranges = {range(x, x_bytes), range(values, values_bytes), range(meta, meta_bytes), range(bias, bias_bytes),
                   range(y, y_bytes), range(partial, partial_bytes), range(counters, counters_bytes)};
  spemu::grid3 = {gx, gy, gz};
  spemu::block3 = {THREADS, 1, 1};
  std::vector<spemu::Dim3> order;
  for (unsigned bz = 0; bz < gz; ++bz)
    for (unsigned by = 0; by < gy; ++by)
      for (unsigned bx = 0; bx < gx; ++bx) order.push_back({bx, by, bz});
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  for (spemu::Dim3 b : order) {
    std::barrier<> cta(THREADS);
    std::vector<spemu::Warp> warps(WARPS);
    for (auto& w : warps) w.bar = std::make_unique<std::barrier<>>(32);
    spemu::cta_barrier = &cta;
    spemu::dyn_smem.assign(shared_bytes, 0xFF);   // what a CTA did not write reads as NaN
    spemu::warps = &warps;
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < THREADS; ++t)
      pool.emplace_back([&, t, b] {
        spemu::tid3 = {t, 0, 0};
        spemu::bid3 = b;
        nm_sparse_gemm(x, values, meta, bias, y, partial, counters, T, R, C, xs, KS);
      });
    for (auto& th : pool) th.join();
  }
  return spemu::error.empty() ? nullptr : spemu::error.c_str();
}

// The 16-byte chunk (its offset in 16-bit units) where the kernel stages kept-value chunk `chunk` of CTA row `row`,
// and input chunk `chunk` of token `token`: the tests check that each ldmatrix phase's 8 rows hit 32 banks.
extern "C" int spemu_a_offset(int row, int chunk) { return sp_a_offset(row, chunk); }
extern "C" int spemu_x_offset(int token, int chunk) { return sp_x_offset(token, chunk); }
