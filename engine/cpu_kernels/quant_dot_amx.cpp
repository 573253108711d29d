// quant_dot.cpp's product through AMX tiles (TDPBF16PS), for batches of rows: the same packed blocks, each chunk
// of 32 weights x 16 columns (4 groups) decoded once in registers to exact bf16 (1 + q / 2^BITS; Q8_0: q),
// transposed into one B tile (VNNI pairs) and multiplied by up to 4 tiles of 16 rows (a C tile per sub-block,
// stored and scaled by the sub-block's D and M per column into float32 sums kept in L1). A bf16 dot product in
// AVX-512 does 32 products per two cycles here; a tile product does 8,192 in about 16, so from a few rows the
// decode, not the products, is the cost, and it is shared by every row of the batch.
// Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); a thread it refuses computes
// its columns through quant_dot.cpp's AVX-512 path instead.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <type_traits>

#include "quant_dot_formats.h"

namespace {

using namespace spindle::qdot;

constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
constexpr int kCols = 16, kGroups = kCols / GROUP;  // columns of a B tile, groups of the packed form per tile
constexpr int kTileRows = 16, kRowTiles = 4, kMaxRows = kTileRows * kRowTiles;  // rows per call of `block`

bool tiles_permitted() {
    static thread_local int ok = -1;
    if (ok < 0) ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? 1 : 0;
    return ok == 1;
}

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// tmm0-3: C of row tiles 0-3 (16 float32 columns); tmm4: A of a full row tile, tmm6: of the last one where it
// has fewer rows (rows of SUB bf16); tmm5: B (SUB / 2 rows of pairs)
template <int SUB>
__attribute__((target("amx-tile,amx-bf16"))) void configure(int m) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < kRowTiles; ++t) {
        const int r = m - kTileRows * t;
        c.rows[t] = (uint8_t)(r > kTileRows ? kTileRows : r > 0 ? r : 1);
        c.colsb[t] = 64;
    }
    c.rows[4] = kTileRows;
    c.rows[6] = (uint8_t)(m % kTileRows ? m % kTileRows : kTileRows);
    c.colsb[4] = c.colsb[6] = 2 * SUB;
    c.rows[5] = SUB / 2;
    c.colsb[5] = 64;
    _tile_loadconfig(&c);
}

// C tile t (an immediate: one case per tile) = A (tmm4, or tmm6 for a short tile) times B, stored at c
__attribute__((target("amx-tile,amx-bf16"))) inline void product(int t, bool full, const uint16_t* a, long lda,
                                                                  float* c) {
#define SPINDLE_TILE(T, A)            \
    _tile_loadd(A, a, lda);           \
    _tile_zero(T);                    \
    _tile_dpbf16ps(T, A, 5);          \
    _tile_stored(T, c, 64)
    if (full) {
        switch (t) {
            case 0: SPINDLE_TILE(0, 4); break;
            case 1: SPINDLE_TILE(1, 4); break;
            case 2: SPINDLE_TILE(2, 4); break;
            default: SPINDLE_TILE(3, 4); break;
        }
    } else {
        switch (t) {
            case 0: SPINDLE_TILE(0, 6); break;
            case 1: SPINDLE_TILE(1, 6); break;
            case 2: SPINDLE_TILE(2, 6); break;
            default: SPINDLE_TILE(3, 6); break;
        }
    }
#undef SPINDLE_TILE
}

// the 16 B tile rows (pairs of inputs 2kk, 2kk + 1 of the 16 columns) of chunk j of record rc of 4 groups
template <class F>
inline void b_tile(const uint8_t* const* rec, int j, uint16_t* b) {
    using L = Layout<F>;
    // a slot's dword 4c + jj holds pair jj of column c. Two groups' pairs jj and jj + 1 side by side (columns in
    // order), then two such halves per B row.
    const __m512i lo = _mm512_set_epi32(29, 25, 21, 17, 13, 9, 5, 1, 28, 24, 20, 16, 12, 8, 4, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(2));
    auto row4 = [&](auto S) {
        constexpr int s = decltype(S)::value;
        __m512i v[kGroups];
        for (int gi = 0; gi < kGroups; ++gi)
            v[gi] = rec[gi] ? slot<F::BITS, s>(rec[gi] + j * L::CHUNK) : _mm512_setzero_si512();
        const __m512i a01 = _mm512_permutex2var_epi32(v[0], lo, v[1]), a23 = _mm512_permutex2var_epi32(v[0], hi, v[1]);
        const __m512i b01 = _mm512_permutex2var_epi32(v[2], lo, v[3]), b23 = _mm512_permutex2var_epi32(v[2], hi, v[3]);
        _mm512_store_si512(b + 32 * (4 * s + 0), _mm512_shuffle_i32x4(a01, b01, 0x44));
        _mm512_store_si512(b + 32 * (4 * s + 1), _mm512_shuffle_i32x4(a01, b01, 0xEE));
        _mm512_store_si512(b + 32 * (4 * s + 2), _mm512_shuffle_i32x4(a23, b23, 0x44));
        _mm512_store_si512(b + 32 * (4 * s + 3), _mm512_shuffle_i32x4(a23, b23, 0xEE));
    };
    row4(std::integral_constant<int, 0>{});
    row4(std::integral_constant<int, 1>{});
    row4(std::integral_constant<int, 2>{});
    row4(std::integral_constant<int, 3>{});
}

// the multipliers of A and of the full sub-block sum of x for record rc, per sub-block, one column a lane
template <class F>
inline void scales16(const uint8_t* const* rec, __m512* dp, __m512* mp) {
    using L = Layout<F>;
    if constexpr (F::SB == QK) {  // one sub-block: 4 float16 d (and m) per group, gathered into column order
        auto half = [&](int at) {
            alignas(32) long long q[4] = {0, 0, 0, 0};  // an array, not _mm256_insert_epi64: gi is no immediate at -O0
            static_assert(kGroups <= 4, "four float16 groups fill the 256-bit vector");
            for (int gi = 0; gi < kGroups; ++gi)
                if (rec[gi]) memcpy(&q[gi], rec[gi] + L::CHUNKS * L::CHUNK + at, 8);
            return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(q)));
        };
        constexpr float unit = F::BITS == 8 ? 1.0f : (float)(1 << F::BITS);
        const __m512 d = half(0), add = F::HAS_M ? half(8) : _mm512_setzero_ps();
        dp[0] = _mm512_mul_ps(d, _mm512_set1_ps(unit));  // as product_scales computes them
        const __m512 m = _mm512_fnmadd_ps(d, _mm512_set1_ps((float)F::OFF + (F::BITS == 8 ? 0.0f : unit)), add);
        mp[0] = _mm512_mul_ps(m, _mm512_set1_ps(4.0f));
        return;
    }
    alignas(64) float d[L::NS][kCols], m[L::NS][kCols];
    for (int gi = 0; gi < kGroups; ++gi) {
        __m512 gd[L::NS], gm[L::NS];
        if (rec[gi]) {
            product_scales<F>(rec[gi], gd, gm);
        } else {
            for (int e = 0; e < L::NS; ++e) gd[e] = gm[e] = _mm512_setzero_ps();
        }
        const __m512i firsts = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
        for (int e = 0; e < L::NS; ++e) {  // lanes 4c..4c+3 hold column c: lane 4c of each
            _mm_store_ps(d[e] + GROUP * gi, _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, gd[e])));
            _mm_store_ps(m[e] + GROUP * gi, _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, gm[e])));
        }
    }
    for (int e = 0; e < L::NS; ++e) {
        dp[e] = _mm512_load_ps(d[e]);
        mp[e] = _mm512_mul_ps(_mm512_load_ps(m[e]), _mm512_set1_ps(4.0f));  // sx holds a quarter of each sum
    }
}

// 16 columns (groups g0..g0 + 3, those < groups) times m <= 64 rows of x -> acc[m][16], tiles configured for m
template <class F>
__attribute__((target("amx-tile,amx-bf16"))) void block(const uint8_t* packed, int nrec, int groups, int g0,
                                                         const uint16_t* x, long ldx, const float* sx, int nsx, int m,
                                                         float (*acc)[kCols]) {
    using L = Layout<F>;
    alignas(64) uint16_t b[kCols * 32];
    alignas(64) float c[kRowTiles][kTileRows][kCols];
    const int tiles = (m + kTileRows - 1) / kTileRows;
    for (int r = 0; r < m; ++r) _mm512_store_ps(acc[r], _mm512_setzero_ps());
    for (int rc = 0; rc < nrec; ++rc) {
        const uint8_t* rec[kGroups];
        for (int gi = 0; gi < kGroups; ++gi)
            rec[gi] = g0 + gi < groups ? packed + ((long)(g0 + gi) * nrec + rc) * L::REC : nullptr;
        __m512 dp[L::NS], mp[L::NS];
        scales16<F>(rec, dp, mp);
        for (int j = 0; j < L::CHUNKS; ++j) {
            b_tile<F>(rec, j, b);
            for (int h = 0; h < QK / F::SUB; ++h) {  // sub-blocks of the chunk
                const int e = j * (QK / F::SUB) + h;
                const long k = ((long)rc * L::CHUNKS + j) * QK + h * F::SUB;
                _tile_loadd(5, b + 32 * (F::SUB / 2) * h, 64);
                for (int t = 0; t < tiles; ++t)
                    product(t, m - kTileRows * t >= kTileRows, x + (long)kTileRows * t * ldx + k, ldx * 2, c[t][0]);
                for (int r = 0; r < m; ++r) {
                    __m512 a = _mm512_fmadd_ps(dp[e], _mm512_load_ps(c[r / kTileRows][r % kTileRows]), _mm512_load_ps(acc[r]));
                    if (Layout<F>::SX) a = _mm512_fmadd_ps(mp[e], _mm512_set1_ps(sx[(long)r * nsx + k / F::SUB]), a);
                    _mm512_store_ps(acc[r], a);
                }
            }
        }
    }
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch rounds (NaN stays NaN)
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// every 16-column block of the thread's share, row chunks of up to 64; false where this thread may not use tiles
template <class F>
__attribute__((target("amx-tile,amx-bf16"))) bool gemm_tiles(const uint8_t* p, const uint16_t* x, long ldx, int M,
                                                              int K, const float* sx, int N, float* yf, uint16_t* yb,
                                                              long ldy, int b0, int b1) {
    if (!tiles_permitted()) return false;
    const int groups = (N + GROUP - 1) / GROUP, nrec = K / F::SB, nsx = K / F::SUB;
    alignas(64) float acc[kMaxRows][kCols];
    for (int m0 = 0; m0 < M; m0 += kMaxRows) {
        const int m = M - m0 < kMaxRows ? M - m0 : kMaxRows;
        configure<F::SUB>(m);
        for (int bk = b0; bk < b1; ++bk) {
            block<F>(p, nrec, groups, bk * kGroups, x + (long)m0 * ldx, ldx, sx + (long)m0 * nsx, nsx, m, acc);
            const int n0 = bk * kCols, cols = N - n0 < kCols ? N - n0 : kCols;
            for (int r = 0; r < m; ++r)
                for (int cc = 0; cc < cols; ++cc) {
                    const long at = (long)(m0 + r) * ldy + n0 + cc;
                    if (yf) yf[at] = acc[r][cc];
                    else yb[at] = to_bf16(acc[r][cc]);
                }
        }
    }
    _tile_release();
    return true;
}

}  // namespace

// quant_dot.cpp's AVX-512 product of column groups [g0, g1) (a thread refused the tiles computes its share so)
void spindle_quant_dot_groups(int type, const uint8_t* p, const uint16_t* x, long ldx, int M, int K, const float* sx,
                              int N, float* yf, uint16_t* yb, long ldy, int g0, int g1);

// Whether this thread may use tiles (asks Linux once); 0 where the CPU or the kernel has no AMX.
extern "C" int spindle_quant_dot_amx_usable() { return tiles_permitted() ? 1 : 0; }

// spindle_quant_dot_gemm's product through tiles, sx its sums of x. Nonzero for a type not packed here.
int spindle_quant_dot_tiles(int type, const uint8_t* p, const uint16_t* x, long ldx, int M, int K, const float* sx,
                            int N, float* yf, uint16_t* yb, long ldy, int threads) {
    return by_format(type, [&](auto f) {
        using F = decltype(f);
        static_assert(F::SUB == 16 || F::SUB == 32, "a C tile per sub-block of 16 or 32 inputs");
        const int blocks = (N + kCols - 1) / kCols;
#pragma omp parallel num_threads(threads)
        {
            const int nt = omp_get_num_threads(), id = omp_get_thread_num();
            const int b0 = (int)((long)blocks * id / nt), b1 = (int)((long)blocks * (id + 1) / nt);
            if (b0 < b1 && !gemm_tiles<F>(p, x, ldx, M, K, sx, N, yf, yb, ldy, b0, b1)) {
                const int groups = (N + GROUP - 1) / GROUP, g1 = b1 * kGroups < groups ? b1 * kGroups : groups;
                spindle_quant_dot_groups(type, p, x, ldx, M, K, sx, N, yf, yb, ldy, b0 * kGroups, g1);
            }
        }
    });
}
