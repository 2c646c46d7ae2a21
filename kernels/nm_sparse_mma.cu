// A 2:4 decode on the sparse tensor cores: y[T, R] = x[T, C] @ W[R, C]^T (+ bias) by mma.sp m16n8k32,
// W's kept values and position codes read as they lie (no expansion to dense, no trip through shared
// memory). Triton has no sparse MMA, so this one kernel is CUDA C++, compiled at the first call by NVRTC
// (kernels/nm_sparse_mma.py); the same text also runs on the CPU under tests/sparse_mma_emulator.hpp.
//
// Layouts (the layer's own buffer, nothing re-laid out):
//   values  [R, C/2] 16-bit, row-major kept values (two per group of four, the lower position first);
//   meta    [R, C/32] 32-bit: TILED = 0, the export's row words (group q of a word in bits 4q..4q+3, code
//           a | b << 2 for kept positions a < b); TILED = 1, cuSPARSELt's order (deploy/cslt_layout.py:
//           64-row bands, 32-column tiles of 64 words, row 16a + 8b + c in the 64-bit pair 8a + c, in its
//           low nibbles for b = 0 and high for b = 1, groups 0 4 1 5 in the low word, 2 6 3 7 in the high).
//
// The MMA (PTX ISA, sparse mma m16n8k32, 16-bit): lane = 4g + t. A holds the 16x16 kept values as the
// dense m16n8k16 A fragment: a[0] row g slot t, a[1] row g+8 slot t, a[2] row g slot t+4, a[3] row g+8
// slot t+4 (a slot is one group of four columns: its two kept values). B (32 x 8): b[i] holds rows
// 2t + 8i + {0,1}, column (token) g. The metadata of selector s comes from lanes 4g + 2s + {0,1}: bits
// 0..15 row g, 16..31 row g+8, slot 4j + k (j = lane & 1) in nibble k. D: d[0..1] row g, tokens 2t+{0,1};
// d[2..3] row g+8.
//
// What a warp reads: a step is 128 columns, two blocks of 64 (16 groups). In a block, lane t reads 16
// bytes of row g and of row g+8: groups 4t..4t+3. Those feed two MMAs ("halves" h = 0, 1): slot t takes
// group 4t + 2h, slot t+4 group 4t + 2h + 1. So every weight byte is one 16-byte load, and the input's
// columns follow the same assignment (B row q: slot q/4, column 4 * group + q % 4). Block b's MMAs take
// their metadata by selector b from lanes 4g + 2b + {0,1}: each lane works out the two metadata words of
// its own block (b = t >> 1) and role (t & 1), and passes them to both blocks' MMAs (the lanes a selector
// does not name are not read).
//
// Addresses: each lane works out its rows once (sp_weights: its kept values and position words; sp_input: its tokens'
// input rows, the last token's for a lane past T, whose sums are never stored), so every load in the K loop is a
// pointer plus the step's column plus a constant of the unrolled loop: nothing multiplied, no parameter read again.
//
// Work split: a CTA owns RW * MT * 16 rows and KS columns (blockIdx.y picks the columns: split-K); its
// WARPS = RW * KW warps take MT m-tiles each and every KW-th step of the CTA's columns. Partial sums meet
// in shared memory; with split-K each CTA writes its fp32 partial, and the last of a row block to finish
// (a counter, reset for the next call) adds them in split order, so the result does not depend on timing.
//
// With an index map (HAS_PERM), the CTA first gathers its columns of every token through the map into shared
// memory (T x KS 16-bit values, the launch's dynamic shared memory), its first step's weight loads in flight,
// and its warps read B from there: the map costs one gather per CTA, not a launch. STAGE_X (no map) stages the
// gathered input in a ring of two rounds instead (a round: one step per K group), copied by asynchronous 8-byte
// copies two rounds ahead: each input byte then leaves L2 once per CTA, not once per warp, and the warps read B
// from shared memory, where a 32-bit load from global memory touches 8 token rows (8 cache lines) at once.
// MAP_INLINE (with HAS_PERM) stages nothing: each B register reads its two columns' map entries (one 8-byte load) and
// gathers the two inputs from global memory as it is loaded, a step ahead with the weight under BPRE, so no gather
// and no barrier stand before the first MMA (the map and the input, a few KB at 1 token, stay in L1).
// Staged rows are swizzled (sp_swizzle): a B load's 32 lanes read words {0, 1, 8, 9} + fixed of 8 token rows, so
// each row's words XORed by its token in bits 1, 2 and 4 fall in 32 distinct banks.
//
// Compile-time parameters (#define before this text): NT (n-tiles of 8 tokens), MT, RW, KW, TILED,
// HAS_BIAS, HAS_PERM, MAP_INLINE, STAGE_X, IS_BF16, BPRE (the input's fragments loaded with the weight's, one step
// ahead), STAGES (steps held in registers: STAGES - 1 loading while one multiplies), PDL (launched as a programmatic dependent:
// griddepcontrol.wait after the first weight loads, then launch_dependents; sm_90 and later), PREFETCH (the CTA's
// further kept values asked into L2 before it stages its input, at most PREFETCH_BUDGET bytes a launch), MIN_CTAS
// (where not 0, the CTAs an SM must hold: ptxas caps the registers to fit them).
//
// Three readings of the PTX ISA's fragments, each 0 as read above, can be flipped for a probe on a GPU
// (scripts/tune_sparse_mma.py --probe): A_SWAP (A's registers as row g slots t, t+4, then row g+8's),
// META_HALF_SWAP (row g+8's metadata in the low 16 bits), META_ROLE_SWAP (lane 4g + 2s + 1 holding slots 0-3),
// B_SWAP (B's registers 1 and 2 exchanged: rows 2t + 16 before 2t + 8).

#define WARPS (RW * KW)
#define ROWS_PER_CTA (RW * MT * 16)
#define STAGED ((HAS_PERM && !MAP_INLINE) || STAGE_X)
#define SP_RED_ITEMS 2   // the split-K sum's items a thread reads at once (each 4 rows of a token, 4 splits deep)

SP_DEV int sp_swizzle(int token) {
  // the XOR on a staged row's 32-bit words: bits 1 and 2 from the token's low two bits, bit 4 from its third
  return ((token & 3) << 1) | ((token & 4) << 2);
}

struct SpStage {
  u32x4 va[MT][2];     // [m-tile][block]: 4 groups of row g
  u32x4 vb[MT][2];     //                  ... of row g + 8
  u32x2 m0[MT];        // TILED: tile 2b's pair of words (low, high) holding rows g and g+8; ROW: row g's words
  u32x2 m1[MT];        //   of tiles 2b, 2b+1.  TILED: tile 2b+1's pair; ROW: row g+8's words of tiles 2b, 2b+1
#if BPRE
  unsigned bx[2][2][NT][4];   // [block][half][n-tile][register]
#endif
};

SP_DEV unsigned sp_b_column(int c0, int block, int half, int reg, int t) {
  // the input column of B register `reg` (its first of two) for lane t in (block, half) of the step at c0: the
  // layout's own assignment, which the staging writes by and the tests hold the loads' split (sp_lane_column +
  // sp_b_offset, sp_staged_word_at) to
#if B_SWAP
  reg = ((reg & 1) << 1) | (reg >> 1);   // the other reading: registers 1 and 2 hold rows 2t + 16 and 2t + 8
#endif
  int slot = 2 * reg + (t >> 1);
  int group = 4 * (slot & 3) + 2 * half + (slot >> 2);
  return (unsigned)(c0 + 64 * block + 4 * group + 2 * (t & 1));
}

SP_DEV int sp_lane_column(int t) {
  // the first input column of lane t's B registers in a step, past the step's first: every register's column is
  // this plus sp_b_offset (sp_b_column's assignment, split in its lane's part and its register's)
  return 16 * (t >> 1) + 2 * (t & 1);
}

SP_DEV int sp_b_offset(int block, int half, int reg) {
  // the rest of sp_b_column: compile-time in every unrolled load, so a B load is one address plus a constant
#if B_SWAP
  reg = ((reg & 1) << 1) | (reg >> 1);
#endif
  return 64 * block + 32 * (reg & 1) + 8 * half + 4 * (reg >> 1);
}

struct SpInput {            // where B's columns are read: the gathered input in global memory, or (STAGED)
  const unsigned short* x;  // the CTA's columns staged (through the index map) in shared memory, swizzled (from
  int col0;                 // column col0), or (MAP_INLINE) the input in its own order, read through
  const int* perm;          // the map (MAP_INLINE: from this lane's own column, sp_lane_column)
  // this lane's token of each n-tile (the last token's past T: the same addresses as that token's lanes, no extra
  // traffic; an MMA's output column n takes only B's column n, and the sums of tokens past T are never stored, so
  // what such a lane reads needs no branch or select):
#if STAGED
  int row[NT];              // its staged row (16-bit units past x)
  int key[NT];              // its words' XOR (sp_staged_key)
#else
  const unsigned short* row[NT];   // its row of the gathered input from its own column, or (MAP_INLINE) of the input
#endif
};

SP_DEV int sp_last_token(int token, int T) { return token < T ? token : T - 1; }

SP_DEV int sp_staged_key(int token, int lane) {
  // what a staged B load of this lane and token XORs its register's word bits with: the row's swizzle (bits 1, 2, 4)
  // and the lane's own word bits (bits 0 and 3, sp_lane_column / 2), which no register's bits touch
  return sp_swizzle(token) | (sp_lane_column(lane & 3) >> 1);
}

SP_DEV int sp_staged_word_at(int c0, int block, int half, int reg, int key) {
  // the staged word of B register `reg` in (block, half) of a step at c0 (a multiple of 128) past the staged row's
  // first column: the step's part (a multiple of 64 words) plus the register's bits (1, 2, 4, 5) XOR the lane's key
  return (c0 >> 1) + ((sp_b_offset(block, half, reg) >> 1) ^ key);
}

SP_DEV int sp_staged_word(int token, unsigned col, int col0) {
  // the 32-bit word of a staged row holding input column col (and col + 1) of token: where the staging writes it
  // (sp_staged_word_at is the same word, in parts)
  return ((int)(col - col0) >> 1) ^ sp_swizzle(token);
}

SP_DEV SpInput sp_input(const unsigned short* x, int stride, int col0, int T, const int* perm, int lane) {
  // each lane's rows worked out once, so each B load in the K loop is an address plus the step's column plus a
  // constant (global memory), or plus a logic op (staged): no multiply, no kernel parameter read again
  SpInput in = {x, col0, perm};
  int g = lane >> 2;
#if STAGED
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    int token = sp_last_token(8 * n + g, T);
    in.row[n] = token * stride;
    in.key[n] = sp_staged_key(token, lane);
  }
#else
  int col = sp_lane_column(lane & 3);
#if MAP_INLINE
  in.perm = perm + col;
  col = 0;
#endif
#pragma unroll
  for (int n = 0; n < NT; ++n) in.row[n] = x + (long long)sp_last_token(8 * n + g, T) * stride + col;
#endif
  return in;
}

SP_DEV unsigned sp_load_b(const SpInput& in, int n, int c0, int block, int half, int reg) {
  // B register `reg` of n-tile n in (block, half) of the step at column c0, for this lane
#if STAGED
  return sp_lds32(in.x + in.row[n] + 2 * sp_staged_word_at(c0 - in.col0, block, half, reg, in.key[n]));
#elif MAP_INLINE
  u32x2 p = sp_ldg64(in.perm + c0 + sp_b_offset(block, half, reg));   // the map's entries of the two columns
  return (unsigned)sp_ld16(in.row[n] + p.x) | (unsigned)sp_ld16(in.row[n] + p.y) << 16;
#else
  return sp_ld32(in.row[n] + c0 + sp_b_offset(block, half, reg));
#endif
}

SP_DEV void sp_load_inputs(SpStage& st, const SpInput& in, int c0) {
#if BPRE
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          st.bx[b][h][n][r] = sp_load_b(in, n, c0, b, h, r);
#endif
}

struct SpWeights {              // this lane's weight rows, worked out once: each load then adds the step's column
  const unsigned short* v[MT];  // its kept values of row g of each m-tile, from its own 16 bytes (row g + 8: + v8)
  const unsigned* m[MT];        // its position words of each m-tile at column 0 (TILED: its band's pair 8a + g of
                                // its own tile; rows: row g's words, row g + 8's m8 further)
  int v8;                       // 16-bit elements from a row's kept values to those 8 rows below
  int m8;                       // words from a row's position words to those 8 rows below (rows layout)
};

SP_DEV SpWeights sp_weights(const unsigned short* values, const unsigned* meta, int C, int row0, int lane) {
  SpWeights w;
  int g = lane >> 2, t = lane & 3;
  w.v8 = 8 * (C >> 1);
  w.m8 = 8 * (C / 32);
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    int ra = row0 + 16 * i + g;
    w.v[i] = values + (long long)ra * (C >> 1) + 8 * t;
#if TILED
    int r16 = row0 + 16 * i;                // the m-tile's first row: band r16 / 64, a = (r16 % 64) / 16
    w.m[i] = meta + (long long)(r16 / 64) * (2LL * C) + 2 * (t >> 1) * 64 + (((r16 % 64) / 16) * 8 + g) * 2;
#else
    w.m[i] = meta + (long long)ra * (C / 32) + 2 * (t >> 1);
#endif
  }
  return w;
}

SP_DEV void sp_load_weights(SpStage& st, const SpWeights& w, int c0) {
  // the step at column c0: 16 bytes of rows g and g + 8 of each block, and the lane's metadata block's pair of words
  // (its first 32-column tile is c0 / 32 + 2 * (t >> 1): TILED, 64 words a tile; rows, one word a tile)
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      st.va[i][b] = sp_ld128(w.v[i] + (c0 >> 1) + 32 * b);
      st.vb[i][b] = sp_ld128(w.v[i] + w.v8 + (c0 >> 1) + 32 * b);
    }
#if TILED
    st.m0[i] = sp_ld64(w.m[i] + 2 * c0);
    st.m1[i] = sp_ld64(w.m[i] + 2 * c0 + 64);
#else
    st.m0[i] = sp_ld64(w.m[i] + (c0 >> 5));
    st.m1[i] = sp_ld64(w.m[i] + w.m8 + (c0 >> 5));
#endif
  }
}

SP_DEV void sp_load_stage(SpStage& st, const SpWeights& w, const SpInput& in, int c0) {
  sp_load_weights(st, w, c0);
  sp_load_inputs(st, in, c0);
}

SP_DEV unsigned sp_meta_word(const SpStage& st, int i, int half, int role) {
  // the metadata register of m-tile i, half `half`, for this lane's block and role (slots 4 * role ..)
#if TILED
  // half 0 reads the low words (groups 0 4 1 5 | 8 12 9 13), half 1 the high ones (2 6 3 7 | 10 14 11 15);
  // role 0 takes each word's bytes 0-1 (groups 4k + 2h), role 1 bytes 2-3 (4k + 2h + 1)
  unsigned w0 = half ? st.m0[i].y : st.m0[i].x, w1 = half ? st.m1[i].y : st.m1[i].x;
  return sp_codes_register(sp_byte_perm(w0, w1, role ? 0x7632u : 0x5410u));   // byte k: row g+8's code << 4 | row g's
#else
  // group 4k + q (q = 2 * half + role) of the block: nibble q and q + 4 of each of its two row words
  int q = 2 * half + role;
  unsigned ga0 = st.m0[i].x >> (4 * q), ga1 = st.m0[i].y >> (4 * q);
  unsigned gb0 = st.m1[i].x >> (4 * q), gb1 = st.m1[i].y >> (4 * q);
  unsigned lo = (ga0 & 0xFu) | ((ga0 >> 12) & 0xF0u) | ((ga1 & 0xFu) << 8) | ((ga1 >> 4) & 0xF000u);
  unsigned hi = (gb0 & 0xFu) | ((gb0 >> 12) & 0xF0u) | ((gb1 & 0xFu) << 8) | ((gb1 >> 4) & 0xF000u);
#if META_HALF_SWAP
  return hi | (lo << 16);
#else
  return lo | (hi << 16);
#endif
#endif
}

SP_DEV unsigned sp_word(const u32x4& v, int k) {
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

SP_DEV void sp_compute_stage(const SpStage& st, float (&acc)[MT][NT][4], const SpInput& in, int c0, int lane) {
  int role = (lane & 1) ^ META_ROLE_SWAP;
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    unsigned e[2] = {sp_meta_word(st, i, 0, role), sp_meta_word(st, i, 1, role)};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
#if A_SWAP
        unsigned a[4] = {sp_word(st.va[i][b], 2 * h), sp_word(st.va[i][b], 2 * h + 1),
                         sp_word(st.vb[i][b], 2 * h), sp_word(st.vb[i][b], 2 * h + 1)};
#else
        unsigned a[4] = {sp_word(st.va[i][b], 2 * h), sp_word(st.vb[i][b], 2 * h),
                         sp_word(st.va[i][b], 2 * h + 1), sp_word(st.vb[i][b], 2 * h + 1)};
#endif
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          unsigned bb[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) {
#if BPRE
            bb[r] = st.bx[b][h][n][r];
#else
            bb[r] = sp_load_b(in, n, c0, b, h, r);
#endif
          }
          if (b == 0)
            sp_mma<0>(acc[i][n], a, bb, e[h]);
          else
            sp_mma<1>(acc[i][n], a, bb, e[h]);
        }
      }
    }
  }
}

#if STAGE_X && !HAS_PERM
SP_DEV void sp_stage_round(unsigned short* to, const unsigned short* x, int xs, int T, int k_begin, int steps, int r,
                           int warp, int lane) {
  // round r's columns of every token (T rows of 128 * KW, fewer steps in the last round) into a ring slot by 8-byte
  // asynchronous copies: a warp copies one token's step (256 contiguous bytes) at a time, lane by lane, so nothing
  // divides; a word pair keeps its place under the swizzle (it XORs bits 1, 2 and 4 of the word)
  int first = r * KW;
#pragma unroll
  for (int s = 0; s < KW; ++s) {
    if (first + s >= steps) break;
    int pair = 32 * s + lane;
    for (int token = warp; token < T; token += WARPS)
      sp_cp_async8(to + token * (128 * KW) + 2 * sp_staged_word(token, 4 * pair, 0),
                   x + (long long)token * xs + k_begin + 128 * first + 4 * pair);
  }
}
#endif

extern "C" __global__ void
#if MIN_CTAS
SP_BOUNDS_MIN(32 * WARPS, MIN_CTAS)
#else
SP_BOUNDS(32 * WARPS)
#endif
nm_sparse_mma(
    const unsigned short* x, const unsigned short* values, const unsigned* meta, const int* perm,
    const unsigned short* bias, unsigned short* y, float* partial, int* counters, int T, int R, int C, int xs, int KS) {
#if KW > 1
  __shared__ float red[WARPS][MT][NT][32][4];   // the K groups' sums of a row group, added below
#endif
  __shared__ int last_flag;
  int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  int rg = warp % RW, kg = warp / RW;
  int row0 = blockIdx.x * ROWS_PER_CTA + rg * MT * 16;
  int k_begin = blockIdx.y * KS;
  int k_end = k_begin + KS < C ? k_begin + KS : C;
  int steps = (k_end - k_begin) / 128;

  float acc[MT][NT][4];
  sp_zero(acc);

  // STAGES steps in registers: the next STAGES - 1 steps' loads are in flight while one multiplies (a warp's
  // steps are kg, kg + KW, ...; stage j of a round holds its j-th)
  SpStage st[STAGES];
  const SpWeights w = sp_weights(values, meta, C, row0, lane);
  // the first steps' weight loads (nothing any kernel writes) go out before anything else; as a programmatic
  // dependent (PDL) the kernel then waits for the one before it to end, and lets the next one start
#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j)
    if (kg + j * KW < steps) sp_load_weights(st[j], w, k_begin + 128 * (kg + j * KW));
#if PDL
  sp_grid_wait();
  sp_grid_release();
#endif
#if PREFETCH
  {
    // the CTA's kept values past the steps already loaded into registers, asked into L2 by 128-byte lines while
    // the CTA gathers its input (the weight streams from DRAM meanwhile, not after); at most PREFETCH_BUDGET bytes
    // over the whole grid, so a weight larger than L2 does not evict its own first lines
    int first_col = k_begin + 128 * (STAGES - 1) * KW;
    long long budget = PREFETCH_BUDGET / ((long long)gridDim.x * gridDim.y * ROWS_PER_CTA);
    int lines = first_col < k_end ? (int)((k_end - first_col < budget ? k_end - first_col : budget) / 128) : 0;
    for (int i = tid; i < ROWS_PER_CTA * lines; i += 32 * WARPS) {
      long long row = (long long)blockIdx.x * ROWS_PER_CTA + i / lines;
      sp_prefetch_l2(values + row * (C / 2) + first_col / 2 + 64 * (i % lines));   // a row's values: C bytes
    }
  }
#endif
#if HAS_PERM && !MAP_INLINE
  // the CTA's columns of every token, gathered once through the map into shared memory (the first steps'
  // weight loads already in flight), then read by every warp as the gathered input would be; rows swizzled
  SP_DYNAMIC_SHARED(unsigned short, staged);
  int width = k_end - k_begin;
  int quads = width / 4;
  // items of 4 columns of one token, 4 items a thread at a time: their map loads, then their 16 gathers, in flight
  // together (a loop of single loads would wait out two round trips per value)
  for (int i0 = tid; i0 < T * quads; i0 += 4 * 32 * WARPS) {
    u32x4 cols[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      int i = i0 + u * 32 * WARPS;
      if (i < T * quads) cols[u] = sp_ldg128(perm + k_begin + 4 * (i % quads));
    }
    unsigned short v[4][4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      int i = i0 + u * 32 * WARPS;
      if (i < T * quads) {
        const unsigned short* row = x + (long long)(i / quads) * xs;
        v[u][0] = sp_ld16(row + cols[u].x);
        v[u][1] = sp_ld16(row + cols[u].y);
        v[u][2] = sp_ld16(row + cols[u].z);
        v[u][3] = sp_ld16(row + cols[u].w);
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      int i = i0 + u * 32 * WARPS;
      if (i < T * quads) {
        int token = i / quads;
        unsigned short* to = staged + token * width + 2 * sp_staged_word(token, 4 * (i % quads), 0);
        sp_st_shared32(to, (unsigned)v[u][0] | (unsigned)v[u][1] << 16);
        sp_st_shared32(to + 2, (unsigned)v[u][2] | (unsigned)v[u][3] << 16);
      }
    }
  }
  __syncthreads();
  SpInput in = sp_input(staged, width, k_begin, T, perm, lane);
#elif STAGE_X
  // a ring of two rounds in shared memory: round r (the CTA's steps r * KW .. r * KW + KW - 1, one per K group)
  // is copied by every thread's asynchronous 8-byte copies two rounds ahead, while the round before is read
  SP_DYNAMIC_SHARED(unsigned short, ring);
  const int round_cols = 128 * KW, rounds = (steps + KW - 1) / KW, slot = T * round_cols;
  sp_stage_round(ring, x, xs, T, k_begin, steps, 0, warp, lane);
  sp_cp_async_commit();
  sp_stage_round(ring + slot, x, xs, T, k_begin, steps, 1, warp, lane);
  sp_cp_async_commit();
  (void)perm;
#else
  SpInput in = sp_input(x, xs, 0, T, perm, lane);   // the map read at each B load under MAP_INLINE, else not at all
#endif
#if STAGE_X && !HAS_PERM
  // the same register pipeline as below, by rounds: every warp of the CTA on the same round, two barriers a round
  for (int r0 = 0; r0 < rounds; r0 += STAGES) {
#pragma unroll
    for (int j = 0; j < STAGES; ++j) {
      int r = r0 + j;
      if (r < rounds) {   // the same for every thread of the CTA: its barriers are met by all
        sp_cp_async_wait<1>();   // this thread's copies of round r landed (round r + 1's may still fly)
        __syncthreads();          // and every thread's
        SpInput in = sp_input(ring + (r & 1) * slot, round_cols, k_begin + round_cols * r, T, perm, lane);
        int step = r * KW + kg, ahead = step + (STAGES - 1) * KW;
        if (step < steps) {
          if (ahead < steps)
            sp_load_weights(st[(j + STAGES - 1) % STAGES], w, k_begin + 128 * ahead);
          sp_compute_stage(st[j], acc, in, k_begin + 128 * step, lane);
        }
        __syncthreads();          // every warp is done with this slot: round r + 2 may overwrite it
        sp_stage_round(ring + (r & 1) * slot, x, xs, T, k_begin, steps, r + 2, warp, lane);
        sp_cp_async_commit();     // a group each round, empty past the last, so the wait above counts right
      }
    }
  }
#else
#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j)
    if (kg + j * KW < steps) sp_load_inputs(st[j], in, k_begin + 128 * (kg + j * KW));
  for (int round = kg; round < steps; round += STAGES * KW) {
#pragma unroll
    for (int j = 0; j < STAGES; ++j) {
      int step = round + j * KW, ahead = step + (STAGES - 1) * KW;
      if (step < steps) {
        if (ahead < steps)
          sp_load_stage(st[(j + STAGES - 1) % STAGES], w, in, k_begin + 128 * ahead);
        sp_compute_stage(st[j], acc, in, k_begin + 128 * step, lane);
      }
    }
  }
#endif

  bool split = gridDim.y > 1;
#if KW > 1
  // the CTA's warps that share rows add their K parts in shared memory
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j) red[warp][i][n][lane][j] = acc[i][n][j];
  __syncthreads();

  const int outputs = RW * MT * NT * 32 * 4;   // one per (row group, m-tile, n-tile, lane, register)
  for (int o = tid; o < outputs; o += 32 * WARPS) {
    int j = o & 3, l = (o >> 2) & 31, rest = o >> 7;
    int n = rest % NT, i = (rest / NT) % MT, r_g = rest / (NT * MT);
    float sum = 0.f;
    for (int k = 0; k < KW; ++k) sum += red[k * RW + r_g][i][n][l][j];
#else
  // one K group: each warp holds its rows' whole sums (of this CTA's columns) and writes them as they are
#pragma unroll
  for (int o = 0; o < MT * NT * 4; ++o) {
    int j = o & 3, n = (o >> 2) % NT, i = (o >> 2) / NT, l = lane, r_g = rg;
    float sum = acc[i][n][j];
#endif
    int row = blockIdx.x * ROWS_PER_CTA + r_g * MT * 16 + 16 * i + (l >> 2) + 8 * (j >> 1);
    int token = 8 * n + 2 * (l & 3) + (j & 1);
    if (token >= T) continue;
    if (split) {
      sp_st_float(partial + ((long long)blockIdx.y * T + token) * R + row, sum);
    } else {
      sp_store_output(y, bias, R, token, row, sum);
    }
  }
  if (!split) return;

  // split-K: the last CTA of this row block adds every split's partial, in split order
  sp_threadfence();
  __syncthreads();
  if (tid == 0) {
    int done = sp_atomic_add(counters + blockIdx.x, 1);
    last_flag = done == (int)gridDim.y - 1;
  }
  __syncthreads();
  if (!last_flag) return;
  sp_threadfence();
  // an item is 4 consecutive rows of one token, read as 16 bytes from L2 (past L1, which never held another CTA's
  // partials); a thread's items' loads for 4 splits at a time are all in flight before any is added (a chain of
  // one load and one add per split would wait out the L2 latency once per split and output), added in split order
  const int row_quads = ROWS_PER_CTA / 4, items = row_quads * T, splits = (int)gridDim.y;
  for (int o0 = tid; o0 < items; o0 += SP_RED_ITEMS * 32 * WARPS) {
    float sum[SP_RED_ITEMS][4];
#pragma unroll
    for (int u = 0; u < SP_RED_ITEMS; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j) sum[u][j] = 0.f;
    for (int k0 = 0; k0 < splits; k0 += 4) {
      u32x4 v[4][SP_RED_ITEMS];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int u = 0; u < SP_RED_ITEMS; ++u) {
          int o = o0 + u * 32 * WARPS;
          v[kk][u] = u32x4{0u, 0u, 0u, 0u};
          if (k0 + kk < splits && o < items)
            v[kk][u] = sp_ld_cg128(partial + ((long long)(k0 + kk) * T + o / row_quads) * R + blockIdx.x * ROWS_PER_CTA +
                                   4 * (o % row_quads));
        }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int u = 0; u < SP_RED_ITEMS; ++u)
          if (k0 + kk < splits) {
            sum[u][0] += sp_bits_float(v[kk][u].x);
            sum[u][1] += sp_bits_float(v[kk][u].y);
            sum[u][2] += sp_bits_float(v[kk][u].z);
            sum[u][3] += sp_bits_float(v[kk][u].w);
          }
    }
#pragma unroll
    for (int u = 0; u < SP_RED_ITEMS; ++u) {
      int o = o0 + u * 32 * WARPS;
      if (o < items) {
        int token = o / row_quads, row = blockIdx.x * ROWS_PER_CTA + 4 * (o % row_quads);
#pragma unroll
        for (int j = 0; j < 4; ++j) sp_store_output(y, bias, R, token, row + j, sum[u][j]);
      }
    }
  }
  if (tid == 0) sp_st_int(counters + blockIdx.x, 0);   // ready for the next call (and the next graph replay)
}
