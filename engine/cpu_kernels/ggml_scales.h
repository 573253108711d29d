// What the GGUF block kernels share in reading ggml's layouts (quant_gemm.cpp in registers, quant_dot_pack.cpp at
// load when it repacks the blocks).
#pragma once

#include <stdint.h>

namespace spindle {

// Q4_K and Q5_K: eight 6-bit scales and mins packed in 12 bytes (ggml's get_scale_min_k4); T holds 0..63
template <class T>
inline void scale_min_k4(const uint8_t* q, int j, T& sc, T& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q3_K: sixteen 6-bit scales, low 4 bits in bytes 0-7 (two per byte), high 2 bits in bytes 8-11; less 32
inline int scale_k3(const uint8_t* s, int i) {
    const int lo4 = i < 8 ? s[i] & 0xF : s[i - 8] >> 4;
    const int hi2 = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (int)(int8_t)(uint8_t)(lo4 | (hi2 << 4)) - 32;
}

}  // namespace spindle
