// y = x @ W^T for bf16 activations and W of GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
// Q6_K) repacked once at load (quant_dot_pack.cpp; the layouts in quant_dot_formats.h) so that AVX512-BF16's dot
// product does 32 products per instruction with the weights decoded in registers by shifts and masks.
//
// Why it is fast: quant_gemm.cpp widens each weight to float32 (about 10 cycles per 32 weights at one row, more
// than a decode step's streaming of the blocks). Here a weight q decodes to the exact bf16 of 1 + q / 2^BITS
// (Q8_0: of q itself); the products with x are exact in float32, and per sub-block sum_j (1 + q_j/2^B) x_j = A
// gives sum_j q_j x_j = 2^B (A - sx), sx the sub-block's sum of x. A weight is D (q - OFF) + M, so the sub-block's
// share of y is 2^B D A + (M - (OFF + 2^B) D) sx: the reference's weights up to float32 rounding, never a
// quantized activation. Up to 16 rows of x share each decoded chunk, while the group's records stay in L1.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "quant_dot_formats.h"
#include "scratch.h"

namespace {

using namespace spindle::qdot;
using spindle::grow;

constexpr int kAheadBytes = 2048;  // fetched ahead of the product: the hardware alone leaves the stream waiting
constexpr int kTilesShift = 8;  // spindle_quant_dot_gemm's type: the ggml type in the low bits, tiles from rows above
constexpr int kMaxRows = 16;       // rows sharing each decoded chunk: 16 sums and the chunk fill the registers

inline __m512bh bcast_x(const uint16_t* x) { return (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)x)); }

template <class F>
const uint8_t* record(const uint8_t* packed, int nrec, int g, int r) {
    return packed + ((long)g * nrec + r) * Layout<F>::REC;
}

// R rows (x bf16, stride ldx; sx a quarter of their sub-block sums, stride nsx) times group g -> out[R][4]
template <class F, int R>
void group_rows(const uint8_t* packed, int nrec, int g, const uint16_t* x, long ldx, const float* sx, int nsx,
                float* out) {
    using L = Layout<F>;
    __m512 t[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) t[r] = _mm512_setzero_ps();
    for (int rc = 0; rc < nrec; ++rc) {
        const uint8_t* rec = record<F>(packed, nrec, g, rc);
        for (int at = 0; at < L::REC; at += 64) _mm_prefetch((const char*)rec + kAheadBytes + at, _MM_HINT_T0);
        __m512 dp[L::NS], mp[L::NS];
        product_scales<F>(rec, dp, mp);
        for (int j = 0; j < L::CHUNKS; ++j) {
            const uint8_t* c = rec + j * L::CHUNK;
            const __m512bh w0 = (__m512bh)slot<F::BITS, 0>(c), w1 = (__m512bh)slot<F::BITS, 1>(c);
            const __m512bh w2 = (__m512bh)slot<F::BITS, 2>(c), w3 = (__m512bh)slot<F::BITS, 3>(c);
            const long k = ((long)rc * L::CHUNKS + j) * QK;
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {  // unrolled: the sums stay in registers
                const uint16_t* xb = x + r * ldx + k;
                const float* s = sx + (long)r * nsx + k / F::SUB;
                if constexpr (F::SUB == 32) {
                    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0, bcast_x(xb));
                    a = _mm512_dpbf16_ps(a, w1, bcast_x(xb + 8));
                    a = _mm512_dpbf16_ps(a, w2, bcast_x(xb + 16));
                    a = _mm512_dpbf16_ps(a, w3, bcast_x(xb + 24));
                    t[r] = _mm512_fmadd_ps(dp[j], a, t[r]);
                    if constexpr (L::SX) t[r] = _mm512_fmadd_ps(mp[j], _mm512_set1_ps(s[0]), t[r]);
                } else {  // two sub-blocks of 16: slots 0-1 and 2-3
                    const __m512 a = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w0, bcast_x(xb)), w1,
                                                      bcast_x(xb + 8));
                    const __m512 b = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w2, bcast_x(xb + 16)), w3,
                                                      bcast_x(xb + 24));
                    t[r] = _mm512_fmadd_ps(dp[2 * j], a, t[r]);
                    t[r] = _mm512_fmadd_ps(dp[2 * j + 1], b, t[r]);
                    t[r] = _mm512_fmadd_ps(mp[2 * j], _mm512_set1_ps(s[0]), t[r]);
                    t[r] = _mm512_fmadd_ps(mp[2 * j + 1], _mm512_set1_ps(s[1]), t[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        __m512 v = _mm512_add_ps(t[r], _mm512_permute_ps(t[r], 0xB1));  // lanes of one column: pairs, then quads
        v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));
        const __m512 firsts = _mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), v);
        _mm_storeu_ps(out + 4 * r, _mm512_castps512_ps128(firsts));
    }
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch rounds (NaN stays NaN)
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// rows [m0, m0 + rows) of x against group g, in one pass when rows <= 8 or 12 or 16, else two
template <class F>
int tile(const uint8_t* p, int nrec, int g, const uint16_t* x, long ldx, const float* sx, int nsx, int rows,
         float* part) {
    switch (rows) {
        case 16: group_rows<F, 16>(p, nrec, g, x, ldx, sx, nsx, part); return 16;
        case 15: case 14: case 13: case 12: group_rows<F, 12>(p, nrec, g, x, ldx, sx, nsx, part); return 12;
        case 11: case 10: case 9: case 8: group_rows<F, 8>(p, nrec, g, x, ldx, sx, nsx, part); return 8;
        case 7: group_rows<F, 7>(p, nrec, g, x, ldx, sx, nsx, part); return 7;
        case 6: group_rows<F, 6>(p, nrec, g, x, ldx, sx, nsx, part); return 6;
        case 5: group_rows<F, 5>(p, nrec, g, x, ldx, sx, nsx, part); return 5;
        case 4: group_rows<F, 4>(p, nrec, g, x, ldx, sx, nsx, part); return 4;
        case 3: group_rows<F, 3>(p, nrec, g, x, ldx, sx, nsx, part); return 3;
        case 2: group_rows<F, 2>(p, nrec, g, x, ldx, sx, nsx, part); return 2;
        default: group_rows<F, 1>(p, nrec, g, x, ldx, sx, nsx, part); return 1;
    }
}

// column group g for every row of x (tiles of up to 16 rows sharing each decoded chunk)
template <class F>
void columns(const uint8_t* p, const uint16_t* x, long ldx, int M, int K, const float* sx, int N, float* yf,
             uint16_t* yb, long ldy, int g) {
    const int nrec = K / F::SB, nsx = K / F::SUB;
    float part[kMaxRows * GROUP];
    const int cols = N - g * GROUP < GROUP ? N - g * GROUP : GROUP;
    for (int m0 = 0; m0 < M;) {
        const int left = M - m0 < kMaxRows ? M - m0 : kMaxRows;
        const int rows = tile<F>(p, nrec, g, x + (long)m0 * ldx, ldx, sx + (long)m0 * nsx, nsx, left, part);
        for (int r = 0; r < rows; ++r)
            for (int c = 0; c < cols; ++c) {
                const long at = (long)(m0 + r) * ldy + g * GROUP + c;
                if (yf) yf[at] = part[4 * r + c];
                else yb[at] = to_bf16(part[4 * r + c]);
            }
        m0 += rows;
    }
}

template <class F>
void gemm(const uint8_t* p, const uint16_t* x, long ldx, int M, int K, const float* sx, int N, float* yf, uint16_t* yb,
          long ldy, int threads) {
    const int groups = (N + GROUP - 1) / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int g = 0; g < groups; ++g) columns<F>(p, x, ldx, M, K, sx, N, yf, yb, ldy, g);
}

// a quarter of each sub-block's sum of x (each of a column's 4 lanes takes one quarter), float32
void sums(const uint16_t* x, long ldx, int M, int K, int sub, float* sx) {
    const int n = K / sub;
    for (int m = 0; m < M; ++m)
        for (int b = 0; b < n; ++b) {
            const uint16_t* xb = x + (long)m * ldx + (long)b * sub;
            __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)xb)), 16));
            if (sub == 32)
                v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                                         _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(xb + 16))), 16)));
            sx[(long)m * n + b] = 0.25f * _mm512_reduce_add_ps(v);
        }
}

// slot s's 32 weights as float32 q (words 0-15: columns 0, 1; 16-31: columns 2, 3)
template <class F>
inline void slot_q(const uint8_t* c, int s, __m512& lo, __m512& hi) {
    if constexpr (F::BITS == 8) {
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(c + 32 * s))));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(c + 32 * s + 16))));
    } else {
        const __m512i w = s == 0 ? slot<F::BITS, 0>(c) : s == 1 ? slot<F::BITS, 1>(c) : s == 2 ? slot<F::BITS, 2>(c)
                                                                                              : slot<F::BITS, 3>(c);
        const __m512 one = _mm512_set1_ps(1.0f), unit = _mm512_set1_ps((float)(1 << F::BITS));
        const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16));
        const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16));
        lo = _mm512_mul_ps(_mm512_sub_ps(a, one), unit);  // exact: q itself
        hi = _mm512_mul_ps(_mm512_sub_ps(b, one), unit);
    }
}

// the weights of columns [c0, c1) of group g (c relative to the group), dense rows at y (row stride ldy), each as
// the reference computes it: D (q - OFF), plus M where the type has one, rounded as gguf.quants does
template <class F>
void dequant_group(const uint8_t* p, int nrec, int g, int c0, int c1, float* yf, uint16_t* yb, long ldy) {
    using L = Layout<F>;
    const __m512i halves[2] = {_mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0),
                               _mm512_set_epi32(12, 12, 12, 12, 12, 12, 12, 12, 8, 8, 8, 8, 8, 8, 8, 8)};
    for (int rc = 0; rc < nrec; ++rc) {
        const uint8_t* rec = record<F>(p, nrec, g, rc);
        __m512 d[L::NS], m[L::NS];
        F::scales(rec + L::CHUNKS * L::CHUNK, d, m);
        for (int j = 0; j < L::CHUNKS; ++j) {
            __m512 dh[2], mh[2];  // D and M of columns 0, 1 (words 0-15) and 2, 3 (words 16-31)
            for (int s = 0; s < 4; ++s) {
                if (s == 0 || (F::SUB == 16 && s == 2)) {
                    const int e = F::SUB == 32 ? j : 2 * j + s / 2;
                    for (int h = 0; h < 2; ++h) {
                        dh[h] = _mm512_permutexvar_ps(halves[h], d[e]);
                        mh[h] = F::HAS_M ? _mm512_permutexvar_ps(halves[h], m[e]) : _mm512_setzero_ps();
                    }
                }
                __m512 q[2];
                slot_q<F>(rec + j * L::CHUNK, s, q[0], q[1]);
                for (int h = 0; h < 2; ++h) {  // columns 2h and 2h + 1
                    __m512 v = F::OFF ? _mm512_sub_ps(q[h], _mm512_set1_ps((float)F::OFF)) : q[h];
                    v = _mm512_mul_ps(dh[h], v);
                    if (F::HAS_M) v = _mm512_add_ps(v, mh[h]);
                    for (int k = 0; k < 2; ++k) {
                        const int c = 2 * h + k;
                        if (c < c0 || c >= c1) continue;
                        const long to = (long)(c - c0) * ldy + ((long)rc * L::CHUNKS + j) * QK + 8 * s;
                        const __m256 part = k ? _mm512_extractf32x8_ps(v, 1) : _mm512_castps512_ps256(v);
                        if (yf) _mm256_storeu_ps(yf + to, part);
                        else _mm_storeu_si128((__m128i*)(yb + to), (__m128i)_mm256_cvtneps_pbh(part));
                    }
                }
            }
        }
    }
}

}  // namespace

// spindle_quant_dot_tiles (quant_dot_amx.cpp): the product through AMX tiles; a thread refused them runs
// spindle_quant_dot_groups on its columns
int spindle_quant_dot_tiles(int type, const uint8_t* p, const uint16_t* x, long ldx, int M, int K, const float* sx,
                            int N, float* yf, uint16_t* yb, long ldy, int threads);

void spindle_quant_dot_groups(int type, const uint8_t* p, const uint16_t* x, long ldx, int M, int K, const float* sx,
                              int N, float* yf, uint16_t* yb, long ldy, int g0, int g1) {
    by_format(type, [&](auto f) {
        for (int g = g0; g < g1; ++g) columns<decltype(f)>(p, x, ldx, M, K, sx, N, yf, yb, ldy, g);
    });
}

extern "C" int spindle_quant_dot_abi() { return 3; }

// y [M, N] (float32 when y_bf16 is 0, else bf16 rounded to nearest even; row stride ldy) = x [M, K] (bf16, row
// stride ldx) @ W^T with W packed by spindle_quant_dot_pack. type: the ggml type t, plus (R << kTilesShift) to run
// products of R rows or more through AMX tiles (quant_dot_amx.cpp; R = 0: never). Nonzero, nothing written, for a
// type not packed here.
extern "C" int spindle_quant_dot_gemm(int type, const uint16_t* x, long ldx, int M, int K, const uint8_t* packed,
                                      int N, void* y, int y_bf16, long ldy, int threads) {
    static thread_local std::vector<float> scratch;
    float* yf = y_bf16 ? nullptr : (float*)y;
    uint16_t* yb = y_bf16 ? (uint16_t*)y : nullptr;
    const int tiles_from = type >> kTilesShift;
    type &= (1 << kTilesShift) - 1;
    return by_format(type, [&](auto f) {
        using F = decltype(f);
        float* sx = grow(scratch, (size_t)M * (K / F::SUB) + 1);
        if (Layout<F>::SX) sums(x, ldx, M, K, F::SUB, sx);
        if (tiles_from > 0 && M >= tiles_from) spindle_quant_dot_tiles(type, packed, x, ldx, M, K, sx, N, yf, yb, ldy, threads);
        else gemm<F>(packed, x, ldx, M, K, sx, N, yf, yb, ldy, threads);
    });
}

// Rows [n0, n1) of W from its packed form, dense (float32, or bf16 rounded to nearest even; row stride ldy), each
// weight as the reference computes it (gguf.quants.dequantize).
extern "C" int spindle_quant_dot_dequant(int type, const uint8_t* packed, int N, int K, int n0, int n1, void* y,
                                         int y_bf16, long ldy, int threads) {
    float* yf = y_bf16 ? nullptr : (float*)y;
    uint16_t* yb = y_bf16 ? (uint16_t*)y : nullptr;
    const int g0 = n0 / GROUP, g1 = (n1 + GROUP - 1) / GROUP;
    (void)N;
    return by_format(type, [&](auto f) {
        using F = decltype(f);
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int g = g0; g < g1; ++g) {
            const int first = g * GROUP > n0 ? g * GROUP : n0, last = g * GROUP + GROUP < n1 ? g * GROUP + GROUP : n1;
            const long row = first - n0;
            dequant_group<F>(packed, K / F::SB, g, first - g * GROUP, last - g * GROUP, yf ? yf + row * ldy : nullptr,
                             yb ? yb + row * ldy : nullptr, ldy);
        }
    });
}

// Rows ids[0, n) of W from its packed form (an embedding table's lookup), dense as spindle_quant_dot_dequant's.
extern "C" int spindle_quant_dot_rows(int type, const uint8_t* packed, int K, const int64_t* ids, int n, void* y,
                                      int y_bf16, long ldy, int threads) {
    float* yf = y_bf16 ? nullptr : (float*)y;
    uint16_t* yb = y_bf16 ? (uint16_t*)y : nullptr;
    return by_format(type, [&](auto f) {
        using F = decltype(f);
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int i = 0; i < n; ++i) {
            const int g = (int)(ids[i] / GROUP), c = (int)(ids[i] % GROUP);
            dequant_group<F>(packed, K / F::SB, g, c, c + 1, yf ? yf + i * ldy : nullptr, yb ? yb + i * ldy : nullptr, ldy);
        }
    });
}
