// Appended after kernels/nm_sparse_mma.cu in the CPU build (tests/sparse_mma_emulator.hpp first): launches
// the kernel over a grid, one CTA at a time in a seeded shuffled order, its threads as std::threads.
extern "C" const char* spemu_launch(unsigned gx, unsigned gy, unsigned threads, unsigned seed,
                                    const unsigned short* x, size_t x_bytes, const unsigned short* values,
                                    size_t values_bytes, const unsigned* meta, size_t meta_bytes, const int* perm,
                                    size_t perm_bytes, const unsigned short* bias, size_t bias_bytes, unsigned short* y, size_t y_bytes,
                                    float* partial, size_t partial_bytes, int* counters, size_t counters_bytes,
                                    int T, int R, int C, int xs, int KS, unsigned shared_bytes) {
  auto range = [](const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    return spemu::Range{c, c + n};
  };
  spemu::error.clear();
  spemu_stored.clear();
  spemu_prefetched.clear();
  spemu::ranges = {range(x, x_bytes), range(values, values_bytes), range(meta, meta_bytes), range(perm, perm_bytes),
                   range(bias, bias_bytes),
                   range(y, y_bytes), range(partial, partial_bytes), range(counters, counters_bytes)};
  spemu::grid3 = {gx, gy, 1};
  spemu::block3 = {threads, 1, 1};
  std::vector<std::pair<unsigned, unsigned>> order;
  for (unsigned by = 0; by < gy; ++by)
    for (unsigned bx = 0; bx < gx; ++bx) order.emplace_back(bx, by);
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  for (auto [bx, by] : order) {
    std::barrier<> cta(threads);
    std::vector<spemu::Warp> warps(threads / 32);
    for (auto& w : warps) w.bar = std::make_unique<std::barrier<>>(32);
    spemu::cta_barrier = &cta;
    spemu::dyn_smem.assign(shared_bytes, 0xFF);   // what a CTA did not write reads as NaN
    spemu::warps = &warps;
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t)
      pool.emplace_back([&, t, bx = bx, by = by] {
        spemu::tid3 = {t, 0, 0};
        spemu::bid3 = {bx, by, 0};
        nm_sparse_mma(x, values, meta, perm, bias, y, partial, counters, T, R, C, xs, KS);
      });
    for (auto& th : pool) th.join();
  }
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
