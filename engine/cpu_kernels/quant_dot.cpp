// y = x @ W^T for bf16 activations and W of 4-bit GGUF blocks (Q4_0, Q4_1) repacked once at load so that AVX512
// BF16's dot product does 32 products per instruction with the weights decoded by a shift and one logic op.
//
// Why it is fast: quant_gemm.cpp widens each weight to float32 (about 10 cycles per 32 weights at one row, more
// than a decode step's streaming of the blocks). Here a 4-bit value n is OR-ed into bf16's mantissa, giving the
// exact bf16 of 1 + n/16; the products with x are exact in float32, and sum_j (1 + n_j/16) x_j = A gives
// sum_j n_j x_j = 16 (A - sx), sx the block's sum of x. A block's weights are d n_j + m (Q4_1) or d (n_j - 8)
// (Q4_0), so its share of y is 16 d A + (m - 16 d) sx: the reference's weights up to float32 rounding, never a
// quantized activation.
//
// Layout (the same bytes as the file's): columns in groups of 4 (the last padded with zero scales), per group
// and block 64 bytes of nibbles then, after all nibbles, per group and block the 4 float16 d (and 4 m for Q4_1).
// In the 64 bytes, lane i = 4c + p (c the column, p 0..3) holds two 16-bit words h; nibble s (bits 4s..4s+3) of
// word h is weight j = 8s + 2p + h of column c's block. So slot s of all 16 lanes pairs with x[8s .. 8s+8) of the
// block repeated four times: one 16-byte broadcast of x, no reordered copy of the activations.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "scratch.h"

namespace {

using spindle::grow;

constexpr int QK = 32, GROUP = 4, NIB = 64;
constexpr int kAhead = 32;  // blocks fetched ahead of the product

inline int scale_halves(int type) { return type == 3 ? 8 : 4; }  // Q4_1: d and m per column, Q4_0: d

struct Packed {
    const uint8_t* nib;
    const uint16_t* sc;
    int nb, halves;
    const uint8_t* nibbles(int g, int b) const { return nib + ((long)g * nb + b) * NIB; }
    const uint16_t* scales(int g, int b) const { return sc + ((long)g * nb + b) * halves; }
};

inline Packed view(int type, const uint8_t* p, int N, int K) {
    const int groups = (N + GROUP - 1) / GROUP, nb = K / QK;
    return Packed{p, (const uint16_t*)(p + (long)groups * nb * NIB), nb, scale_halves(type)};
}

// slot s of the 32 words of a block group, as bf16 (1 + n/16) in every word
template <int S>
inline __m512i slot(__m512i w) {
    const __m512i sh = S == 0 ? _mm512_slli_epi16(w, 3) : _mm512_srli_epi16(w, 4 * S - 3);
    return _mm512_ternarylogic_epi32(sh, _mm512_set1_epi16(0x78), _mm512_set1_epi16(0x3F80), 0xEA);  // (a&b)|c
}

// [d0 d1 d2 d3 | m0 m1 m2 m3] of the group's block -> d and m per lane (lane i belongs to column i / 4)
template <int TYPE>
inline void scales(const uint16_t* s, __m512& d, __m512& m) {
    const __m512i by_column = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    if (TYPE == 3) {
        const __m512 dm = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s)));
        d = _mm512_permutexvar_ps(by_column, dm);
        m = _mm512_permutexvar_ps(_mm512_add_epi32(by_column, _mm512_set1_epi32(4)), dm);
    } else {
        const __m512 dd = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)s)));
        d = _mm512_permutexvar_ps(by_column, dd);
        m = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    }
}

inline __m512bh bcast_x(const uint16_t* x) { return (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)x)); }

// R rows (x bf16, stride ldx; sx a quarter of their block sums, stride nb) times one group of 4 columns -> out[R][4]
template <int TYPE, int R>
void group_rows(const Packed& p, int g, const uint16_t* x, long ldx, const float* sx, float* out) {
    __m512 ta[R], tm[R];
    for (int r = 0; r < R; ++r) ta[r] = tm[r] = _mm512_setzero_ps();
    for (int b = 0; b < p.nb; ++b) {
        // a thread's groups lie end to end: fetch ahead, as the hardware alone leaves the stream waiting on memory
        _mm_prefetch((const char*)p.nibbles(g, b) + kAhead * NIB, _MM_HINT_T0);
        _mm_prefetch((const char*)p.scales(g, b) + kAhead * 2 * p.halves, _MM_HINT_T0);
        const __m512i w = _mm512_loadu_si512(p.nibbles(g, b));
        const __m512bh w0 = (__m512bh)slot<0>(w), w1 = (__m512bh)slot<1>(w);
        const __m512bh w2 = (__m512bh)slot<2>(w), w3 = (__m512bh)slot<3>(w);
        __m512 d, m;
        scales<TYPE>(p.scales(g, b), d, m);
        // y = 16 sum_b d A + sum_b (m - 16 d) sx: the block's sum of x taken out through the second sum
        const __m512 m16 = _mm512_fnmadd_ps(d, _mm512_set1_ps(16.0f), m);
        for (int r = 0; r < R; ++r) {
            const uint16_t* xb = x + r * ldx + b * QK;
            __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0, bcast_x(xb));
            a = _mm512_dpbf16_ps(a, w1, bcast_x(xb + 8));
            a = _mm512_dpbf16_ps(a, w2, bcast_x(xb + 16));
            a = _mm512_dpbf16_ps(a, w3, bcast_x(xb + 24));
            ta[r] = _mm512_fmadd_ps(d, a, ta[r]);
            tm[r] = _mm512_fmadd_ps(m16, _mm512_set1_ps(sx[r * p.nb + b]), tm[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        __m512 t = _mm512_fmadd_ps(ta[r], _mm512_set1_ps(16.0f), tm[r]);
        t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));  // lanes of one column: pairs, then quads
        t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));
        const __m512 firsts = _mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), t);
        _mm_storeu_ps(out + 4 * r, _mm512_castps512_ps128(firsts));
    }
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch rounds (NaN stays NaN)
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

template <int TYPE>
void gemm(const Packed& p, const uint16_t* x, long ldx, int M, const float* sx, int N, float* yf, uint16_t* yb,
          long ldy, int threads) {
    const int groups = (N + GROUP - 1) / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int g = 0; g < groups; ++g) {
        float part[8 * GROUP];
        const int cols = N - g * GROUP < GROUP ? N - g * GROUP : GROUP;
        for (int m0 = 0; m0 < M; m0 += 8) {
            const int rows = M - m0 < 8 ? M - m0 : 8;
            const uint16_t* xr = x + (long)m0 * ldx;
            const float* sr = sx + (long)m0 * p.nb;
            switch (rows) {
                case 8: group_rows<TYPE, 8>(p, g, xr, ldx, sr, part); break;
                case 7: group_rows<TYPE, 7>(p, g, xr, ldx, sr, part); break;
                case 6: group_rows<TYPE, 6>(p, g, xr, ldx, sr, part); break;
                case 5: group_rows<TYPE, 5>(p, g, xr, ldx, sr, part); break;
                case 4: group_rows<TYPE, 4>(p, g, xr, ldx, sr, part); break;
                case 3: group_rows<TYPE, 3>(p, g, xr, ldx, sr, part); break;
                case 2: group_rows<TYPE, 2>(p, g, xr, ldx, sr, part); break;
                default: group_rows<TYPE, 1>(p, g, xr, ldx, sr, part); break;
            }
            for (int r = 0; r < rows; ++r)
                for (int c = 0; c < cols; ++c) {
                    const long at = (long)(m0 + r) * ldy + g * GROUP + c;
                    if (yf) yf[at] = part[4 * r + c];
                    else yb[at] = to_bf16(part[4 * r + c]);
                }
        }
    }
}

// weight j of a file block (Q4_0: 2 bytes d then 16 bytes; Q4_1: d, m then 16 bytes): j < 16 low nibbles
inline int file_nibble(const uint8_t* qs, int j) { return j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4; }

// the weights of columns [c0, c1) of group g (c relative to the group), dense rows at y (row stride ldy), each
// as the reference computes it: d * q + m (Q4_1), d * (q - 8) (Q4_0), rounded once
template <int TYPE>
void dequant_group(const Packed& p, int g, int c0, int c1, float* yf, uint16_t* yb, long ldy) {
    const __m512i pairs = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int b = 0; b < p.nb; ++b) {
        const __m512i w = _mm512_loadu_si512(p.nibbles(g, b));
        const uint16_t* s = p.scales(g, b);
        const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)s));
        const __m128 m4 = TYPE == 3 ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(s + 4))) : _mm_setzero_ps();
        for (int half = 0; half < 2; ++half) {  // columns 2 half, 2 half + 1: lanes 0-7 and 8-15
            const __m512i at = _mm512_add_epi32(pairs, _mm512_set1_epi32(2 * half));
            const __m512 d = _mm512_permutexvar_ps(at, _mm512_castps128_ps512(d4));
            const __m512 m = _mm512_permutexvar_ps(at, _mm512_castps128_ps512(m4));
            for (int sl = 0; sl < 4; ++sl) {
                const __m512i q16 = _mm512_and_si512(_mm512_srl_epi16(w, _mm_cvtsi32_si128(4 * sl)), _mm512_set1_epi16(0xF));
                __m512i q = _mm512_cvtepu16_epi32(half ? _mm512_extracti64x4_epi64(q16, 1) : _mm512_castsi512_si256(q16));
                if (TYPE != 3) q = _mm512_sub_epi32(q, _mm512_set1_epi32(8));
                __m512 v = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q));
                if (TYPE == 3) v = _mm512_add_ps(v, m);
                for (int k = 0; k < 2; ++k) {
                    const int c = 2 * half + k;
                    if (c < c0 || c >= c1) continue;
                    const long to = (long)(c - c0) * ldy + (long)b * QK + 8 * sl;
                    const __m256 part = k ? _mm512_extractf32x8_ps(v, 1) : _mm512_castps512_ps256(v);
                    if (yf) _mm256_storeu_ps(yf + to, part);
                    else _mm_storeu_si128((__m128i*)(yb + to), (__m128i)_mm256_cvtneps_pbh(part));
                }
            }
        }
    }
}

template <class F>
int by_type(int type, F&& f) {
    if (type == 2) return f(std::integral_constant<int, 2>{}), 0;
    if (type == 3) return f(std::integral_constant<int, 3>{}), 0;
    return 1;
}

}  // namespace

extern "C" int spindle_quant_dot_abi() { return 1; }

// Bytes of the packed form of W [N, K] (K a multiple of 32), or 0 for a type not packed here.
extern "C" long spindle_quant_dot_bytes(int type, int N, int K) {
    if (type != 2 && type != 3) return 0;
    const long groups = (N + GROUP - 1) / GROUP, nb = K / QK;
    return groups * nb * (NIB + 2L * scale_halves(type));
}

// W's file blocks (N rows of rb bytes) -> the packed form at dst (spindle_quant_dot_bytes of it).
extern "C" int spindle_quant_dot_pack(int type, const uint8_t* w, long rb, int N, int K, uint8_t* dst) {
    if (type != 2 && type != 3) return 1;
    const int groups = (N + GROUP - 1) / GROUP, nb = K / QK, halves = scale_halves(type), bytes = type == 3 ? 20 : 18;
    memset(dst, 0, (size_t)spindle_quant_dot_bytes(type, N, K));
    const Packed p = view(type, dst, N, K);
    for (int g = 0; g < groups; ++g)
        for (int b = 0; b < nb; ++b) {
            uint8_t* q = (uint8_t*)p.nibbles(g, b);
            uint16_t* s = (uint16_t*)p.scales(g, b);
            for (int c = 0; c < GROUP && g * GROUP + c < N; ++c) {
                const uint8_t* blk = w + (long)(g * GROUP + c) * rb + (long)b * bytes;
                memcpy(s + c, blk, 2);
                if (type == 3) memcpy(s + 4 + c, blk + 2, 2);
                const uint8_t* qs = blk + (type == 3 ? 4 : 2);
                for (int j = 0; j < QK; ++j) {
                    const int sl = j / 8, pp = (j % 8) / 2, hh = j % 2;
                    uint8_t* word = q + 4 * (4 * c + pp) + 2 * hh;
                    const int bit = 4 * sl;  // bits 0-7 in the word's first byte, 8-15 in its second
                    word[bit / 8] |= (uint8_t)(file_nibble(qs, j) << (bit % 8));
                }
            }
            (void)halves;
        }
    return 0;
}

// y [M, N] (float32 when y_bf16 is 0, else bf16 rounded to nearest even; row stride ldy) = x [M, K] (bf16, row
// stride ldx) @ W^T with W packed by spindle_quant_dot_pack. Nonzero, nothing written, for a type not packed here.
extern "C" int spindle_quant_dot_gemm(int type, const uint16_t* x, long ldx, int M, int K, const uint8_t* packed,
                                      int N, void* y, int y_bf16, long ldy, int threads) {
    static thread_local std::vector<float> sums;
    const int nb = K / QK;
    float* sx = grow(sums, (size_t)M * nb);
    for (int m = 0; m < M; ++m)  // each block's sum of x, float32, over 4
        for (int b = 0; b < nb; ++b) {
            const uint16_t* xb = x + (long)m * ldx + (long)b * QK;
            __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)xb)), 16));
            v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(xb + 16))), 16)));
            sx[(long)m * nb + b] = 0.25f * _mm512_reduce_add_ps(v);  // a quarter to each of a column's 4 lanes
        }
    const Packed p = view(type, packed, N, K);
    float* yf = y_bf16 ? nullptr : (float*)y;
    uint16_t* yb = y_bf16 ? (uint16_t*)y : nullptr;
    return by_type(type, [&](auto t) { gemm<decltype(t)::value>(p, x, ldx, M, sx, N, yf, yb, ldy, threads); });
}

// Rows [n0, n1) of W from its packed form, dense (float32, or bf16 rounded to nearest even; row stride ldy), each
// weight as the reference computes it (gguf.quants.dequantize).
extern "C" int spindle_quant_dot_dequant(int type, const uint8_t* packed, int N, int K, int n0, int n1, void* y,
                                         int y_bf16, long ldy, int threads) {
    const Packed p = view(type, packed, N, K);
    float* yf = y_bf16 ? nullptr : (float*)y;
    uint16_t* yb = y_bf16 ? (uint16_t*)y : nullptr;
    const int g0 = n0 / GROUP, g1 = (n1 + GROUP - 1) / GROUP;
    return by_type(type, [&](auto t) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int g = g0; g < g1; ++g) {
            const int first = g * GROUP > n0 ? g * GROUP : n0, last = g * GROUP + GROUP < n1 ? g * GROUP + GROUP : n1;
            const long row = first - n0;
            dequant_group<decltype(t)::value>(p, g, first - g * GROUP, last - g * GROUP,
                                              yf ? yf + row * ldy : nullptr,
                                              yb ? yb + row * ldy : nullptr, ldy);
        }
    });
}
