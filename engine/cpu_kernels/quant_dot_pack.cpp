// GGUF blocks -> quant_dot.cpp's packed form (layouts in quant_dot_formats.h), once per weight at load: each
// block's quants unpacked as ggml stores them (the same reading as gguf.quants.dequantize), then written into
// the record of its group of 4 columns with the block's scales.
#include <stdint.h>
#include <string.h>

#include "ggml_scales.h"
#include "quant_dot_formats.h"

namespace {

using namespace spindle::qdot;
using spindle::scale_k3;
using spindle::scale_min_k4;

// weight j (0..31) of a 32-weight block's 16 bytes of nibbles: j < 16 low nibbles
inline int nibble(const uint8_t* qs, int j) { return j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4; }
inline int bit(const uint8_t* p, int i) { return (p[i / 8] >> (i % 8)) & 1; }

// One file block of column c -> its quants q[0, SB) (the unsigned stored value; Q8_0: the signed byte) and its
// scales into the record's scale bytes s.
template <class F>
void unpack(const uint8_t* b, int c, uint8_t* q, uint8_t* s);

template <>
void unpack<Q4_0>(const uint8_t* b, int c, uint8_t* q, uint8_t* s) {
    memcpy(s + 2 * c, b, 2);
    for (int j = 0; j < 32; ++j) q[j] = (uint8_t)nibble(b + 2, j);
}
template <>
void unpack<Q4_1>(const uint8_t* b, int c, uint8_t* q, uint8_t* s) {
    memcpy(s + 2 * c, b, 2);
    memcpy(s + 8 + 2 * c, b + 2, 2);
    for (int j = 0; j < 32; ++j) q[j] = (uint8_t)nibble(b + 4, j);
}
template <>
void unpack<Q5_0>(const uint8_t* b, int c, uint8_t* q, uint8_t* s) {
    memcpy(s + 2 * c, b, 2);
    for (int j = 0; j < 32; ++j) q[j] = (uint8_t)(nibble(b + 6, j) | bit(b + 2, j) << 4);
}
template <>
void unpack<Q5_1>(const uint8_t* b, int c, uint8_t* q, uint8_t* s) {
    memcpy(s + 2 * c, b, 2);
    memcpy(s + 8 + 2 * c, b + 2, 2);
    for (int j = 0; j < 32; ++j) q[j] = (uint8_t)(nibble(b + 8, j) | bit(b + 4, j) << 4);
}
template <>
void unpack<Q8_0>(const uint8_t* b, int c, uint8_t* q, uint8_t* s) {
    memcpy(s + 2 * c, b, 2);
    memcpy(q, b + 2, 32);
}

// d, dmin, then scale and min of sub-block j at [j][c]
void k_scales(const uint8_t* b, int c, uint8_t* s) {
    memcpy(s + 2 * c, b, 2);
    memcpy(s + 8 + 2 * c, b + 2, 2);
    for (int j = 0; j < 8; ++j) scale_min_k4(b + 4, j, s[16 + 4 * j + c], s[48 + 4 * j + c]);
}
template <>
void unpack<Q4_K>(const uint8_t* b, int c, uint8_t* q, uint8_t* s) {
    k_scales(b, c, s);
    for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 32; ++l) q[32 * j + l] = (uint8_t)((b[16 + 32 * (j / 2) + l] >> (4 * (j & 1))) & 0xF);
}
template <>
void unpack<Q5_K>(const uint8_t* b, int c, uint8_t* q, uint8_t* s) {
    k_scales(b, c, s);
    for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 32; ++l) {
            const int lo = (b[48 + 32 * (j / 2) + l] >> (4 * (j & 1))) & 0xF, hi = (b[16 + l] >> j) & 1;
            q[32 * j + l] = (uint8_t)(lo | hi << 4);
        }
}

// d, then the signed scale of sub-block e of 16 at [e][c]
void k_scales16(const uint8_t* d, int c, const int8_t* sc, uint8_t* s) {
    memcpy(s + 2 * c, d, 2);
    for (int e = 0; e < 16; ++e) s[8 + 4 * e + c] = (uint8_t)sc[e];
}
template <>
void unpack<Q6_K>(const uint8_t* b, int c, uint8_t* q, uint8_t* s) {
    k_scales16(b + 208, c, (const int8_t*)(b + 192), s);
    for (int j = 0; j < 8; ++j) {
        const int g = j / 4, jj = j % 4;
        const uint8_t *ql = b + 64 * g + 32 * (jj & 1), *qh = b + 128 + 32 * g;
        for (int l = 0; l < 32; ++l)
            q[32 * j + l] = (uint8_t)(((ql[l] >> (4 * (jj >> 1))) & 0xF) | ((qh[l] >> (2 * jj)) & 3) << 4);
    }
}

// Q2_K, Q3_K: weight 128 h + 32 s + l is bits 2s, 2s + 1 of byte 32 h + l of the 64 quant bytes
inline int crumb(const uint8_t* qs, int i) { return (qs[32 * (i / 128) + i % 32] >> (2 * (i / 32 % 4))) & 3; }
template <>
void unpack<Q2_K>(const uint8_t* b, int c, uint8_t* q, uint8_t* s) {
    memcpy(s + 2 * c, b + 80, 2);
    memcpy(s + 8 + 2 * c, b + 82, 2);
    for (int e = 0; e < 16; ++e) s[16 + 4 * e + c] = b[e];  // scale | min << 4, split in registers
    for (int i = 0; i < 256; ++i) q[i] = (uint8_t)crumb(b + 16, i);
}
template <>
void unpack<Q3_K>(const uint8_t* b, int c, uint8_t* q, uint8_t* s) {
    int8_t sc[16];
    for (int e = 0; e < 16; ++e) sc[e] = (int8_t)scale_k3(b + 96, e);
    k_scales16(b + 108, c, sc, s);
    // the hmask's bit j of byte l: bit 2 of weight 32 j + l
    for (int i = 0; i < 256; ++i) q[i] = (uint8_t)(crumb(b + 32, i) | ((b[i % 32] >> (i / 32)) & 1) << 2);
}

// weight l (0..31) of column c into chunk ch: word w = 8c + l % 8, slot l / 8
template <int BITS>
void put(uint8_t* ch, int c, int l, uint8_t q) {
    const int w = 8 * c + l % 8, s = l / 8;
    if (BITS == 8) {
        ch[32 * s + w] = q;
        return;
    }
    constexpr int LOW = low_bits(BITS);
    const int at = LOW * s;  // bits LOW s.. of word w's field (LOW 4: a 16-bit word, LOW 2: a byte), little-endian
    ch[LOW / 2 * w + at / 8] |= (uint8_t)((q & ((1 << LOW) - 1)) << (at % 8));
    for (int b = 0; b < BITS - LOW; ++b)
        if ((q >> (LOW + b)) & 1) ch[16 * LOW + 4 * (s * (BITS - LOW) + b) + w / 8] |= (uint8_t)(1 << (w % 8));
}

template <class F>
void pack(const uint8_t* w, long rb, int N, int K, uint8_t* dst) {
    using L = Layout<F>;
    const int groups = (N + GROUP - 1) / GROUP, nrec = K / F::SB;
    uint8_t q[256];
    for (int g = 0; g < groups; ++g)
        for (int r = 0; r < nrec; ++r) {
            uint8_t* rec = dst + ((long)g * nrec + r) * L::REC;
            for (int c = 0; c < GROUP && g * GROUP + c < N; ++c) {
                unpack<F>(w + (long)(g * GROUP + c) * rb + (long)r * F::FILE, c, q, rec + L::CHUNKS * L::CHUNK);
                for (int j = 0; j < L::CHUNKS; ++j)
                    for (int l = 0; l < QK; ++l) put<F::BITS>(rec + j * L::CHUNK, c, l, q[QK * j + l]);
            }
        }
}

}  // namespace

// Bytes of the packed form of W [N, K] (K a multiple of the type's block), or 0 for a type not packed here.
extern "C" long spindle_quant_dot_bytes(int type, int N, int K) {
    long bytes = 0;
    by_format(type, [&](auto f) {
        using F = decltype(f);
        bytes = (long)((N + GROUP - 1) / GROUP) * (K / F::SB) * Layout<F>::REC;
    });
    return bytes;
}

// W's file blocks (N rows of rb bytes) -> the packed form at dst (spindle_quant_dot_bytes of it; columns past N
// in the last group have zero scales and quants).
extern "C" int spindle_quant_dot_pack(int type, const uint8_t* w, long rb, int N, int K, uint8_t* dst) {
    const long bytes = spindle_quant_dot_bytes(type, N, K);
    if (bytes) memset(dst, 0, (size_t)bytes);
    return by_format(type, [&](auto f) { pack<decltype(f)>(w, rb, N, K, dst); });
}
