// y = x @ W^T + bias in bfloat16 with AVX512-BF16 (vdpbf16ps): the CPU's bf16 projections, built for the
// few rows of a decode step (where the weights stream from memory) and blocked for a prefill's many rows.
// Built and loaded by engine/cpu_kernels/build.py; called through engine/cpu_kernels/gemm.py.
//
// W is packed once at load as [ceil(N/16)][K/2][16][2] bf16: a block of 16 output columns, one 64-byte
// line per pair of k, so each block is one sequential stream. Each thread takes a contiguous run of blocks
// and prefetches its streams far enough ahead that reading the weights overlaps the arithmetic: that
// overlap is what oneDNN's small-row kernels lack on cold weights
// (bench/README.md, "The bf16 GEMM kernel against oneDNN on cold weights").
// Accumulation is float32 in k order, rounded once to bf16 (round to nearest even), as torch rounds.
//
// Weight-only int8 (--quantization int8) uses the same layout with int8 elements (half the bytes to stream)
// and a float32 scale per output: each pair is widened to bf16 in registers (exact: |q| <= 127 needs 7 bits)
// and the sums are scaled before the bias and the one rounding.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <vector>

#include "scratch.h"
#include "simd.h"

namespace {

using spindle::grow;
using spindle::load_bf16_n;
using spindle::narrow;
using spindle::widen;

// Each stream is prefetched twice: into L2 far ahead (the hardware's own prefetch falls behind several streams,
// and a 16-row tile whose dot products take as long as a line's read), and into L1 near (only L2's latency left)
constexpr int kFarLines = 512;  // 32 KiB
constexpr int kNearLines = 32;  // 2 KiB
// bf16 products of up to this many rows prefetch nothing (but a gated MLP's, whose thread reads two streams in
// turn): a line's arithmetic is short, the hardware's prefetch keeps up with one stream, extra requests measured
// slower. (int8's lines carry twice the arithmetic, widening included: they keep both prefetches.)
constexpr int kBareRows = 2;
// Blocks side by side in a tile of up to 8 rows: enough independent sums for the dot products' latency, and few
// streams (eight measured slower); bf16 up to 4 rows reads faster one block at a time, one stream per thread,
// where int8's widening wants the two sums (bench/README.md, "GEMM tiles and prefetch by row count")
constexpr int kWide = 2;
constexpr int kWideRows = 5;

// Sums over pairs [kp0, kp1) of x's rows (xt: pairs of row m at xt[kp * ldxt + m]) times NB blocks of w.
// part (a [MR][NB][16] float32 scratch) carries the sums across chunks of k: read unless first, written
// unless last; the last chunk adds the bias and stores the rounded result.
// One pair of k of one block, as 32 bf16: loaded, or (int8) widened.
template <bool Q8>
inline __m512bh pair_of(const uint8_t* p) {
    if constexpr (Q8) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
        return _mm512_cvtne2ps_pbh(hi, lo);  // lo's 16 values first
    } else {
        return (__m512bh)_mm512_loadu_si512(p);
    }
}

// Where a tile's results go: y (bf16) or yf (float32), both at the tile's first row and column. With `gate`
// (bf16 at the same rows and columns of the gate's product) each result u becomes bf16(bf16(silu(gate)) * u),
// as spindle_silu_mul rounds it. `stream`: yf's full, aligned lines bypass the caches (a large output, as an LM
// head's logits, would only be pushed out by the weights streaming after it; the caller fences).
struct Dest {
    uint16_t* y;
    long ldy;
    float* yf;
    long ldyf;
    const uint16_t* gate;
    long ldg;
    bool stream;
};

// 16 rows by one bf16 block, pairs [kp0, kp1): each row's pair broadcast from memory inside the dot product
inline void sum16(const uint32_t* __restrict xt, long ldxt, const uint8_t* __restrict w, long bstride, int kp0,
                  int kp1, __m512 (&acc)[16][1]) {
    __m512 a0 = acc[0][0], a1 = acc[1][0], a2 = acc[2][0], a3 = acc[3][0], a4 = acc[4][0], a5 = acc[5][0],
           a6 = acc[6][0], a7 = acc[7][0], a8 = acc[8][0], a9 = acc[9][0], a10 = acc[10][0], a11 = acc[11][0],
           a12 = acc[12][0], a13 = acc[13][0], a14 = acc[14][0], a15 = acc[15][0];
    const uint8_t* far_w = w;
    long far_at = (long)kp0 * 64 + kFarLines * 64L;
    for (; far_at >= bstride; far_at -= bstride) far_w += bstride;
    const uint8_t* p = w + (long)kp0 * 64;
    const uint32_t* xk = xt + (long)kp0 * ldxt;
    for (int kp = kp0; kp < kp1; ++kp, p += 64, xk += ldxt) {
        const __m512i wv = _mm512_loadu_si512(p);
        _mm_prefetch((const char*)(p + kNearLines * 64L), _MM_HINT_T0);
        _mm_prefetch((const char*)(far_w + far_at), _MM_HINT_T1);
        far_at += 64;
        if (far_at >= bstride) far_at -= bstride, far_w += bstride;
        const auto& row = *(const uint32_t(*)[16])xk;  // (tells the compiler what the asm reads)
#define DP(M) asm("vdpbf16ps " #M "*4(%[x])%{1to16%}, %[w], %[a]" \
                  : [a] "+v"(a##M) : [w] "v"(wv), [x] "r"(xk), "m"(row));
        DP(0) DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7) DP(8) DP(9) DP(10) DP(11) DP(12) DP(13) DP(14) DP(15)
#undef DP
    }
    acc[0][0] = a0, acc[1][0] = a1, acc[2][0] = a2, acc[3][0] = a3, acc[4][0] = a4, acc[5][0] = a5;
    acc[6][0] = a6, acc[7][0] = a7, acc[8][0] = a8, acc[9][0] = a9, acc[10][0] = a10, acc[11][0] = a11;
    acc[12][0] = a12, acc[13][0] = a13, acc[14][0] = a14, acc[15][0] = a15;
}

template <int MR, int NB, bool Q8>
void tile(const uint32_t* __restrict xt, long ldxt, const uint8_t* __restrict w, long bstride, int kp0, int kp1,
          float* __restrict part, bool first, bool last, bool prefetch, const float* __restrict scale,
          const uint16_t* __restrict bias, int n0, int n_total, const Dest& out) {
    constexpr long ahead = kNearLines * 64L, pair_bytes = Q8 ? 32 : 64;
    // the far prefetch's place: far_at bytes into block j of the group of NB blocks at far_w (a block can be
    // shorter than the distance, so the group is walked, not computed)
    const uint8_t* far_w = w;
    long far_at = (long)kp0 * pair_bytes + kFarLines * 64L;
    for (; far_at >= bstride; far_at -= bstride) far_w += NB * bstride;
    __m512 acc[MR][NB];
    for (int m = 0; m < MR; ++m)
        for (int j = 0; j < NB; ++j) acc[m][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + (m * NB + j) * 16);
    if constexpr (MR == 16 && NB == 1 && !Q8) sum16(xt, ldxt, w, bstride, kp0, kp1, acc);
    else
    for (int kp = kp0; kp < kp1; ++kp) {
        __m512bh wv[NB];
        for (int j = 0; j < NB; ++j) {
            const uint8_t* p = w + j * bstride + (long)kp * pair_bytes;
            wv[j] = pair_of<Q8>(p);
            if (prefetch && (!Q8 || (kp & 1) == 0)) {  // int8: two pairs to a line
                // past this block's end, the same block of the next NB, which the thread reads next (not the
                // next block, which this tile is reading already)
                const long at = (long)kp * pair_bytes + ahead;
                _mm_prefetch((const char*)(w + j * bstride + (at < bstride ? at : at + (NB - 1) * bstride)),
                             _MM_HINT_T0);
                _mm_prefetch((const char*)(far_w + j * bstride + far_at), _MM_HINT_T1);
            }
        }
        far_at += pair_bytes;
        if (far_at >= bstride) far_at -= bstride, far_w += NB * bstride;
        const uint32_t* xk = xt + (long)kp * ldxt;
        for (int m = 0; m < MR; ++m) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xk[m]);
            for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
        }
    }
    if (!last) {
        for (int m = 0; m < MR; ++m)
            for (int j = 0; j < NB; ++j) _mm512_storeu_ps(part + (m * NB + j) * 16, acc[m][j]);
        return;
    }
    for (int j = 0; j < NB; ++j) {
        const int n = n0 + j * 16;
        const int cols = n_total - n < 16 ? n_total - n : 16;
        const __mmask16 mask = (__mmask16)((1u << cols) - 1);
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n)), 16));
        const __m512 s = Q8 ? _mm512_maskz_loadu_ps(mask, scale + n) : _mm512_setzero_ps();
        for (int m = 0; m < MR; ++m) {
            const __m512 sum = Q8 ? _mm512_fmadd_ps(acc[m][j], s, b) : _mm512_add_ps(acc[m][j], b);
            __m256i r = narrow(sum);
            if (out.gate) {
                const __m512 g = load_bf16_n(out.gate + m * out.ldg + j * 16, mask);
                r = narrow(_mm512_mul_ps(spindle::silu_bf16(g), widen(r)));
            }
            float* f = out.yf ? out.yf + m * out.ldyf + j * 16 : nullptr;  // float32 out: the bf16 product widened
            if (!f) _mm256_mask_storeu_epi16(out.y + m * out.ldy + j * 16, mask, r);
            else if (out.stream && mask == 0xffff && (uintptr_t)f % 64 == 0) _mm512_stream_ps(f, widen(r));
            else _mm512_mask_storeu_ps(f, mask, widen(r));
        }
    }
}

constexpr int kTileRows = 16;
constexpr long kPanelBytes = 256 << 10;  // weights one thread keeps in its L2 while every row tile passes
constexpr size_t kKeepBytes = 64 << 20;  // scratch above this is given back after the call (a long prefill's)
constexpr long kStreamBytes = 64 << 20;  // a product moving this much (weights and float32 out) streams its out
constexpr int kChunkPairs = 768;  // pairs of k per chunk for 8x3 tiles: a weight panel stays in L2 while row tiles pass
constexpr long kPairBytesInL2 = 512 << 10;  // 17-32 rows: two row tiles' pairs of x and a block of weights
constexpr int kGroupTiles = 32;  // row tiles per group: a group's rows of x stay in L3 while every panel passes

struct Call {
    const uint32_t* xt;  // x as [ceil(M/16)][K/2][ldxt] pairs: one row tile's pairs side by side, contiguous
    int ldxt;  // min(M, 16)
    int m;
    const uint8_t* w;
    long bstride;  // bytes per block
    int kp_count;
    const float* scale;  // int8 weights' scales, else null
    const uint16_t* bias;
    int n_total;
    uint16_t* y;
    long ldy;
    float* yf;
    long ldyf;
    bool stream;  // yf's lines bypass the caches (Dest::stream)
    bool bare;  // the tiles prefetch nothing (kBareRows)
};

inline int wide_for(const Call& c) { return c.scale || c.m >= kWideRows ? kWide : 1; }

// Which pairs of k a tile sums this time, and where its sums wait between chunks.
struct Chunk {
    int kp0, kp1;
    float* part;
};

// `to`: where this tile's results go (null: c's y or yf at the tile's rows and columns)
template <int MR, int NB, bool Q8>
void run(const Call& c, int m0, int blk, const Chunk& k, const Dest* to) {
    const uint32_t* xt = c.xt + (long)(m0 / kTileRows) * c.kp_count * c.ldxt + m0 % kTileRows;
    const long n0 = blk * 16L;
    const Dest out = to ? *to : Dest{c.y ? c.y + m0 * c.ldy + n0 : nullptr, c.ldy,
                                     c.yf ? c.yf + m0 * c.ldyf + n0 : nullptr, c.ldyf, nullptr, 0, c.stream};
    tile<MR, NB, Q8>(xt, c.ldxt, c.w + blk * c.bstride, c.bstride, k.kp0, k.kp1, k.part, k.kp0 == 0,
                     k.kp1 == c.kp_count, !c.bare, c.scale, c.bias, (int)n0, c.n_total, out);
}

// rows m0..m0+mr (mr <= 8) over NB blocks from blk; callers keep mr * NB <= 24 accumulators (the clamp
// only keeps combinations that are never called from being instantiated too wide)
template <int NB, bool Q8>
void few_rows(const Call& c, int m0, int mr, int blk, const Chunk& k, const Dest* to = nullptr) {
#define ROWS(R) case R: run<R, (R * NB <= 24 ? NB : 1), Q8>(c, m0, blk, k, to); break;
    switch (mr) { ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) }
#undef ROWS
}

// all rows (up to 8) over nb blocks from blk, nb kWide or 1 (wide_for(c) where the thread's blocks allow)
template <bool Q8>
void wide_rows(const Call& c, int nb, int blk, const Chunk& k, const Dest* to = nullptr) {
    if (nb == kWide) few_rows<kWide, Q8>(c, 0, c.m, blk, k, to);
    else few_rows<1, Q8>(c, 0, c.m, blk, k, to);
}

// rows m0..m0+16 (or fewer, at the end) of one block: one tile of all of them (a weight line feeds each row)
template <bool Q8>
void row_tile(const Call& c, int m0, int blk, const Chunk& k, const Dest* to = nullptr) {
    const int mr = c.m - m0 < kTileRows ? c.m - m0 : kTileRows;
#define ROWS(R) case R: run<R, 1, Q8>(c, m0, blk, k, to); return;
    switch (mr) { ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16) }
#undef ROWS
    few_rows<1, Q8>(c, m0, mr, blk, k, to);
}

// rows m0..m0+8 (or fewer) over nb (1 to 3) blocks from blk
template <bool Q8>
void rows_by_3(const Call& c, int m0, int mr, int blk, int nb, const Chunk& k) {
    if (nb == 3) few_rows<3, Q8>(c, m0, mr, blk, k);
    else if (nb == 2) few_rows<2, Q8>(c, m0, mr, blk, k);
    else few_rows<1, Q8>(c, m0, mr, blk, k);
}

// Whether 17-32 rows go as two 16-row tiles block by block: both tiles' pairs of x and a block fit in L2
inline bool two_tiles(const Call& c) {
    return c.m > kTileRows && c.m <= 2 * kTileRows && 3L * c.kp_count * 64 <= kPairBytesInL2;
}

// One thread's blocks [b, b1), in three shapes of tile:
// - up to 8 rows: wide_for(c) blocks at once over all of k (the weights stream once);
// - 9 to 16 rows: 16 rows by one block over all of k (a weight line feeds 16 products); 17 to 32 rows the
//   same, block by block, each block's second row tile reading it from L2 (where its pairs fit);
// - more: 8 rows by 3 blocks (24 sums: fewer loads per product), row tiles in groups.
// Past 32 rows: row tiles in groups whose rows of x stay in L3 while the thread's blocks pass in panels that stay
// in L2, k in chunks short enough that a row tile's pairs stay near L1; a tile's sums wait between chunks in
// `parts` (L2 too). A prefill's products run about as fast as oneDNN's that way
// (bench/README.md, "Prefill products").
template <bool Q8>
void blocks(const Call& c, int b, int b1) {
    const Chunk all{0, c.kp_count, nullptr};
    if (c.m <= 8) {
        for (int nb; b < b1; b += nb) {
            nb = b + wide_for(c) <= b1 ? wide_for(c) : 1;
            wide_rows<Q8>(c, nb, b, all);
        }
        return;
    }
    if (two_tiles(c)) {
        for (int blk = b; blk < b1; ++blk)  // both row tiles' pairs and the block stay in L2 for the second pass
            for (int m0 = 0; m0 < c.m; m0 += kTileRows) row_tile<Q8>(c, m0, blk, all);
        return;
    }
    const bool sixteen = c.m <= kTileRows;
    const int rows = sixteen ? kTileRows : 8, across = sixteen ? 1 : 3;
    // one row tile reuses no weights: all of k at once keeps the thread's blocks one sequential stream
    const int kc = sixteen || c.kp_count < kChunkPairs ? c.kp_count : kChunkPairs;
    const int fit = (int)(kPanelBytes / (kc * 64L)) / across * across;
    const int panel = fit > across ? fit : across;
    const int tiles = (c.m + rows - 1) / rows;
    const int group = tiles < kGroupTiles ? tiles : kGroupTiles;
    static thread_local std::vector<float> parts;
    if (kc < c.kp_count) grow(parts, (size_t)group * panel * rows * 16);
    for (int g0 = 0; g0 < tiles; g0 += group) {  // a group's rows of x stay in L3 while all panels pass
        for (int p = b; p < b1; p += panel) {
            const int pe = p + panel < b1 ? p + panel : b1;
            for (int k0 = 0; k0 < c.kp_count; k0 += kc) {
                const int k1 = k0 + kc < c.kp_count ? k0 + kc : c.kp_count;
                for (int t = g0; t < g0 + group && t < tiles; ++t) {
                    const int m0 = t * rows, mr = c.m - m0 < rows ? c.m - m0 : rows;
                    for (int blk = p; blk < pe; blk += across) {
                        const int nb = pe - blk < across ? pe - blk : across;
                        float* part = kc < c.kp_count
                            ? parts.data() + ((size_t)(t - g0) * panel + (blk - p)) * rows * 16 : nullptr;
                        if (sixteen) row_tile<Q8>(c, m0, blk, Chunk{k0, k1, part});
                        else rows_by_3<Q8>(c, m0, mr, blk, nb, Chunk{k0, k1, part});
                    }
                }
            }
        }
    }
    if (parts.capacity() * sizeof(float) > kKeepBytes) std::vector<float>().swap(parts);
}

// act = silu(x @ Wg^T) * (x @ Wu^T) over gate blocks [b, b1), for up to 32 rows (gated(c) says): W holds the
// gate's `half` blocks, then the up's. Each gate tile's bf16 results wait in `gate` (L1) for the up tile of the
// same rows and columns, whose epilogue writes act; the two products round as they do apart.
inline bool gated(const Call& c) { return c.m <= kTileRows || two_tiles(c); }

template <bool Q8>
void gated_blocks(const Call& c, int b, int b1, int half, uint16_t* act, long ldact) {
    const Chunk all{0, c.kp_count, nullptr};
    uint16_t gate[2 * kTileRows * 16];  // 32 rows of one block, or up to 8 rows of kWide blocks
    if (c.m <= 8) {
        for (int nb; b < b1; b += nb) {
            nb = b + wide_for(c) <= b1 ? wide_for(c) : 1;
            const Dest g{gate, nb * 16L, nullptr, 0, nullptr, 0}, u{act + b * 16L, ldact, nullptr, 0, gate, nb * 16L};
            wide_rows<Q8>(c, nb, b, all, &g);
            wide_rows<Q8>(c, nb, b + half, all, &u);
        }
        return;
    }
    for (int blk = b; blk < b1; ++blk) {  // (17-32 rows: each block's second row tile reads it from L2)
        for (int m0 = 0; m0 < c.m; m0 += kTileRows) {
            const Dest g{gate + m0 * 16, 16, nullptr, 0, nullptr, 0};
            row_tile<Q8>(c, m0, blk, all, &g);
        }
        for (int m0 = 0; m0 < c.m; m0 += kTileRows) {
            const Dest u{act + m0 * ldact + blk * 16L, ldact, nullptr, 0, gate + m0 * 16, 16};
            row_tile<Q8>(c, m0, blk + half, all, &u);
        }
    }
}

// dst[p * 16 + m] = src[m * ld + p] for m, p < 16: a 16 x 16 transpose of 32-bit elements (pairs of bf16)
inline void transpose16(const uint32_t* src, long ld, uint32_t* dst) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * ld);
    spindle::transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * 16, r[i]);
}

// A row tile's pairs [kp0, kp1) side by side: dst[kp * ldd + m] = src[m * ld + kp] for m < rows (a full tile 16
// pairs at a time in registers: a decode step's x is re-laid for every product)
inline void to_pairs(const uint32_t* src, long ld, int rows, int kp0, int kp1, uint32_t* dst, int ldd) {
    int kp = kp0;
    if (rows == 16 && ldd == 16)
        for (; kp + 16 <= kp1; kp += 16) transpose16(src + kp, ld, dst + (long)kp * 16);
    for (; kp < kp1; ++kp)
        for (int m = 0; m < rows; ++m) dst[(long)kp * ldd + m] = src[m * ld + kp];
}

}  // namespace

extern "C" int spindle_gemm_bf16_abi() { return 4; }

namespace {

// Both entries: x re-laid as pairs (Call::xt), then each thread's run of blocks. act (gated: the up blocks
// follow the gate's `half`) takes silu(gate) * up; else the product goes to c's y or yf.
void product(const Call& c, const uint16_t* x, long ldx, int threads, int half, uint16_t* act, long ldact) {
    const int M = c.m, kp_count = c.kp_count, tiles = (M + kTileRows - 1) / kTileRows, ldxt = c.ldxt;
    uint32_t* xt = (uint32_t*)c.xt;
    const uint32_t* x32 = (const uint32_t*)x;
    const int n_blocks = act ? half : (c.n_total + 15) / 16;
#pragma omp parallel num_threads(threads)
    {
        const long ld = ldx / 2;
        if (tiles >= omp_get_num_threads()) {  // by row tile: each thread reads its 16 rows as 16 streams
#pragma omp for schedule(static)
            for (int tile = 0; tile < tiles; ++tile) {
                const int m0 = tile * kTileRows, rows = M - m0 < kTileRows ? M - m0 : kTileRows;
                to_pairs(x32 + m0 * ld, ld, rows, 0, kp_count, xt + (long)tile * kp_count * ldxt, ldxt);
            }
        } else {  // by 16 pairs of k: no two threads write one 64-byte line of a full tile (fewer rows may share one)
            const int groups = (kp_count + 15) / 16;
#pragma omp for schedule(static)
            for (int g = 0; g < groups; ++g)
                for (int tile = 0; tile < tiles; ++tile) {
                    const int m0 = tile * kTileRows, rows = M - m0 < kTileRows ? M - m0 : kTileRows;
                    to_pairs(x32 + m0 * ld, ld, rows, g * 16, g * 16 + 16 < kp_count ? g * 16 + 16 : kp_count,
                             xt + (long)tile * kp_count * ldxt, ldxt);
                }
        }
        // (each loop's implied barrier: every row is in place before any tile reads it)
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int b0 = (int)((long)n_blocks * t / T), b1 = (int)((long)n_blocks * (t + 1) / T);
        if (act && c.scale) gated_blocks<true>(c, b0, b1, half, act, ldact);
        else if (act) gated_blocks<false>(c, b0, b1, half, act, ldact);
        else if (c.scale) blocks<true>(c, b0, b1);
        else blocks<false>(c, b0, b1);
        if (c.stream) _mm_sfence();  // the streamed lines are in memory before the team's barrier
    }
}

std::vector<uint32_t>& xt_for(int M, int K) {  // this thread's scratch for x as pairs
    static thread_local std::vector<uint32_t> xt;
    const int tiles = (M + kTileRows - 1) / kTileRows;
    grow(xt, (size_t)tiles * (K / 2) * (M < kTileRows ? M : kTileRows));
    return xt;
}

void give_back(std::vector<uint32_t>& xt) {  // a long prefill's scratch is not kept
    if (xt.capacity() * sizeof(uint32_t) > kKeepBytes) std::vector<uint32_t>().swap(xt);
}

}  // namespace

// x [M, K] bf16 with row stride ldx (elements, even); w packed as above, bf16, or int8 when `scale` (float32 [N])
// is given; bias [N] bf16 or null; y [M, N] bf16 (row stride ldy) or, when yf is given, yf [M, N] float32 (row
// stride ldyf). K must be even.
extern "C" void spindle_gemm_bf16(const uint16_t* x, long ldx, int M, int K, const void* w, const float* scale,
                                  int N, const uint16_t* bias, uint16_t* y, long ldy, float* yf, long ldyf,
                                  int threads) {
    std::vector<uint32_t>& xt = xt_for(M, K);
    const long moved = (long)N * K * (scale ? 1 : 2) + (long)M * N * 4;  // past a large L3: out would not stay
    const bool stream = yf && moved >= kStreamBytes && (uintptr_t)yf % 64 == 0 && ldyf % 16 == 0;
    const Call c{xt.data(), M < kTileRows ? M : kTileRows, M, (const uint8_t*)w, (long)(K / 2) * (scale ? 32 : 64),
                 K / 2, scale, bias, N, y, ldy, yf, ldyf, stream, !scale && M <= kBareRows};
    product(c, x, ldx, threads, 0, nullptr, 0);
    give_back(xt);
}

// A gated MLP's first half in one call: act [M, N/2] (row stride ldact) = bf16(bf16(silu(g)) * u) where [g | u] =
// x @ W^T + bias, each rounded to bf16, exactly as spindle_gemm_bf16 then spindle_silu_mul give it. Arguments as
// spindle_gemm_bf16's. Returns 0 with nothing written where it does not apply (more than 32 rows, or 17-32 whose
// pairs do not fit in L2, or N/2 not a multiple of 16): the caller then makes the two calls.
extern "C" int spindle_gemm_bf16_silu(const uint16_t* x, long ldx, int M, int K, const void* w, const float* scale,
                                      int N, const uint16_t* bias, uint16_t* act, long ldact, int threads) {
    const Call probe{nullptr, M < kTileRows ? M : kTileRows, M, nullptr, 0, K / 2, scale, bias, N, nullptr, 0,
                     nullptr, 0};
    if (N % 32 || !gated(probe)) return 0;
    std::vector<uint32_t>& xt = xt_for(M, K);
    Call c = probe;
    c.xt = xt.data();
    c.w = (const uint8_t*)w;
    c.bstride = (long)(K / 2) * (scale ? 32 : 64);
    product(c, x, ldx, threads, N / 32, act, ldact);
    give_back(xt);
    return 1;
}
