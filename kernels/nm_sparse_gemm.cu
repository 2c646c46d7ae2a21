// A 2:4 GEMM on the sparse tensor cores for prompts (auto weighs it from 32 tokens): y[T, R] = x[T, C] @ W[R, C]^T
// (+ bias) by mma.sp m16n8k32, tiled as a GEMM. nm_sparse_mma.cu (the decode) holds every weight byte in registers
// once and reads the input per warp; here the weight's kept values, position words and the input's tile pass through
// shared memory, so each fragment read there serves several MMAs (a warp's MT m-tiles share each B fragment, its NT
// n-tiles each A fragment). Same layouts, same MMA and same fragment readings as the decode (nm_sparse_mma.cu says
// them); the device prelude of kernels/nm_sparse_mma.py comes first (on the CPU tests/sparse_mma_emulator.hpp), then
// nm_sparse_common.cuh.
//
// A CTA owns BM = WM * MT * 16 rows and BN = WN * NT * 8 tokens (blockIdx.y the row block, blockIdx.x the token
// block: the token blocks of a row block run side by side and share its weight in L2). Its WM x WN warps hold MT x NT
// tiles of 16 rows x 8 tokens each. K goes by stages of 64 columns, STAGES of them in flight in shared memory,
// copied by cp.async (16 bytes; tokens past T read as zeros; each thread's copies worked out once, sp_gemm_copies):
//   A  BM rows x 32 kept values (64 bytes a row, four 16-byte chunks, chunk c at c ^ ((row >> 1) & 3));
//   B  BN tokens x 64 columns (128 bytes a token, eight chunks, chunk c at c ^ (token & 7));
//   E  the position words of those 64 columns: 2 words a row (TILED = 0: row r's words at 2r, 2r + 1), or for each
//      64-row band its two 32-column tiles of cuSPARSELt's order (TILED = 1: 64 words a tile, as the layer holds them).
// The swizzles put each ldmatrix phase's 8 rows of 16 bytes on 32 distinct banks. Per 32 columns (one k32 MMA)
// a warp loads its NT B fragments and MT A fragments by ldmatrix.x4 (A: the dense m16n8k16 fragment of the kept
// values; B: 8 tokens x 32 columns, matrix j = columns 8j..8j+7) and issues MT * NT MMAs. Lanes 4g + 2s + {0,1} hold
// the metadata of the stage's s-th 32 columns (selector s), so one register a m-tile covers a stage.
// The sums go through shared memory (rounded to 16 bits, bias added first) and leave as 16-byte rows of y.
// Split-K (gridDim.z > 1, where the row and token blocks alone would leave SMs idle: short prompts, few rows): CTA z
// takes KS columns from z * KS and writes its fp32 sums to partial[z][T][R]; the last CTA of a tile to finish (a
// counter, left at zero for the next call) adds the splits in split order, so the result does not depend on timing.
//
// WGMMA 1 (Hopper, sm_90a): the same CTA, copies, stages and epilogue, its MMAs Hopper's own wgmma.mma_async.sp
// m64n(BN)k32 instead: each warpgroup (4 warps, 64 rows; MT 1, WN 1, WM a multiple of 4) multiplies its 64 rows of
// kept values by the whole stage's input tile, both read by the tensor cores from shared memory through matrix
// descriptors. The tiles above are already the layouts wgmma reads: A K-major in the 64-byte swizzle (64-byte rows,
// 512-byte groups of 8, chunk c of row r at c ^ ((r >> 1) & 3)), B K-major in the 128-byte swizzle (128-byte rows,
// 1024-byte groups, chunk c of token n at c ^ (n & 7)); so each stage starts on 1024 bytes, and the second k32 starts
// 32 bytes into each A row and 64 into each B row. The metadata takes selector 0 (lanes 4g + {0, 1} of each warp: role
// t & 1, each k32 its own register). A step's wgmmas run on through the next step's barrier and copies; that step
// then waits for them (wgmma.wait_group 0) before it writes its own metadata registers, since ptxas serializes the
// wgmmas where a register one reads is written while any runs ("C7513 ... non wgmma instructions defining input
// registers", NVRTC 13.5: so with the metadata written in flight, even into a second register set); the position
// words themselves are read before the wait. So a slot is copied into two steps after its own stage (STAGES - 2
// stages of copies in flight), and the SM's other warpgroups cover the short gap at each wait.
//
// MAPPED 1 (under WGMMA, a few tokens): the layer's index map read in the kernel. The stages then hold no input: the
// CTA first gathers its columns of its tokens through the map (x[token][perm[col]], 8 columns a 16-byte chunk) into
// a region after the slots, laid out as the stages' input tiles one after another (BN tokens x 128 bytes a stage, the
// 128-byte swizzle), while its first stages of weight stream in; each step's B descriptor points there.
//
// Compile-time parameters: MT, NT, WM, WN, STAGES, TILED, HAS_BIAS, IS_BF16, ORDERED, WGMMA, MAPPED and the four fragment
// knobs (A_SWAP, META_HALF_SWAP, META_ROLE_SWAP, B_SWAP: as in nm_sparse_mma.cu; B_SWAP has no effect under WGMMA,
// where the tensor cores read B themselves).

#define WARPS (WM * WN)
#define THREADS (32 * WARPS)
#define BM (WM * MT * 16)
#define BN (WN * NT * 8)
#define A_HALVES (BM * 32)           // a stage's kept values, 16-bit
#define B_HALVES (BN * 64)           // a stage's input, 16-bit
#define E_WORDS (BM * 2)             // a stage's position words (both layouts: 2 words of 32 columns a row)
#if WGMMA
#if MAPPED
// the input is staged apart (after the slots): a slot holds the kept values and position words, on 1024 bytes
#define STAGE_HALVES ((A_HALVES + 2 * E_WORDS + 511) / 512 * 512)
#else
// each stage's B tile on 1024 bytes (the swizzle's period, which the tensor cores work out from the address)
#define STAGE_HALVES ((A_HALVES + B_HALVES + 2 * E_WORDS + 511) / 512 * 512)
#endif
static_assert(MT == 1 && WN == 1 && WM % 4 == 0, "a wgmma CTA: warpgroups of 4 warps along the rows, one m-tile each");
static_assert(NT * 8 <= 256 && STAGES >= 3, "wgmma takes N up to 256; a slot is copied into two steps after its own");
#define AHEAD (STAGES - 2)           // stages of copies in flight: a step's wgmmas run on into the next step
static_assert(A_HALVES % 512 == 0, "the B tile after the kept values on 1024 bytes");
#else
#define STAGE_HALVES (A_HALVES + B_HALVES + 2 * E_WORDS)
#define AHEAD (STAGES - 1)
#endif
#if MAPPED && !WGMMA
#error "the map is read in the kernel by its wgmma form only"
#endif
#if MAPPED
#define E_AT A_HALVES                 // a slot's position words, after its kept values
#else
#define E_AT (A_HALVES + B_HALVES)
#endif
#define OUT_LD (BM + 8)              // the output tile's row (a token) in 16-bit units: rows 16 bytes apart in banks

SP_DEV int sp_a_offset(int row, int chunk) { return row * 32 + 8 * (chunk ^ ((row >> 1) & 3)); }
SP_DEV int sp_x_offset(int token, int chunk) { return token * 64 + 8 * (chunk ^ (token & 7)); }

// What a thread copies each stage, worked out once (per stage it then issues A_COPIES + X_COPIES (+ 1) copies, each a
// pointer step and a cp.async: no division, no loop, no branch). Thread tid's kept-value chunks are chunk tid & 3 of
// rows tid / 4 + j * A_ROW_STEP, its input chunks chunk tid & 7 of tokens tid / 8 + j * X_TOKEN_STEP; both steps are
// multiples of 8 rows, so every chunk j of a thread lands in the same swizzled column of its row.
#define A_COPIES (BM * 4 / THREADS)   // 16-byte kept-value chunks a thread copies a stage
#if BN * 8 >= THREADS
#define X_COPIES (BN * 8 / THREADS)   // 16-byte input chunks
#define X_COPIERS THREADS
#else                                 // fewer input chunks than threads (the wgmma form's 8 or 16 tokens a CTA):
#define X_COPIES 1                    // the first BN * 8 threads copy one each
#define X_COPIERS (BN * 8)
#endif
#define A_ROW_STEP (THREADS / 4)
#define X_TOKEN_STEP (THREADS / 8)
#if TILED
#define E_COPIERS (BM / 2)            // threads that copy 16 bytes of position words (a 64-row band's 2 tiles: 512 B)
#define E_STAGE_STEP 128              // words from one stage's position words to the next's
#else
#define E_COPIERS BM                  // threads that copy a row's 2 position words (8 bytes)
#define E_STAGE_STEP 2
#endif
static_assert(A_COPIES * THREADS == BM * 4 && X_COPIES * X_COPIERS == BN * 8, "each thread copies whole chunks");
static_assert(A_ROW_STEP % 8 == 0 && X_TOKEN_STEP % 8 == 0, "a thread's chunks share their swizzled column");
static_assert(E_COPIERS <= THREADS, "one copy of position words a thread at most");

struct SpGemmCopies {
  const unsigned short* a;   // the source of the thread's first kept-value chunk of the next stage to copy
  const unsigned short* x;   // of its first input chunk
  const unsigned* e;         // of its position words
  int a_step, x_step;        // 16-bit elements between the sources of its consecutive chunks (A_ROW_STEP rows;
                             // X_TOKEN_STEP tokens)
  long long x_last;          // elements from x to the last token's chunk: a chunk past T copies zeros from there
                             // (64-bit: a long prompt's T x stride passes 2^31)
  int a_at, x_at, e_at;      // where its first chunks go in a stage (16-bit units)
  int x_valid;               // chunks of its tokens before T
};

SP_DEV SpGemmCopies sp_gemm_copies(const unsigned short* x, const unsigned short* values, const unsigned* meta, int T,
                                   int C, int xs, int row_base, int tok_base, int k0, int tid) {
  SpGemmCopies cp;
  const int half_c = C >> 1;
  int r = tid >> 2, ca = tid & 3, n = tid >> 3, cx = tid & 7, token = tok_base + n;
  cp.a = values + (long long)(row_base + r) * half_c + k0 * 32 + 8 * ca;
  cp.a_step = A_ROW_STEP * half_c;
  cp.a_at = sp_a_offset(r, ca);
  cp.x = x + (long long)token * xs + k0 * 64 + 8 * cx;
  cp.x_step = X_TOKEN_STEP * xs;
  cp.x_last = (long long)(T - 1 - token) * xs;
  cp.x_at = A_HALVES + sp_x_offset(n, cx);
  cp.x_valid = token < T ? (T - 1 - token) / X_TOKEN_STEP + 1 : 0;
#if TILED
  // thread tid (< BM / 2) copies 16 bytes of 64-row band tid / 32: the band's tiles 2kt and 2kt + 1 are 128
  // consecutive words of the layer's buffer
  int band = tid >> 5, ce = tid & 31;
  cp.e = meta + (long long)(row_base / 64 + band) * (2LL * C) + (long long)k0 * 128 + 4 * ce;
  cp.e_at = E_AT + 2 * (band * 128 + 4 * ce);
#else
  cp.e = meta + (long long)(row_base + tid) * (C / 32) + 2 * k0;   // row tid's 2 words
  cp.e_at = E_AT + 2 * (2 * tid);
#endif
#if WGMMA
  // worked out once: kept in registers, not worked out again from the thread index at every stage, as the compiler
  // did (sm_90a, NVRTC 13.5: the 128 x 128 tile's loop 122 -> 113 instructions a stage, 94 -> 99 registers; the
  // mma.sp tiles gained nothing and took 3-8 registers more, so they go without)
  sp_keep(cp.a_at);
  sp_keep(cp.x_at);
  sp_keep(cp.e_at);
  sp_keep(cp.x_valid);
  sp_keep(cp.a_step);
  sp_keep(cp.x_step);
  sp_keep(cp.x_last);
#endif
  return cp;
}

SP_DEV void sp_gemm_copy_stage(unsigned short* stage, SpGemmCopies& cp, int tid) {
  // the next stage's kept values, input and position words into shared memory by asynchronous copies; the sources
  // then move on 64 columns
  const unsigned short* src = cp.a;
#pragma unroll
  for (int j = 0; j < A_COPIES; ++j, src += cp.a_step) sp_cp_async16(stage + cp.a_at + j * (A_ROW_STEP * 32), src, 16);
  src = cp.x;
  if (!MAPPED && (X_COPIERS == THREADS || tid < X_COPIERS)) {   // mapped: the input is staged apart, once
#pragma unroll
    for (int j = 0; j < X_COPIES; ++j, src += cp.x_step) {
      bool valid = j < cp.x_valid;   // a token past T copies nothing and zero-fills (its source the last token's)
      sp_cp_async16(stage + cp.x_at + j * (X_TOKEN_STEP * 64), valid ? src : cp.x + cp.x_last, valid ? 16 : 0);
    }
  }
  if (tid < E_COPIERS) {
#if TILED
    sp_cp_async16(stage + cp.e_at, cp.e, 16);
#else
    sp_cp_async8(stage + cp.e_at, (const unsigned short*)cp.e);
#endif
  }
  cp.a += 32;
  cp.x += 64;
  cp.e += E_STAGE_STEP;
}

struct SpMetaWords { unsigned lo, hi; };   // the two position words a lane's metadata register is made of

SP_DEV SpMetaWords sp_gemm_meta_words(const unsigned* Es, int r16, int lane, int kk) {
  // the position words of the m-tile at CTA row r16 this lane's register takes for the stage's kk-th 32 columns
  int g = lane >> 2;
#if TILED
  // pair 8a + g of the band's tile kk: rows g (low nibbles) and g + 8 (high), groups 0 4 1 5 | 2 6 3 7
  const unsigned* p = Es + (r16 / 64) * 128 + kk * 64 + 2 * (8 * ((r16 % 64) / 16) + g);
  return {sp_lds32((const unsigned short*)p), sp_lds32((const unsigned short*)(p + 1))};
#else
  // rows g and g + 8
  return {sp_lds32((const unsigned short*)(Es + 2 * (r16 + g) + kk)),
          sp_lds32((const unsigned short*)(Es + 2 * (r16 + g + 8) + kk))};
#endif
}

SP_DEV unsigned sp_gemm_meta_join(SpMetaWords w, int lane) {
  // the metadata register from those words: role t & 1 (slots 4 * role ..), row g's codes in bits 0-15 and row
  // g + 8's in 16-31
  int role = (lane & 1) ^ META_ROLE_SWAP;
#if TILED
  // bytes of groups 4 role + 0..3
  return sp_codes_register(sp_byte_perm(w.lo, w.hi, role ? 0x7531u : 0x6420u));
#elif META_HALF_SWAP
  return sp_byte_perm(w.hi, w.lo, role ? 0x7632u : 0x5410u);
#else
  return sp_byte_perm(w.lo, w.hi, role ? 0x7632u : 0x5410u);
#endif
}

SP_DEV unsigned sp_gemm_meta(const unsigned* Es, int r16, int lane) {
  // mma.sp's one register for a stage: lanes 4g + 2kk + {0, 1} hold the stage's kk-th 32 columns (selector kk)
  return sp_gemm_meta_join(sp_gemm_meta_words(Es, r16, lane, (lane & 3) >> 1), lane);
}

SP_DEV void sp_gemm_compute_stage(const unsigned short* stage, float (&acc)[MT][NT][4], int wr, int wc, int lane) {
  const unsigned short* As = stage;
  const unsigned short* Bs = stage + A_HALVES;
  const unsigned* Es = (const unsigned*)(stage + A_HALVES + B_HALVES);
  unsigned e[MT];
#pragma unroll
  for (int i = 0; i < MT; ++i) e[i] = sp_gemm_meta(Es, wr * MT * 16 + 16 * i, lane);
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    unsigned b[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      int token = wc * NT * 8 + 8 * n + (lane & 7);
      sp_ldmatrix4(b[n], Bs + sp_x_offset(token, 4 * kk + (lane >> 3)));
#if B_SWAP
      unsigned s = b[n][1];
      b[n][1] = b[n][2];
      b[n][2] = s;
#endif
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      unsigned a[4];
      int row = wr * MT * 16 + 16 * i + (lane & 7) + 8 * ((lane >> 3) & 1);
      sp_ldmatrix4(a, As + sp_a_offset(row, 2 * kk + (lane >> 4)));
#if A_SWAP
      unsigned s = a[1];
      a[1] = a[2];
      a[2] = s;
#endif
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        if (kk == 0)
          sp_mma<0>(acc[i][n], a, b[n], e[i]);
        else
          sp_mma<1>(acc[i][n], a, b[n], e[i]);
      }
    }
  }
}

#if WGMMA
SP_DEV unsigned long long sp_a_descriptor(const unsigned short* a) {
  // the kept values, K-major in 64-byte swizzled groups of 8 rows (layout 2), the groups 512 bytes apart: the stage's
  // A tile as sp_a_offset lays it out (chunk c of row r at c ^ ((r >> 1) & 3): the 64-byte swizzle)
  return (unsigned long long)((sp_shared_address(a) >> 4) & 0x3FFFu) | (1ull << 16) | (32ull << 32) | (2ull << 62);
}

SP_DEV unsigned long long sp_b_descriptor(const unsigned short* b) {
  // a K-major operand in 128-byte swizzled groups of 8 rows (layout 1, bits 62-63), the groups 1024 bytes apart
  // (stride offset, bits 32-45, in 16 bytes), the leading offset unused in this layout (1); the start address in 16
  // bytes (bits 0-13)
  return (unsigned long long)((sp_shared_address(b) >> 4) & 0x3FFFu) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

#if MAPPED
SP_DEV void sp_gather_input(unsigned short* xs_tile, const unsigned short* x, const int* perm, int T, int xs,
                            int tok_base, int k0, int stages_k, int tid) {
  // the CTA's columns (stages k0 .. k0 + stages_k - 1) of its BN tokens through the map, into the staged region: chunk
  // (stage s, token n, 8 columns c) of source columns perm[64 (k0 + s) + 8c ..] at s * BN * 64 + sp_x_offset(n, c);
  // tokens past T are zeros
  for (int i = tid; i < stages_k * BN * 8; i += THREADS) {
    int c = i & 7, n = (i >> 3) % BN, s = (i >> 3) / BN, token = tok_base + n;
    u32x4 v = {0u, 0u, 0u, 0u};
    if (token < T) {
      const int* cols = perm + (k0 + s) * 64 + 8 * c;
      u32x4 p0 = sp_ldg128(cols), p1 = sp_ldg128(cols + 4);
      const unsigned short* row = x + (long long)token * xs;
      v.x = sp_ld16(row + p0.x) | ((unsigned)sp_ld16(row + p0.y) << 16);
      v.y = sp_ld16(row + p0.z) | ((unsigned)sp_ld16(row + p0.w) << 16);
      v.z = sp_ld16(row + p1.x) | ((unsigned)sp_ld16(row + p1.y) << 16);
      v.w = sp_ld16(row + p1.z) | ((unsigned)sp_ld16(row + p1.w) << 16);
    }
    sp_st_shared128(xs_tile + s * BN * 64 + sp_x_offset(n, c), v);
  }
}
#endif

SP_DEV void sp_wgmma_step(unsigned short* smem, int kt, int stages_k, SpGemmCopies& cp, float (&acc)[1][NT][4],
                          int warp, int lane, int tid) {
  // step kt, while the step before's wgmmas still run: its stage landed (this thread's copies, then everyone's, made
  // visible to the tensor cores), the copies of stage kt + STAGES - 2 issued into the slot of stage kt - 2 (retired:
  // every warpgroup waited for its wgmmas in step kt - 1, before this barrier); then the step before's wgmmas waited
  // for, and only then this warp's metadata of both k32 halves written (no wgmma runs while a register it reads is
  // written), two wgmma.sp issued (A and B read from the stage by the tensor cores) and left running
  sp_cp_async_wait<STAGES - 3>();
  sp_fence_proxy_async();
  __syncthreads();
  if (kt + STAGES - 2 < stages_k) sp_gemm_copy_stage(smem + ((kt + STAGES - 2) % STAGES) * STAGE_HALVES, cp, tid);
  sp_cp_async_commit();
  const unsigned short* stage = smem + (kt % STAGES) * STAGE_HALVES;
  const unsigned* Es = (const unsigned*)(stage + E_AT);
  // A: this warpgroup's 64 rows (64 bytes a row, 64-byte swizzle), the second k32 32 bytes in; B: the stage's tokens
  // (128 bytes a token, 128-byte swizzle; mapped: its tile of the staged input), the second k32 64 bytes in
#if MAPPED
  const unsigned short* b_tile = smem + STAGES * STAGE_HALVES + kt * (BN * 64);
#else
  const unsigned short* b_tile = stage + A_HALVES;
#endif
  unsigned long long a0 = sp_a_descriptor(stage + (warp / 4) * 64 * 32), b0 = sp_b_descriptor(b_tile);
  unsigned long long desc[2][2] = {{a0, b0}, {a0 + 2, b0 + 4}};
  SpMetaWords words[2];   // read while the wgmmas run; the registers they make are written after
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) words[kk] = sp_gemm_meta_words(Es, 16 * warp, lane, kk);
  sp_wgmma_wait<0>(acc);
  unsigned e[2];
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) e[kk] = sp_gemm_meta_join(words[kk], lane);
  sp_wgmma_operands_ready(e, desc);   // every operand defined before the fence, none after
  sp_wgmma_fence(acc);
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) sp_wgmma_sp(acc, desc[kk][0], desc[kk][1], e[kk]);
  sp_wgmma_commit();
}
#endif

SP_DEV bool sp_last_to_arrive(int* counter, int arrivals, int& flag, int tid) {
  // split-K: whether this CTA is the last of `arrivals` to finish its part (after its partial sums are written); its
  // sums and every earlier CTA's are then visible to it. `flag` is a __shared__ int of the CTA; every thread calls this
  sp_threadfence();
  __syncthreads();
  if (tid == 0) flag = sp_atomic_add(counter, 1) == arrivals - 1;
  __syncthreads();
  if (!flag) return false;
  sp_threadfence();
  return true;
}

extern "C" __global__ void SP_BOUNDS(THREADS) nm_sparse_gemm(
    const unsigned short* x, const unsigned short* values, const unsigned* meta, const unsigned short* bias,
    unsigned short* y, float* partial, int* counters, const int* perm, int T, int R, int C, int xs, int KS) {
#if WGMMA
  SP_DYNAMIC_SHARED(unsigned short, smem_raw);
  unsigned short* smem = smem_raw + ((1024u - (sp_shared_address(smem_raw) & 1023u)) & 1023u) / 2;   // 1024 spare
#else
  SP_DYNAMIC_SHARED(unsigned short, smem);
#endif
  __shared__ int last_flag;
  int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  int wr = warp % WM, wc = warp / WM;
  int row_base = blockIdx.y * BM, tok_base = blockIdx.x * BN;
  int k0 = (int)blockIdx.z * (KS / 64);                              // this split's first stage of 64 columns
  int stages_k = ((C - (int)blockIdx.z * KS < KS ? C - (int)blockIdx.z * KS : KS)) / 64;

  float acc[MT][NT][4];
  sp_zero(acc);

  SpGemmCopies cp = sp_gemm_copies(x, values, meta, T, C, xs, row_base, tok_base, k0, tid);
  // the first AHEAD stages in flight (a commit group each, empty past the end, so the waits count right)
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    if (s < stages_k) sp_gemm_copy_stage(smem + s * STAGE_HALVES, cp, tid);
    sp_cp_async_commit();
  }
#if MAPPED
  sp_gather_input(smem + STAGES * STAGE_HALVES, x, perm, T, xs, tok_base, k0, stages_k, tid);   // weight streaming
#else
  (void)perm;
#endif
#if WGMMA
  // every split holds a stage or more (whole_splits): a loop with no path around it, so ptxas sees no accumulator
  // written (the zeros of a split with no stage) while a wgmma may run ("C7515", the 64 x 16 tile, NVRTC 13.5)
  int kt = 0;
  do sp_wgmma_step(smem, kt, stages_k, cp, acc, warp, lane, tid);
  while (++kt < stages_k);
  sp_wgmma_wait<0>(acc);
#else
  int read = 0, write = STAGES - 1;   // the slots of stage kt and of stage kt + STAGES - 1
  for (int kt = 0; kt < stages_k; ++kt) {
    sp_cp_async_wait<STAGES - 2>();   // this thread's copies of stage kt landed
    __syncthreads();                   // every thread's; and every warp is done with stage kt - 1's slot
    if (kt + STAGES - 1 < stages_k) sp_gemm_copy_stage(smem + write * STAGE_HALVES, cp, tid);
    sp_cp_async_commit();
    sp_gemm_compute_stage(smem + read * STAGE_HALVES, acc, wr, wc, lane);
    read = read == STAGES - 1 ? 0 : read + 1;
    write = write == STAGES - 1 ? 0 : write + 1;
  }
#endif
  sp_cp_async_wait<0>();
  __syncthreads();   // every warp is done with the stages: the output tile takes their place
  (void)bias;
  // each sum of the warp: with split-K to partial[z][T][R] in fp32 (8 lanes of a token write 32 consecutive bytes),
  // else bias added and rounded to 16 bits into the output tile [BN tokens][BM rows]
  bool split = gridDim.z > 1;
  unsigned short* out = smem;
#pragma unroll
  for (int o = 0; o < MT * NT * 4; ++o) {
    int i = o / (NT * 4), n = (o / 4) % NT, j = o & 3;
    int row = wr * MT * 16 + 16 * i + (lane >> 2) + 8 * (j >> 1);
    int token = wc * NT * 8 + 8 * n + 2 * (lane & 3) + (j & 1);
    if (split) {
      if (tok_base + token < T)
        sp_st_float(partial + ((long long)blockIdx.z * T + tok_base + token) * R + row_base + row, acc[i][n][j]);
    } else {
      float sum = acc[i][n][j];
#if HAS_BIAS
      sum += sp_to_float(sp_ld16(bias + row_base + row));
#endif
      sp_sts16(out + token * OUT_LD + row, sp_from_float(sum));
    }
  }
  if (split) {
    // the last CTA of the tile to finish adds every split's sums, in split order
    int tile = blockIdx.y * gridDim.x + blockIdx.x;
    if (!sp_last_to_arrive(counters + tile, (int)gridDim.z, last_flag, tid)) return;
    // one 16-byte item (4 rows of a token) a thread at a time, split order kept: the decode's batched sum (2 items, 4
    // splits deep) took 40 more registers here as compiled for sm_90 (8-warp 128 x 128: 126 -> 166, one CTA an SM)
    for (int o = tid; o < BN * (BM / 4); o += THREADS) {
      int token = tok_base + o / (BM / 4), row = row_base + 4 * (o % (BM / 4));
      if (token >= T) continue;
      float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
      for (int z = 0; z < (int)gridDim.z; ++z) {
        u32x4 v = sp_ld_cg128(partial + ((long long)z * T + token) * R + row);
        sum[0] += sp_bits_float(v.x);
        sum[1] += sp_bits_float(v.y);
        sum[2] += sp_bits_float(v.z);
        sum[3] += sp_bits_float(v.w);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) sp_store_output(y, bias, R, token, row + j, sum[j]);
    }
    if (tid == 0) sp_st_int(counters + tile, 0);   // ready for the next call (and the next graph replay)
    return;
  }
  __syncthreads();
  for (int i = tid; i < BN * (BM / 8); i += THREADS) {
    int n = i / (BM / 8), c = i % (BM / 8), token = tok_base + n;
    if (token < T) sp_st128(y + (long long)token * R + row_base + 8 * c, sp_lds128(out + n * OUT_LD + 8 * c));
  }
}
