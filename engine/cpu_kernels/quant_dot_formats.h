// The packed forms of GGUF blocks for bf16 dot products (quant_dot.cpp multiplies them, quant_dot_pack.cpp makes
// them): one descriptor per ggml type saying how its weights decode in registers to exact bf16 values and how its
// scales become one float32 multiplier D (and an additive M) per sub-block and column.
//
// Layout: output columns in groups of GROUP = 4; per group, records of SB weights per column, end to end (a
// thread's groups are one stream). A record holds SB / 32 chunks, then the record's scales. A chunk is 32 weights
// of each of the 4 columns as 32 16-bit words: word w belongs to column w / 8 and, in slot s (0..3), to weight
// 8 s + w % 8 of the chunk, so slot s of all words pairs with x[8s, 8s + 8) repeated per 128-bit lane (one 16-byte
// broadcast of x, no reordered copy of the activations).
// - BITS 2..6: each weight's LOW low bits (LOW = 4; BITS 2, 3: LOW = 2) in a field of each word, LOW bits a slot:
//   64 bytes with bits 4s..4s+3 of word w those of slot s's weight (LOW 2: 32 bytes, bits 2s, 2s + 1 of byte w),
//   then BITS - LOW masks of 32 bits per slot (bit w: the weight's bit LOW + b). The weight q decodes to the bf16 of
//   1 + q / 2^BITS by a shift (LOW 2: after widening the bytes to words), one logic op and a masked add per high bit:
//   exact, and sum q x = 2^BITS (A - sum x) for A = sum (1 + q/2^BITS) x.
// - BITS 8 (Q8_0): per slot 32 signed bytes in word order, widened to float32 and converted to bf16 (exact).
// A weight is D (q - OFF) + M, D and M per column and SUB weights, as gguf.quants.dequantize computes them.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace spindle {
namespace qdot {

constexpr int GROUP = 4, QK = 32;

// lanes 4c..4c+3 belong to column c
inline __m512i by_column() { return _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0); }

// 4 float16 (one per column) -> each column's value in its 4 lanes
inline __m512 lanes4(const uint8_t* h) {
    const __m512 v = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)h)));
    return _mm512_permutexvar_ps(by_column(), v);
}

// 16 bytes [e][c] (4 sub-blocks e of 4 columns c), unsigned or signed -> float32 per (e, c)
template <bool SIGNED>
inline __m512 bytes16(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128((const __m128i*)p);
    return _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

// sub-block e (0..3) of a bytes16 vector in each column's lanes
inline __m512 pick(const __m512 v, int e) {
    return _mm512_permutexvar_ps(_mm512_add_epi32(by_column(), _mm512_set1_epi32(4 * e)), v);
}

// 16 bytes [e][c] of two 4-bit fields -> float32 per (e, c) of the field at bit AT (0 or 4)
template <int AT>
inline __m512 nibbles16(const uint8_t* p) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, AT), _mm512_set1_epi32(0xF)));
}

inline __m512 negate(__m512 v) { return _mm512_xor_ps(v, _mm512_set1_ps(-0.0f)); }

// sub-blocks 4h..4h+3 of a scale and a min vector ([e][c]): D = d sc, M = -(dmin m), as gguf rounds them
inline void scale_min4(__m512 dd, __m512 dm, __m512 sc, __m512 mn, int h, __m512* d, __m512* m) {
    for (int e = 0; e < 4; ++e) {
        d[4 * h + e] = _mm512_mul_ps(dd, pick(sc, e));
        m[4 * h + e] = negate(_mm512_mul_ps(dm, pick(mn, e)));
    }
}

struct Base {
    static constexpr int SB = 32, SUB = 32, OFF = 0;
    static constexpr bool HAS_M = false;
};

// d per column (Q4_0, Q5_0, Q8_0): weight d (q - OFF)
struct DOnly : Base {
    static constexpr int SCALES = 8;
    static void scales(const uint8_t* s, __m512* d, __m512*) { d[0] = lanes4(s); }
};

// d and m per column (Q4_1, Q5_1): weight d q + m
struct DAndM : Base {
    static constexpr int SCALES = 16;
    static constexpr bool HAS_M = true;
    static void scales(const uint8_t* s, __m512* d, __m512* m) {
        d[0] = lanes4(s);
        m[0] = lanes4(s + 8);
    }
};

struct Q4_0 : DOnly {
    static constexpr int TYPE = 2, BITS = 4, OFF = 8, FILE = 18;
};
struct Q4_1 : DAndM {
    static constexpr int TYPE = 3, BITS = 4, FILE = 20;
};
struct Q5_0 : DOnly {
    static constexpr int TYPE = 6, BITS = 5, OFF = 16, FILE = 22;
};
struct Q5_1 : DAndM {
    static constexpr int TYPE = 7, BITS = 5, FILE = 24;
};
struct Q8_0 : DOnly {
    static constexpr int TYPE = 8, BITS = 8, FILE = 34;
};

// Q4_K, Q5_K: d, dmin per column (8 bytes each), then 6-bit scale and min per sub-block of 32 as bytes [e][c]:
// weight (d sc) q - (dmin m)
struct KScaleMin : Base {
    static constexpr int SB = 256, SCALES = 16 + 32 + 32;
    static constexpr bool HAS_M = true;
    static void scales(const uint8_t* s, __m512* d, __m512* m) {
        const __m512 dd = lanes4(s), dm = lanes4(s + 8);
        for (int h = 0; h < 2; ++h)
            scale_min4(dd, dm, bytes16<false>(s + 16 + 16 * h), bytes16<false>(s + 48 + 16 * h), h, d, m);
    }
};
struct Q4_K : KScaleMin {
    static constexpr int TYPE = 12, BITS = 4, FILE = 144;
};
struct Q5_K : KScaleMin {
    static constexpr int TYPE = 13, BITS = 5, FILE = 176;
};

// Q6_K, Q3_K: d per column, then a signed 8-bit scale per sub-block of 16 as bytes [e][c] (Q3_K's 6-bit ones less
// 32): weight (d sc) (q - OFF)
struct KScale16 : Base {
    static constexpr int SB = 256, SUB = 16, SCALES = 8 + 64;
    static void scales(const uint8_t* s, __m512* d, __m512*) {
        const __m512 dd = lanes4(s);
        for (int h = 0; h < 4; ++h) {
            const __m512 sc = bytes16<true>(s + 8 + 16 * h);
            for (int e = 0; e < 4; ++e) d[4 * h + e] = _mm512_mul_ps(dd, pick(sc, e));
        }
    }
};
struct Q6_K : KScale16 {
    static constexpr int TYPE = 14, BITS = 6, OFF = 32, FILE = 210;
};
// q: the 2 low bits and the hmask bit as bit 2 (ggml subtracts 4 where that bit is clear)
struct Q3_K : KScale16 {
    static constexpr int TYPE = 11, BITS = 3, OFF = 4, FILE = 110;
};

// Q2_K: d, dmin per column, then per sub-block of 16 the file's byte [e][c] (scale in bits 0-3, min in 4-7):
// weight (d sc) q - (dmin m)
struct Q2_K : Base {
    static constexpr int TYPE = 10, BITS = 2, SB = 256, SUB = 16, SCALES = 16 + 64, FILE = 84;
    static constexpr bool HAS_M = true;
    static void scales(const uint8_t* s, __m512* d, __m512* m) {
        const __m512 dd = lanes4(s), dm = lanes4(s + 8);
        for (int h = 0; h < 4; ++h)
            scale_min4(dd, dm, nibbles16<0>(s + 16 + 16 * h), nibbles16<4>(s + 16 + 16 * h), h, d, m);
    }
};

// the low bits of a weight held in a chunk's shifted field (the rest in masks)
constexpr int low_bits(int bits) { return bits >= 4 ? 4 : 2; }

template <class F>
struct Layout {
    static constexpr int CHUNK = F::BITS == 8 ? 128 : 16 * F::BITS;    // bytes per 32 weights x 4 columns
    static constexpr int CHUNKS = F::SB / QK, NS = F::SB / F::SUB;     // chunks, scales per record
    static constexpr int REC = CHUNKS * CHUNK + F::SCALES;             // bytes per record
    static constexpr bool SX = F::BITS < 8 || F::OFF != 0 || F::HAS_M;  // needs the sums of x
};

// slot S of a chunk as 32 bf16 words
template <int BITS, int S>
inline __m512i slot(const uint8_t* c) {
    if constexpr (BITS == 8) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(c + 32 * S))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(c + 32 * S + 16))));
        return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    } else {
        constexpr int LOW = low_bits(BITS), at = 7 - BITS;  // low bits at mantissa bits at.., the high ones above
        const __m512i w =
            LOW == 4 ? _mm512_loadu_si512(c) : _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)c));
        const __m512i sh = LOW * S >= at ? _mm512_srli_epi16(w, LOW * S - at) : _mm512_slli_epi16(w, at - LOW * S);
        __m512i v = _mm512_ternarylogic_epi32(sh, _mm512_set1_epi16(((1 << LOW) - 1) << at), _mm512_set1_epi16(0x3F80),
                                              0xEA);
        for (int b = 0; b < BITS - LOW; ++b) {
            uint32_t bits;
            memcpy(&bits, c + 16 * LOW + 4 * (S * (BITS - LOW) + b), 4);
            v = _mm512_mask_add_epi16(v, _cvtu32_mask32(bits), v, _mm512_set1_epi16((short)(1 << (at + LOW + b))));
        }
        return v;
    }
}

// A record's multipliers per sub-block, per column's lanes: of A = sum (1 + q / 2^BITS) x (Q8_0: sum q x), 2^BITS D,
// and of the sub-block's sum of x, M - (OFF + 2^BITS) D (quant_dot.cpp's top says why)
template <class F>
inline void product_scales(const uint8_t* rec, __m512* dp, __m512* mp) {
    using L = Layout<F>;
    __m512 d[L::NS], m[L::NS];
    F::scales(rec + L::CHUNKS * L::CHUNK, d, m);
    constexpr float unit = F::BITS == 8 ? 1.0f : (float)(1 << F::BITS);
    for (int e = 0; e < L::NS; ++e) {
        dp[e] = _mm512_mul_ps(d[e], _mm512_set1_ps(unit));
        const __m512 add = F::HAS_M ? m[e] : _mm512_setzero_ps();
        mp[e] = _mm512_fnmadd_ps(d[e], _mm512_set1_ps((float)F::OFF + (F::BITS == 8 ? 0.0f : unit)), add);
    }
}

// The ggml type numbers packed here; F returns nonzero for any other.
template <class G>
int by_format(int type, G&& g) {
    switch (type) {
        case Q4_0::TYPE: g(Q4_0{}); return 0;
        case Q4_1::TYPE: g(Q4_1{}); return 0;
        case Q5_0::TYPE: g(Q5_0{}); return 0;
        case Q5_1::TYPE: g(Q5_1{}); return 0;
        case Q8_0::TYPE: g(Q8_0{}); return 0;
        case Q4_K::TYPE: g(Q4_K{}); return 0;
        case Q5_K::TYPE: g(Q5_K{}); return 0;
        case Q6_K::TYPE: g(Q6_K{}); return 0;
        case Q2_K::TYPE: g(Q2_K{}); return 0;
        case Q3_K::TYPE: g(Q3_K{}); return 0;
        default: return 1;
    }
}

}  // namespace qdot
}  // namespace spindle
