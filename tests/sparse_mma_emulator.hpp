// The CPU side of kernels/nm_sparse_mma.cu: what its device prelude (kernels/nm_sparse_mma.py) defines for
// the GPU, defined here for g++ so the kernel's own text runs on the CPU. Every thread of a CTA is a
// std::thread; __syncthreads is a barrier of the CTA; a warp's mma.sp gathers its 32 lanes' registers
// and lane 0 computes the product as the PTX ISA defines the sparse m16n8k32 fragments (16-bit A as the
// dense m16n8k16 A fragment of kept values, metadata from the lanes the selector names, ordered codes).
// Loads and stores are checked against the launch's buffers and their alignment: a fault on the GPU is
// an error here. CTAs run one at a time, in an order the launch shuffles. Hopper's wgmma.mma_async.sp (the
// prompt GEMM's WGMMA form) runs per warpgroup through its swizzled shared-memory descriptors, as loosely timed
// as the PTX ISA lets it be (below).
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
inline thread_local unsigned barriers_passed = 0;   // this thread's __syncthreads so far in its CTA
// every cp.async a CTA issued: the issuing thread's barriers passed then, and the 16-byte chunk of shared memory it
// writes (a wgmma's operands must see no copy issued into them after the barrier before it, until it retires)
inline std::mutex copy_log_mu;
inline std::vector<std::pair<unsigned, size_t>> copy_log;
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

static inline void __syncthreads() {
  spemu::cta_barrier->arrive_and_wait();
  ++spemu::barriers_passed;
}

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
SP_DEV void sp_st_shared128(unsigned short* p, u32x4 v) {
  if (spemu_shared_ok(p, 16)) std::memcpy(p, &v, 16);
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
inline void spemu_log_copy(const void* to) {
  std::lock_guard<std::mutex> lock(spemu::copy_log_mu);
  spemu::copy_log.push_back({spemu::barriers_passed,
                             (size_t)(static_cast<const unsigned char*>(to) - spemu::dyn_smem.data()) & ~(size_t)15});
}
SP_DEV void sp_cp_async8(unsigned short* to, const unsigned short* from) {
  u32x2 v = spemu_load<u32x2>(from, 8);   // the source is read now (nothing writes it during the kernel)
  spemu_log_copy(to);
  SpemuCopy c{to, {}, 8};
  std::memcpy(c.v, &v, 8);
  if (spemu_shared_ok(to, 8)) spemu_open_copies.push_back(c);
}
SP_DEV void sp_cp_async16(unsigned short* to, const void* from, int bytes) {   // 16 bytes, or (bytes 0) zeros
  if (bytes != 0 && bytes != 16) spemu::fail("cp.async of 16 bytes given a source size other than 0 or 16");
  u32x4 v = spemu_load<u32x4>(from, 16);   // the address must lie in a buffer even where nothing is read
  spemu_log_copy(to);
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
// A's 16 x 32 tile from its kept values (kept_of(r, s): the word of row r's two kept values of group s) and the
// metadata registers of a warp's lanes (e_of(lane)) under selector `sel`, as both sparse MMAs read it (mma.sp m16n8k32,
// and each warp's 16 rows of wgmma.mma_async.sp)
template <typename KeptOf, typename EOf>
inline void sparse_a_tile(KeptOf kept_of, EOf e_of, int sel, double (&A)[16][32]) {
  for (int r = 0; r < 16; ++r) {
    int g = r % 8;
    for (int s = 0; s < 8; ++s) {
      unsigned word = kept_of(r, s);
      unsigned meta = e_of(4 * g + 2 * sel + ((s >= 4 ? 1 : 0) ^ SPEMU_HW_META_ROLE_SWAP));
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
}

inline void mma_sp_m16n8k32(Warp& w) {
  int sel = w.sel[0];
  for (int l = 1; l < 32; ++l)
    if (w.sel[l] != sel) fail("lanes of a warp disagree on the sparsity selector");
  double A[16][32] = {}, B[32][8];
  // the dense m16n8k16 A fragment of the kept values: row g's groups 0-3 in register 0 of lanes 4g + t, groups 4-7 in
  // register 2, row g + 8's in 1 and 3 (registers 1 and 2 the other way round on a GPU reading A_SWAP)
  auto kept_of = [&](int r, int s) {
#if SPEMU_HW_A_SWAP
    int reg = (r >= 8 ? 2 : 0) + (s >= 4 ? 1 : 0);
#else
    int reg = (r >= 8 ? 1 : 0) + (s >= 4 ? 2 : 0);
#endif
    return w.a[4 * (r % 8) + s % 4][reg];
  };
  sparse_a_tile(kept_of, [&](int lane) { return w.e[lane]; }, sel, A);
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

// Hopper's wgmma.mma_async.sp (m64nNk32, 16-bit, A and B through shared-memory descriptors), as loosely timed as the
// PTX ISA lets it be: it reads its shared-memory operands when it is issued (so a tile whose copies have not landed
// yet reads the poison) and must find them unchanged when a wgmma.wait_group retires it (a slot copied into while it
// runs is an error), likewise its metadata registers; it adds into the accumulators only at the retirement (a kernel
// that touches them before computes something else). Both operands K-major in swizzled groups of 8 rows, the only
// layouts modeled: A (64 rows x 16 kept values) in the 64-byte swizzle (byte 2c of row r at start + (r / 8) * stride + (r % 8) * 64 + 2c, its 16-byte chunk XORed
// with bits 7-8 of that offset), B (N tokens x 32 columns) in the 128-byte swizzle (row pitch 128, XOR with bits
// 7-9). Warp w's 16 rows (16w..) take their metadata from its lanes as mma.sp reads a warp's (selector 0); D as
// mma's m16n8 fragment for each 8 columns (registers 4j .. 4j + 3 for columns 8j ..).
namespace spemu {
struct WgmmaTiles {            // what a wgmma reads from shared memory: A's kept values as 32-bit words (64 rows x 8
  std::vector<unsigned> a;     // pairs), B's halves as values (32 x n)
  std::vector<double> b;
  bool operator==(const WgmmaTiles& o) const { return a == o.a && b == o.b; }
};
struct WgmmaOp {
  unsigned long long a, b;
  const unsigned* e;
  unsigned e_issued;
  float* d;
  int n;
  WgmmaTiles tiles;            // thread 0 of the warpgroup: A's kept values and B as read at the issue,
  std::vector<size_t> chunks;  // the 16-byte chunks they lie in,
  unsigned barriers = 0;       // and its barriers passed then
};
struct WarpGroup {
  std::unique_ptr<std::barrier<>> bar;
  std::vector<WgmmaOp>* front[128];
  size_t counts[128];
  bool retire = false;
};
inline std::vector<WarpGroup>* warpgroups = nullptr;
inline thread_local std::vector<WgmmaOp> wg_open;                  // issued, not committed
inline thread_local std::vector<std::vector<WgmmaOp>> wg_groups;   // committed, not retired

// the shared-memory offset of byte `col_byte` of row `row` of a K-major operand: descriptor `desc` of swizzle
// layout `layout` (1: 128-byte rows, 2: 64-byte rows), the operand's `row_bytes` per wgmma; or SIZE_MAX (an error)
inline size_t swizzled_offset(unsigned long long desc, unsigned layout, size_t row_bytes, int row, size_t col_byte) {
  size_t pitch = layout == 1 ? 128 : 64, period = 8 * pitch;
  if ((desc >> 62) != layout || ((desc >> 49) & 7u) != 0u) {
    fail("a wgmma descriptor of another swizzle or a base offset (not modeled)");
    return SIZE_MAX;
  }
  size_t start = (desc & 0x3FFFu) << 4, stride = ((desc >> 32) & 0x3FFFu) << 4;
  if (start % pitch + row_bytes > pitch || start % period >= pitch) {
    fail("a wgmma's columns do not lie in the first row of a swizzle group");
    return SIZE_MAX;
  }
  size_t off = start + (row / 8) * stride + (row % 8) * pitch + col_byte;
  off ^= ((off >> 7) & (pitch / 16 - 1)) << 4;
  if (off + 2 > dyn_smem.size()) {
    fail("a wgmma reads past the launch's dynamic shared memory");
    return SIZE_MAX;
  }
  return off;
}

inline unsigned short smem_half(size_t off) {
  unsigned short h = 0;
  if (off != SIZE_MAX) std::memcpy(&h, dyn_smem.data() + off, 2);
  return h;
}

// the words of A's kept values (64 rows x 8 pairs) and B's halves (32 x n) a wgmma reads from shared memory now (and,
// given `chunks`, the 16-byte chunks they lie in)
inline WgmmaTiles wgmma_tiles(unsigned long long a, unsigned long long b, int n, std::vector<size_t>* chunks = nullptr) {
  WgmmaTiles t{std::vector<unsigned>(64 * 8), std::vector<double>(32 * n)};
  auto half = [&](size_t off) {
    if (chunks && off != SIZE_MAX) chunks->push_back(off & ~(size_t)15);
    return smem_half(off);
  };
  for (int r = 0; r < 64; ++r)
    for (int s = 0; s < 8; ++s)
      t.a[r * 8 + s] = (unsigned)half(swizzled_offset(a, 2, 32, r, 4 * s)) |
                       (unsigned)half(swizzled_offset(a, 2, 32, r, 4 * s + 2)) << 16;
  for (int c = 0; c < n; ++c)
    for (int q = 0; q < 32; ++q) t.b[q * n + c] = sp_to_float(half(swizzled_offset(b, 1, 64, c, 2 * q)));
  if (chunks) {
    std::sort(chunks->begin(), chunks->end());
    chunks->erase(std::unique(chunks->begin(), chunks->end()), chunks->end());
  }
  return t;
}

inline void wgmma_compute(WarpGroup& g, size_t i) {
  const WgmmaOp& op0 = g.front[0]->at(i);
  for (int t = 0; t < 128; ++t) {
    if (g.front[t]->size() != g.front[0]->size()) return fail("threads of a warpgroup committed different wgmmas");
    const WgmmaOp& o = g.front[t]->at(i);
    if (o.a != op0.a || o.b != op0.b || o.n != op0.n)
      return fail("threads of a warpgroup disagree on a wgmma's operands or shape");
    if (*o.e != o.e_issued) return fail("a wgmma's metadata register was written while it ran");
  }
  int n = op0.n;
  {
    std::lock_guard<std::mutex> lock(copy_log_mu);
    for (auto [after, chunk] : copy_log)
      if (after >= op0.barriers && std::binary_search(op0.chunks.begin(), op0.chunks.end(), chunk))
        return fail("a copy into a wgmma's operands was issued after the barrier before it and before it retired");
  }
  if (wgmma_tiles(op0.a, op0.b, n) != op0.tiles)
    return fail("a wgmma's shared-memory operands were written while it ran (a slot copied into before it retired)");
  const double* B = op0.tiles.b.data();
  for (int w = 0; w < 4; ++w) {
    double A[16][32] = {};
    auto kept_of = [&](int r, int s) { return op0.tiles.a[(16 * w + r) * 8 + s]; };
    sparse_a_tile(kept_of, [&](int lane) { return *g.front[32 * w + lane]->at(i).e; }, 0, A);
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < n; ++c) {
        float* d = g.front[32 * w + 4 * (r % 8) + (c % 8) / 2]->at(i).d;
        int j = 4 * (c / 8) + 2 * (r >= 8 ? 1 : 0) + c % 2;
        double acc = d[j];
        for (int q = 0; q < 32; ++q) acc += A[r][q] * B[q * n + c];
        d[j] = (float)acc;
      }
  }
}
}  // namespace spemu

SP_DEV unsigned sp_shared_address(const void* p) {   // the address a shared-memory instruction takes: from the start
  return (unsigned)(static_cast<const unsigned char*>(p) - spemu::dyn_smem.data());
}
SP_DEV void sp_fence_proxy_async() {}
SP_DEV void sp_keep(int&) {}
SP_DEV void sp_keep(long long&) {}
template <int M, int N>
SP_DEV void sp_wgmma_fence(float (&)[M][N][4]) {}
SP_DEV void sp_wgmma_operands_ready(unsigned (&)[2], unsigned long long (&)[2][2]) {}
template <int M, int N>
SP_DEV void sp_wgmma_sp(float (&d)[M][N][4], unsigned long long a, unsigned long long b, const unsigned& e) {
  static_assert(M == 1, "one m-tile a warp");
  if (!spemu::warpgroups) spemu::fail("a wgmma in a CTA that is not whole warpgroups");
  spemu::WgmmaOp op{a, b, &e, e, &d[0][0][0], 8 * N, {}};
  if (threadIdx.x % 128 == 0) {   // its operands as they are now, where they lie, and the barriers passed
    op.tiles = spemu::wgmma_tiles(a, b, 8 * N, &op.chunks);
    op.barriers = spemu::barriers_passed;
  }
  spemu::wg_open.push_back(std::move(op));
}
SP_DEV void sp_wgmma_commit() {
  spemu::wg_groups.push_back(std::move(spemu::wg_open));
  spemu::wg_open.clear();
}
template <int KEEP, int M, int N>
SP_DEV void sp_wgmma_wait(float (&)[M][N][4]) {   // every committed group but the newest KEEP retires, in order
  if (!spemu::warpgroups) return;
  spemu::WarpGroup& g = (*spemu::warpgroups)[threadIdx.x / 128];
  unsigned me = threadIdx.x % 128;
  while (true) {
    g.counts[me] = spemu::wg_groups.size();
    g.front[me] = spemu::wg_groups.empty() ? nullptr : &spemu::wg_groups.front();
    g.bar->arrive_and_wait();
    if (me == 0) {
      g.retire = g.counts[0] > (size_t)KEEP;
      for (int t = 1; t < 128; ++t)
        if (g.counts[t] != g.counts[0]) {
          spemu::fail("threads of a warpgroup wait on different numbers of wgmma groups");
          g.retire = false;
        }
      if (g.retire)
        for (size_t i = 0; i < g.front[0]->size(); ++i) spemu::wgmma_compute(g, i);
    }
    g.bar->arrive_and_wait();
    if (!g.retire) break;
    spemu::wg_groups.erase(spemu::wg_groups.begin());
  }
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
    std::vector<WarpGroup> cta_groups(threads % 128 ? 0 : threads / 128);
    for (auto& g : cta_groups) g.bar = std::make_unique<std::barrier<>>(128);
    warpgroups = cta_groups.empty() ? nullptr : &cta_groups;
    copy_log.clear();
    cta_barrier = &cta;
    dyn_smem.assign(shared_bytes, 0xFF);
    warps = &cta_warps;
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t)
      pool.emplace_back([&, t, b] {
        tid3 = {t, 0, 0};
        bid3 = b;
        wg_open.clear();
        wg_groups.clear();
        body();
        if (!wg_open.empty() || !wg_groups.empty()) fail("a CTA ended with wgmmas not retired");
      });
    for (auto& th : pool) th.join();
  }
}
}  // namespace spemu
