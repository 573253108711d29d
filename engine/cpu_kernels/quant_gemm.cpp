// y = x @ W^T with W held as a GGUF file's quantized blocks (ggml's layouts: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K,
// Q3_K, Q4_K, Q5_K, Q6_K), each block dequantized in registers to float32 and the products summed in float32:
// a decode step streams the blocks (4-bit: ~3.5x fewer bytes than bf16) and never a dense copy. The
// activations are not quantized, so the result is the dequantized model's up to float32 summation order.
// Also the dequantization alone (a tile of rows to float32 or bf16) for products whose rows favour torch's GEMM.
// Built and loaded by engine/cpu_kernels/build.py; called through engine/cpu_kernels/quant_gemm.py.
//
// Each type gives chunk(block, j, lo, hi): the block's j-th 32 weights as two vectors of 16 float32, computed in
// the reference's order of operations (gguf.quants.dequantize), so the weights are the reference's bit for bit.
// The product takes 4 output columns at a time (their rows of blocks stay in L1 while every tile of up to 16 rows
// of x passes over them); in tiles of fewer than 16 sums each (row, column) sums in two vectors, so consecutive
// FMAs do not wait on each other. Two FMAs per 32 weights and row (bf16's dot product does 32 products in one)
// plus about 0.5 instruction per weight to dequantize: at one row the arithmetic, not memory, bounds it.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "ggml_scales.h"
#include "scratch.h"

namespace {

using spindle::grow;
using spindle::scale_k3;

inline float half(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
inline __m512i bytes16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline __m512i sbytes16(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline __m512i shr(__m512i v, int s) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(s)); }
inline __m512i low(__m512i v, int bits) { return _mm512_and_si512(v, _mm512_set1_epi32((1 << bits) - 1)); }
inline __m512 f32(__m512i v) { return _mm512_cvtepi32_ps(v); }
inline __m512 mul(float d, __m512i q) { return _mm512_mul_ps(_mm512_set1_ps(d), f32(q)); }
// bit `first + i` of the 32-bit word qh in lane i, times 16
inline __m512i high_bits(uint32_t qh, int first) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i s = _mm512_add_epi32(lanes, _mm512_set1_epi32(first));
    return _mm512_slli_epi32(low(_mm512_srlv_epi32(_mm512_set1_epi32((int)qh), s), 1), 4);
}
inline uint32_t word(const uint8_t* p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

struct Q8_0 {
    static constexpr int QK = 32, BYTES = 34;
    static void chunk(const uint8_t* b, int, __m512& lo, __m512& hi) {
        const float d = half(b);
        lo = mul(d, sbytes16(b + 2));
        hi = mul(d, sbytes16(b + 18));
    }
};

struct Q4_0 {
    static constexpr int QK = 32, BYTES = 18;
    static void chunk(const uint8_t* b, int, __m512& lo, __m512& hi) {
        const float d = half(b);
        const __m512i v = bytes16(b + 2), eight = _mm512_set1_epi32(8);
        lo = mul(d, _mm512_sub_epi32(low(v, 4), eight));
        hi = mul(d, _mm512_sub_epi32(_mm512_srli_epi32(v, 4), eight));
    }
};

struct Q4_1 {
    static constexpr int QK = 32, BYTES = 20;
    static void chunk(const uint8_t* b, int, __m512& lo, __m512& hi) {
        const __m512 m = _mm512_set1_ps(half(b + 2));
        const float d = half(b);
        const __m512i v = bytes16(b + 4);
        lo = _mm512_add_ps(mul(d, low(v, 4)), m);
        hi = _mm512_add_ps(mul(d, _mm512_srli_epi32(v, 4)), m);
    }
};

struct Q5_0 {
    static constexpr int QK = 32, BYTES = 22;
    static void chunk(const uint8_t* b, int, __m512& lo, __m512& hi) {
        const float d = half(b);
        const uint32_t qh = word(b + 2);
        const __m512i v = bytes16(b + 6), sixteen = _mm512_set1_epi32(16);
        lo = mul(d, _mm512_sub_epi32(_mm512_or_si512(low(v, 4), high_bits(qh, 0)), sixteen));
        hi = mul(d, _mm512_sub_epi32(_mm512_or_si512(_mm512_srli_epi32(v, 4), high_bits(qh, 16)), sixteen));
    }
};

struct Q5_1 {
    static constexpr int QK = 32, BYTES = 24;
    static void chunk(const uint8_t* b, int, __m512& lo, __m512& hi) {
        const float d = half(b);
        const __m512 m = _mm512_set1_ps(half(b + 2));
        const uint32_t qh = word(b + 4);
        const __m512i v = bytes16(b + 8);
        lo = _mm512_add_ps(mul(d, _mm512_or_si512(low(v, 4), high_bits(qh, 0))), m);
        hi = _mm512_add_ps(mul(d, _mm512_or_si512(_mm512_srli_epi32(v, 4), high_bits(qh, 16))), m);
    }
};

// Q4_K and Q5_K: sub-block j's scale d * sc and min dmin * m
inline void k4_scale_min(const uint8_t* b, int j, float& d, float& m) {
    int sc, mn;
    spindle::scale_min_k4(b + 4, j, sc, mn);
    d = half(b) * (float)sc;
    m = half(b + 2) * (float)mn;
}

struct Q4_K {
    static constexpr int QK = 256, BYTES = 144;
    static void chunk(const uint8_t* b, int j, __m512& lo, __m512& hi) {
        float d, m;
        k4_scale_min(b, j, d, m);
        const uint8_t* q = b + 16 + 32 * (j / 2);
        const int s = 4 * (j & 1);
        lo = _mm512_sub_ps(mul(d, low(shr(bytes16(q), s), 4)), _mm512_set1_ps(m));
        hi = _mm512_sub_ps(mul(d, low(shr(bytes16(q + 16), s), 4)), _mm512_set1_ps(m));
    }
};

struct Q5_K {
    static constexpr int QK = 256, BYTES = 176;
    static void chunk(const uint8_t* b, int j, __m512& lo, __m512& hi) {
        float d, m;
        k4_scale_min(b, j, d, m);
        const uint8_t *qh = b + 16, *q = b + 48 + 32 * (j / 2);
        const int s = 4 * (j & 1);
        const __m512i h0 = _mm512_slli_epi32(low(shr(bytes16(qh), j), 1), 4);
        const __m512i h1 = _mm512_slli_epi32(low(shr(bytes16(qh + 16), j), 1), 4);
        lo = _mm512_sub_ps(mul(d, _mm512_or_si512(low(shr(bytes16(q), s), 4), h0)), _mm512_set1_ps(m));
        hi = _mm512_sub_ps(mul(d, _mm512_or_si512(low(shr(bytes16(q + 16), s), 4), h1)), _mm512_set1_ps(m));
    }
};

struct Q6_K {
    static constexpr int QK = 256, BYTES = 210;
    static void chunk(const uint8_t* b, int j, __m512& lo, __m512& hi) {
        const int g = j / 4, jj = j % 4;
        const uint8_t* ql = b + 64 * g + 32 * (jj & 1);
        const uint8_t* qh = b + 128 + 32 * g;
        const int8_t* sc = (const int8_t*)(b + 192);
        const float d = half(b + 208);
        const int s = 4 * (jj >> 1), hs = 2 * jj;
        const __m512i off = _mm512_set1_epi32(32);
        const __m512i q0 = _mm512_or_si512(low(shr(bytes16(ql), s), 4), _mm512_slli_epi32(low(shr(bytes16(qh), hs), 2), 4));
        const __m512i q1 = _mm512_or_si512(low(shr(bytes16(ql + 16), s), 4),
                                           _mm512_slli_epi32(low(shr(bytes16(qh + 16), hs), 2), 4));
        lo = mul(d * (float)sc[2 * j], _mm512_sub_epi32(q0, off));
        hi = mul(d * (float)sc[2 * j + 1], _mm512_sub_epi32(q1, off));
    }
};

struct Q3_K {
    static constexpr int QK = 256, BYTES = 110;
    static void chunk(const uint8_t* b, int j, __m512& lo, __m512& hi) {
        const uint8_t *hm = b, *q = b + 32 + 32 * (j / 4), *sc = b + 96;
        const float d = half(b + 108);
        const int s = 2 * (j % 4);
        const __m512i one = _mm512_set1_epi32(1);
        // the offset 4 applies where the mask bit is clear
        const __m512i o0 = _mm512_slli_epi32(_mm512_xor_si512(low(shr(bytes16(hm), j), 1), one), 2);
        const __m512i o1 = _mm512_slli_epi32(_mm512_xor_si512(low(shr(bytes16(hm + 16), j), 1), one), 2);
        lo = mul(d * (float)scale_k3(sc, 2 * j), _mm512_sub_epi32(low(shr(bytes16(q), s), 2), o0));
        hi = mul(d * (float)scale_k3(sc, 2 * j + 1), _mm512_sub_epi32(low(shr(bytes16(q + 16), s), 2), o1));
    }
};

struct Q2_K {
    static constexpr int QK = 256, BYTES = 84;
    static void chunk(const uint8_t* b, int j, __m512& lo, __m512& hi) {
        const uint8_t *sc = b, *q = b + 16 + 32 * (j / 4);
        const float d = half(b + 80), dmin = half(b + 82);
        const int s = 2 * (j % 4);
        const int s0 = sc[2 * j], s1 = sc[2 * j + 1];
        lo = _mm512_sub_ps(mul(d * (float)(s0 & 0xF), low(shr(bytes16(q), s), 2)), _mm512_set1_ps(dmin * (float)(s0 >> 4)));
        hi = _mm512_sub_ps(mul(d * (float)(s1 & 0xF), low(shr(bytes16(q + 16), s), 2)),
                           _mm512_set1_ps(dmin * (float)(s1 >> 4)));
    }
};

constexpr int kGroup = 4;     // output columns whose blocks a thread keeps in L1 while the row tiles pass
constexpr int kTileRows = 8;  // rows of x per tile: 8 rows x 2 sums fill half the registers
constexpr int kRowBlock = 64; // rows of x (float32) per pass, so they stay in L2 across a thread's columns
constexpr size_t kKeepBytes = 4 << 20;  // widened activations kept between calls up to this size

// R rows of x (float32, stride ldx) times NB columns of W (rows of blocks at w, stride rb) into out[R][NB]
template <class T, int R, int NB>
void tile(const float* x, long ldx, const uint8_t* w, long rb, int nblocks, float* out) {
    constexpr int S = R * NB >= 16 ? 1 : 2;  // sums per (row, column): two where fewer would wait on each other
    __m512 acc[R][NB][2];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NB; ++c) acc[r][c][0] = acc[r][c][1] = _mm512_setzero_ps();
    constexpr int ahead = 1024 / T::BYTES + 1;  // blocks fetched ahead: the hardware alone leaves each row waiting
    for (int blk = 0; blk < nblocks; ++blk) {
        for (int c = 0; c < NB; ++c) _mm_prefetch((const char*)(w + c * rb + (long)(blk + ahead) * T::BYTES), _MM_HINT_T0);
        for (int j = 0; j < T::QK / 32; ++j) {
            const long k = (long)blk * T::QK + 32 * j;
            for (int c = 0; c < NB; ++c) {
                __m512 lo, hi;
                T::chunk(w + c * rb + (long)blk * T::BYTES, j, lo, hi);
                for (int r = 0; r < R; ++r) {
                    acc[r][c][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * ldx + k), acc[r][c][0]);
                    acc[r][c][S - 1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * ldx + k + 16), acc[r][c][S - 1]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NB; ++c) out[r * NB + c] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][c][0], acc[r][c][1]));
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch rounds (NaN stays NaN)
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

struct Out {
    float* yf;
    uint16_t* yb;
    long ldy;
    void put(int m, int n, float v) const {
        if (yf) yf[(long)m * ldy + n] = v;
        else yb[(long)m * ldy + n] = to_bf16(v);
    }
};

// R rows against `cols` (<= kGroup) columns starting at n, NB at a time, then one at a time
template <class T, int R, int NB>
void rows_by_group(const float* x, long ldx, int m0, const uint8_t* w, long rb, int nblocks, int n, int cols,
                   const Out& o) {
    float part[R * NB];
    int c = 0;
    for (; c + NB <= cols; c += NB) {
        tile<T, R, NB>(x, ldx, w + (long)(n + c) * rb, rb, nblocks, part);
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < NB; ++i) o.put(m0 + r, n + c + i, part[r * NB + i]);
    }
    for (; c < cols; ++c) {
        tile<T, R, 1>(x, ldx, w + (long)(n + c) * rb, rb, nblocks, part);
        for (int r = 0; r < R; ++r) o.put(m0 + r, n + c, part[r]);
    }
}

// every row of x[m0, m1) against the group's columns: tiles of 16, then 8, 4, 2, 1
template <class T>
void group(const float* x, long ldx, int m0, int m1, const uint8_t* w, long rb, int nblocks, int n, int cols,
           const Out& o) {
    int m = m0;
    for (; m + 16 <= m1; m += 16) rows_by_group<T, 16, 1>(x + (long)(m - m0) * ldx, ldx, m, w, rb, nblocks, n, cols, o);
    if (m + 8 <= m1) {
        rows_by_group<T, 8, 1>(x + (long)(m - m0) * ldx, ldx, m, w, rb, nblocks, n, cols, o);
        m += 8;
    }
    if (m + 4 <= m1) {
        rows_by_group<T, 4, 2>(x + (long)(m - m0) * ldx, ldx, m, w, rb, nblocks, n, cols, o);
        m += 4;
    }
    if (m + 2 <= m1) {
        rows_by_group<T, 2, 2>(x + (long)(m - m0) * ldx, ldx, m, w, rb, nblocks, n, cols, o);
        m += 2;
    }
    if (m < m1) rows_by_group<T, 1, 4>(x + (long)(m - m0) * ldx, ldx, m, w, rb, nblocks, n, cols, o);
}

template <class T>
void gemm(const float* x, long ldx, int M, int K, const uint8_t* w, long rb, int N, const Out& o, int threads) {
    const int nblocks = K / T::QK, groups = (N + kGroup - 1) / kGroup;
#pragma omp parallel num_threads(threads)
    for (int m0 = 0; m0 < M; m0 += kRowBlock) {
        const int m1 = m0 + kRowBlock < M ? m0 + kRowBlock : M;
#pragma omp for schedule(static)
        for (int g = 0; g < groups; ++g) {
            const int n = g * kGroup, cols = N - n < kGroup ? N - n : kGroup;
            group<T>(x + (long)m0 * ldx, ldx, m0, m1, w, rb, nblocks, n, cols, o);
        }
    }
}

template <class T>
void dequant(const uint8_t* w, long rb, int N, int K, float* yf, uint16_t* yb, long ldy, int threads) {
    const int nblocks = K / T::QK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < N; ++n)
        for (int blk = 0; blk < nblocks; ++blk)
            for (int j = 0; j < T::QK / 32; ++j) {
                __m512 lo, hi;
                T::chunk(w + (long)n * rb + (long)blk * T::BYTES, j, lo, hi);
                const long at = (long)n * ldy + (long)blk * T::QK + 32 * j;
                if (yf) {
                    _mm512_storeu_ps(yf + at, lo);
                    _mm512_storeu_ps(yf + at + 16, hi);
                } else {
                    _mm256_storeu_si256((__m256i*)(yb + at), (__m256i)_mm512_cvtneps_pbh(lo));
                    _mm256_storeu_si256((__m256i*)(yb + at + 16), (__m256i)_mm512_cvtneps_pbh(hi));
                }
            }
}

// The ggml type numbers (gguf.GGMLQuantizationType) this file computes; F returns nonzero for any other.
template <class F>
int by_type(int type, F&& f) {
    switch (type) {
        case 2: f(Q4_0{}); return 0;
        case 3: f(Q4_1{}); return 0;
        case 6: f(Q5_0{}); return 0;
        case 7: f(Q5_1{}); return 0;
        case 8: f(Q8_0{}); return 0;
        case 10: f(Q2_K{}); return 0;
        case 11: f(Q3_K{}); return 0;
        case 12: f(Q4_K{}); return 0;
        case 13: f(Q5_K{}); return 0;
        case 14: f(Q6_K{}); return 0;
        default: return 1;
    }
}

}  // namespace

extern "C" int spindle_quant_gemm_abi() { return 1; }

// y [M, N] (float32 when y_bf16 is 0, else bf16; row stride ldy) = x [M, K] (float32 or bf16 per x_bf16, row
// stride ldx) @ W^T, W [N, K] as rows of `type` blocks (rb bytes a row). K must be a multiple of the type's
// block. Returns nonzero, with nothing written, for a type not computed here. Type 1024 + t: W packed by
// quant_dot.cpp (rb unused), x bf16.
extern "C" int spindle_quant_dot_gemm(int type, const uint16_t* x, long ldx, int M, int K, const uint8_t* packed,
                                      int N, void* y, int y_bf16, long ldy, int threads);
constexpr int kPacked = 1024;  // type kPacked + t: W in quant_dot.cpp's packed form of type t (bf16 x only)

extern "C" int spindle_quant_gemm(int type, const void* x, int x_bf16, long ldx, int M, int K, const uint8_t* w,
                                  long rb, int N, void* y, int y_bf16, long ldy, int threads) {
    if (type >= kPacked)
        return x_bf16 ? spindle_quant_dot_gemm(type - kPacked, (const uint16_t*)x, ldx, M, K, w, N, y, y_bf16, ldy, threads)
                      : 1;
    static thread_local std::vector<float> xf;
    const float* xs = (const float*)x;
    long ld = ldx;
    if (x_bf16) {  // widened once: every column's tile reads it again
        float* to = grow(xf, (size_t)M * K);
        const uint16_t* xb = (const uint16_t*)x;
        for (int m = 0; m < M; ++m)
            for (int k = 0; k < K; ++k) {
                const uint32_t u = (uint32_t)xb[(long)m * ldx + k] << 16;
                memcpy(to + (long)m * K + k, &u, 4);
            }
        xs = to;
        ld = K;
    }
    const Out o{y_bf16 ? nullptr : (float*)y, y_bf16 ? (uint16_t*)y : nullptr, ldy};
    const int bad = by_type(type, [&](auto t) { gemm<decltype(t)>(xs, ld, M, K, w, rb, N, o, threads); });
    if (xf.capacity() * sizeof(float) > kKeepBytes) std::vector<float>().swap(xf);  // a long prefill's is not kept
    return bad;
}

// y [N, K] (float32, or bf16 rounded to nearest even; row stride ldy) = the weights of N rows of `type` blocks.
extern "C" int spindle_quant_dequant(int type, const uint8_t* w, long rb, int N, int K, void* y, int y_bf16, long ldy,
                                     int threads) {
    float* yf = y_bf16 ? nullptr : (float*)y;
    uint16_t* yb = y_bf16 ? (uint16_t*)y : nullptr;
    return by_type(type, [&](auto t) { dequant<decltype(t)>(w, rb, N, K, yf, yb, ldy, threads); });
}
