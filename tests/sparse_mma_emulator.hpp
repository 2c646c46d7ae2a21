// The CPU side of kernels/nm_sparse_mma.cu: what its device prelude (kernels/nm_sparse_mma.py) defines for
// the GPU, defined here for g++ so the kernel's own text runs on the CPU. Every thread of a CTA is a
// std::thread; __syncthreads is a barrier of the CTA; a warp's mma.sp gathers its 32 lanes' registers
// and lane 0 computes the product as the PTX ISA defines the sparse m16n8k32 fragments (16-bit A as the
// dense m16n8k16 A fragment of kept values, metadata from the lanes the selector names, ordered codes).
// Loads and stores are checked against the launch's buffers and their alignment: a fault on the GPU is
// an error here. CTAs run one at a time, in an order the launch shuffles.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace spemu {
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
inline thread_local Dim3 tid3, bid3;
inline Dim3 grid3, block3;
struct Range { const char* lo; const char* hi; };
inline std::vector<Range> ranges;
inline std::vector<unsigned char> dyn_smem;   // a CTA's dynamic shared memory (CTAs run one at a time)
inline std::mutex error_mu;
inline std::string error;

inline void fail(const std::string& what) {
  std::lock_guard<std::mutex> lock(error_mu);
  if (error.empty()) error = what;
}

inline bool access_ok(const void* p, size_t bytes, size_t align) {
  if (reinterpret_cast<uintptr_t>(p) % align) {
    fail("misaligned access of " + std::to_string(bytes) + " bytes");
    return false;
  }
  const char* c = static_cast<const char*>(p);
  for (const Range& r : ranges)
    if (c >= r.lo && c + bytes <= r.hi) return true;
  fail("access of " + std::to_string(bytes) + " bytes outside every buffer");
  return false;
}

struct Warp {
  unsigned a[32][4], b[32][4], e[32];
  int sel[32];
  float c[32][4], d[32][4];
  const unsigned short* rows[32];   // ldmatrix: the row each lane names
  std::unique_ptr<std::barrier<>> bar;
};
inline std::barrier<>* cta_barrier = nullptr;
inline std::vector<Warp>* warps = nullptr;
}  // namespace spemu

#define threadIdx (spemu::tid3)
#define blockIdx (spemu::bid3)
#define gridDim (spemu::grid3)
#define blockDim (spemu::block3)
#define __global__
#define __shared__ static
#define SP_DEV static inline
#define SP_BOUNDS(n)
#define SP_BOUNDS_MIN(n, ctas)

struct u32x4 { unsigned x, y, z, w; };
struct u32x2 { unsigned x, y; };

static inline void __syncthreads() { spemu::cta_barrier->arrive_and_wait(); }

template <typename V>
static inline V spemu_load(const void* p, size_t align) {
  V v{};
  if (spemu::access_ok(p, sizeof(V), align)) std::memcpy(&v, p, sizeof(V));
  return v;
}
SP_DEV u32x4 sp_ld128(const void* p) { return spemu_load<u32x4>(p, 16); }
SP_DEV u32x2 sp_ld64(const void* p) { return spemu_load<u32x2>(p, 8); }
SP_DEV unsigned sp_ld32(const void* p) { return spemu_load<unsigned>(p, 4); }
SP_DEV unsigned short sp_ld16(const unsigned short* p) { return spemu_load<unsigned short>(p, 2); }
SP_DEV u32x4 sp_ld_cg128(const float* p) { return spemu_load<u32x4>(p, 16); }
SP_DEV float sp_bits_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
SP_DEV u32x4 sp_ldg128(const void* p) { return spemu_load<u32x4>(p, 16); }
SP_DEV u32x2 sp_ldg64(const void* p) { return spemu_load<u32x2>(p, 8); }
inline std::mutex spemu_prefetch_mu;
inline std::vector<const void*> spemu_prefetched;   // every L2 prefetch's address, in no order (the tests read them)
SP_DEV void sp_prefetch_l2(const void* p) {   // an address inside a buffer, recorded
  if (!spemu::access_ok(p, 2, 2)) return;
  std::lock_guard<std::mutex> lock(spemu_prefetch_mu);
  spemu_prefetched.push_back(p);
}
static inline bool spemu_shared_ok(const void* p, size_t bytes) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (reinterpret_cast<uintptr_t>(p) % bytes) {
    spemu::fail("misaligned shared-memory access");
    return false;
  }
  if (c < spemu::dyn_smem.data() || c + bytes > spemu::dyn_smem.data() + spemu::dyn_smem.size()) {
    spemu::fail("shared-memory access outside the launch's dynamic shared memory");
    return false;
  }
  return true;
}
SP_DEV unsigned sp_lds32(const unsigned short* p) {
  unsigned v = 0;
  if (spemu_shared_ok(p, 4)) std::memcpy(&v, p, 4);
  return v;
}
SP_DEV void sp_st_shared32(unsigned short* p, unsigned v) {
  if (spemu_shared_ok(p, 4)) std::memcpy(p, &v, 4);
}
SP_DEV void sp_sts16(unsigned short* p, unsigned short v) {
  if (spemu_shared_ok(p, 2)) std::memcpy(p, &v, 2);
}
SP_DEV u32x4 sp_lds128(const unsigned short* p) {
  u32x4 v{};
  if (spemu_shared_ok(p, 16)) std::memcpy(&v, p, 16);
  return v;
}
// cp.async as late as the PTX ISA lets it land: a thread's copies are queued by commit group, and only a wait
// lands them (wait_group 1: every group but the newest), so a read of a slot before its wait reads the poison
struct SpemuCopy { unsigned short* to; unsigned char v[16]; unsigned bytes; };
inline thread_local std::vector<SpemuCopy> spemu_open_copies;                 // issued, not yet committed
inline thread_local std::vector<std::vector<SpemuCopy>> spemu_copy_groups;    // committed, not yet landed
SP_DEV void sp_cp_async8(unsigned short* to, const unsigned short* from) {
  u32x2 v = spemu_load<u32x2>(from, 8);   // the source is read now (nothing writes it during the kernel)
  SpemuCopy c{to, {}, 8};
  std::memcpy(c.v, &v, 8);
  if (spemu_shared_ok(to, 8)) spemu_open_copies.push_back(c);
}
SP_DEV void sp_cp_async16(unsigned short* to, const void* from, int bytes) {   // 16 bytes, or (bytes 0) zeros
  if (bytes != 0 && bytes != 16) spemu::fail("cp.async of 16 bytes given a source size other than 0 or 16");
  u32x4 v = spemu_load<u32x4>(from, 16);   // the address must lie in a buffer even where nothing is read
  SpemuCopy c{to, {}, 16};
  if (bytes) std::memcpy(c.v, &v, 16);
  if (spemu_shared_ok(to, 16)) spemu_open_copies.push_back(c);
}
SP_DEV void sp_cp_async_commit() {
  spemu_copy_groups.push_back(std::move(spemu_open_copies));
  spemu_open_copies.clear();
}
template <int N>
SP_DEV void sp_cp_async_wait() {   // every committed group but the newest N lands
  while (spemu_copy_groups.size() > (size_t)N) {
    for (const SpemuCopy& c : spemu_copy_groups.front()) std::memcpy(c.to, c.v, c.bytes);
    spemu_copy_groups.erase(spemu_copy_groups.begin());
  }
}
#define SP_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(spemu::dyn_smem.data())
// which CTA stored at each address in this launch: a second CTA's plain store to the same address is a race on a
// GPU (their order is not defined), so it is an error here (the launchers clear this map at each launch)
inline std::mutex spemu_store_mu;
inline std::unordered_map<const void*, unsigned> spemu_stored;
template <typename V>
static inline void spemu_store(void* p, V v) {
  if (!spemu::access_ok(p, sizeof(V), sizeof(V))) return;
  unsigned cta = spemu::bid3.x + spemu::grid3.x * (spemu::bid3.y + spemu::grid3.y * spemu::bid3.z);
  {
    std::lock_guard<std::mutex> lock(spemu_store_mu);
    auto [it, fresh] = spemu_stored.emplace(p, cta);
    if (!fresh && it->second != cta) spemu::fail("two CTAs store to one address (a race on a GPU)");
  }
  std::memcpy(p, &v, sizeof(V));
}
SP_DEV void sp_st16(unsigned short* p, unsigned short v) { spemu_store(p, v); }
SP_DEV void sp_st128(unsigned short* p, u32x4 v) { spemu_store(p, v); }
SP_DEV void sp_st_float(float* p, float v) { spemu_store(p, v); }
SP_DEV void sp_st_int(int* p, int v) { spemu_store(p, v); }
SP_DEV void sp_grid_wait() {}      // one kernel at a time here: the one before has always ended
SP_DEV void sp_grid_release() {}
SP_DEV void sp_threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
SP_DEV int sp_atomic_add(int* p, int v) {
  if (!spemu::access_ok(p, 4, 4)) return 0;
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
SP_DEV unsigned sp_byte_perm(unsigned a, unsigned b, unsigned s) {   // CUDA's __byte_perm (default mode)
  unsigned long long both = (unsigned long long)b << 32 | a;
  unsigned r = 0;
  for (int k = 0; k < 4; ++k) r |= (unsigned)((both >> (8 * ((s >> (4 * k)) & 7))) & 0xFF) << (8 * k);
  return r;
}

#if IS_BF16
SP_DEV float sp_to_float(unsigned short h) {
  unsigned u = (unsigned)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
SP_DEV unsigned short sp_from_float(float f) {   // round to nearest even, as cvt.rn.bf16.f32
  unsigned u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}
#else
SP_DEV float sp_to_float(unsigned short h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return (float)v;
}
SP_DEV unsigned short sp_from_float(float f) {
  _Float16 v = (_Float16)f;
  unsigned short h;
  std::memcpy(&h, &v, 2);
  return h;
}
#endif

// Another GPU's reading of the fragments, for the tests that check a kernel built with the matching knob (what a probe
// on that GPU would flip) computes right on it: each 0 here, the PTX ISA's reading, unless the build defines it
#ifndef SPEMU_HW_A_SWAP
#define SPEMU_HW_A_SWAP 0
#endif
#ifndef SPEMU_HW_META_HALF_SWAP
#define SPEMU_HW_META_HALF_SWAP 0
#endif
#ifndef SPEMU_HW_META_ROLE_SWAP
#define SPEMU_HW_META_ROLE_SWAP 0
#endif
#ifndef SPEMU_HW_B_SWAP
#define SPEMU_HW_B_SWAP 0
#endif

namespace spemu {
// D = A · B + C for one warp, A (16 x 32) 2:4 sparse, from the registers its lanes hold (PTX ISA, sparse
// mma.m16n8k32 with .f16/.bf16: A as the dense m16n8k16 A fragment of the kept values, B rows 2t + 8i +
// {0,1} of column g, metadata of row g in bits 0-15 and of row g + 8 in bits 16-31 of lanes 4g + 2·sel
// + {0, 1}, the second holding slots 4-7)
inline void mma_sp_m16n8k32(Warp& w) {
  int sel = w.sel[0];
  for (int l = 1; l < 32; ++l)
    if (w.sel[l] != sel) fail("lanes of a warp disagree on the sparsity selector");
  double A[16][32] = {}, B[32][8];
  for (int r = 0; r < 16; ++r) {
    int g = r % 8;
    for (int s = 0; s < 8; ++s) {
#if SPEMU_HW_A_SWAP
      int t = s % 4, reg = (r >= 8 ? 2 : 0) + (s >= 4 ? 1 : 0);
#else
      int t = s % 4, reg = (r >= 8 ? 1 : 0) + (s >= 4 ? 2 : 0);
#endif
      unsigned word = w.a[4 * g + t][reg];
      unsigned meta = w.e[4 * g + 2 * sel + ((s >= 4 ? 1 : 0) ^ SPEMU_HW_META_ROLE_SWAP)];
#if SPEMU_HW_META_HALF_SWAP
      unsigned half = r >= 8 ? meta & 0xFFFFu : meta >> 16;
#else
      unsigned half = r >= 8 ? meta >> 16 : meta & 0xFFFFu;
#endif
      unsigned code = (half >> (4 * (s % 4))) & 0xFu;
      unsigned i0 = code & 3u, i1 = code >> 2;
      if (i0 >= i1) fail("metadata code " + std::to_string(code) + " is not an ordered pair of positions");
      A[r][4 * s + i0] = sp_to_float((unsigned short)(word & 0xFFFFu));
      A[r][4 * s + i1] = sp_to_float((unsigned short)(word >> 16));
    }
  }
  for (int q = 0; q < 32; ++q)
    for (int n = 0; n < 8; ++n) {
      int reg = q / 8;
#if SPEMU_HW_B_SWAP
      reg = (reg == 1 || reg == 2) ? 3 - reg : reg;
#endif
      unsigned word = w.b[4 * n + (q % 8) / 2][reg];
      B[q][n] = sp_to_float((unsigned short)(q % 2 ? word >> 16 : word & 0xFFFFu));
    }
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n) {
      int lane = 4 * (r % 8) + n / 2, j = 2 * (r >= 8 ? 1 : 0) + n % 2;
      double acc = w.c[lane][j];
      for (int q = 0; q < 32; ++q) acc += A[r][q] * B[q][n];
      w.d[lane][j] = (float)acc;
    }
}

// D = A · B + C for one warp, dense m16n8k16 (PTX ISA, .f16/.bf16): A row g in registers 0 (columns 2t, 2t + 1) and 2
// (2t + 8, 2t + 9) of lane 4g + t, row g + 8 in 1 and 3; B column g rows 2t, 2t + 1 in register 0 of lane 4g + t,
// rows 2t + 8, 2t + 9 in register 1; C and D as for the sparse MMA
inline void mma_m16n8k16(Warp& w) {
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n) {
      int lane = 4 * (r % 8) + n / 2, j = 2 * (r >= 8 ? 1 : 0) + n % 2;
      double acc = w.c[lane][j];
      for (int q = 0; q < 16; ++q) {
        int t = (q % 8) / 2, hi = q % 2;
        unsigned aw = w.a[4 * (r % 8) + t][(r >= 8 ? 1 : 0) + (q >= 8 ? 2 : 0)];
        unsigned bw = w.b[4 * n + t][q >= 8 ? 1 : 0];
        acc += (double)sp_to_float((unsigned short)(hi ? aw >> 16 : aw & 0xFFFFu)) *
               sp_to_float((unsigned short)(hi ? bw >> 16 : bw & 0xFFFFu));
      }
      w.d[lane][j] = (float)acc;
    }
}
}  // namespace spemu

SP_DEV void sp_mma_dense(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[4]) {   // b[0], b[1]: m16n8k16
  unsigned lane = threadIdx.x & 31u;
  spemu::Warp& w = (*spemu::warps)[threadIdx.x >> 5];
  std::memcpy(w.a[lane], a, sizeof w.a[lane]);
  std::memcpy(w.b[lane], b, sizeof w.b[lane]);
  std::memcpy(w.c[lane], d, sizeof w.c[lane]);
  w.bar->arrive_and_wait();
  if (lane == 0) spemu::mma_m16n8k16(w);
  w.bar->arrive_and_wait();
  std::memcpy(d, w.d[lane], sizeof w.d[lane]);
}

template <int SEL>
SP_DEV void sp_mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[4], unsigned e) {
  unsigned lane = threadIdx.x & 31u;
  spemu::Warp& w = (*spemu::warps)[threadIdx.x >> 5];
  std::memcpy(w.a[lane], a, sizeof w.a[lane]);
  std::memcpy(w.b[lane], b, sizeof w.b[lane]);
  std::memcpy(w.c[lane], d, sizeof w.c[lane]);
  w.e[lane] = e;
  w.sel[lane] = SEL;
  w.bar->arrive_and_wait();
  if (lane == 0) spemu::mma_sp_m16n8k32(w);
  w.bar->arrive_and_wait();
  std::memcpy(d, w.d[lane], sizeof w.d[lane]);
}

// ldmatrix.x4 (16-bit): lanes 8j..8j+7 name the 8 rows (16 bytes each, in shared memory) of matrix j, and lane
// 4g + t receives word t of row g of every matrix
SP_DEV void sp_ldmatrix4(unsigned (&r)[4], const unsigned short* p) {
  unsigned lane = threadIdx.x & 31u;
  spemu::Warp& w = (*spemu::warps)[threadIdx.x >> 5];
  w.rows[lane] = p;
  w.bar->arrive_and_wait();
  for (int j = 0; j < 4; ++j) {
    const unsigned short* row = w.rows[8 * j + (lane >> 2)];
    r[j] = 0;
    if (spemu_shared_ok(row, 16)) std::memcpy(&r[j], row + 2 * (lane & 3), 4);
  }
  w.bar->arrive_and_wait();
}

// A launch's start: no error yet, nothing stored or prefetched, and the buffers (address, bytes) it may touch
inline void spemu_begin_launch(std::vector<std::pair<const void*, size_t>> buffers) {
  spemu::error.clear();
  spemu_stored.clear();
  spemu_prefetched.clear();
  spemu::ranges.clear();
  for (auto [p, n] : buffers) spemu::ranges.push_back({static_cast<const char*>(p), static_cast<const char*>(p) + n});
}

namespace spemu {
// A launch: every CTA of `grid` one at a time, in an order shuffled by `seed`, each with `threads` std::threads
// running `body` (the kernel's call), its dynamic shared memory `shared_bytes` of 0xFF (unwritten reads as NaN)
template <typename Body>
inline void run_grid(Dim3 grid, unsigned threads, unsigned seed, size_t shared_bytes, Body body) {
  grid3 = grid;
  block3 = {threads, 1, 1};
  std::vector<Dim3> order;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) order.push_back({x, y, z});
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  for (Dim3 b : order) {
    std::barrier<> cta(threads);
    std::vector<Warp> cta_warps(threads / 32);
    for (auto& w : cta_warps) w.bar = std::make_unique<std::barrier<>>(32);
    cta_barrier = &cta;
    dyn_smem.assign(shared_bytes, 0xFF);
    warps = &cta_warps;
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t)
      pool.emplace_back([&, t, b] {
        tid3 = {t, 0, 0};
        bid3 = b;
        body();
      });
    for (auto& th : pool) th.join();
  }
}
}  // namespace spemu
