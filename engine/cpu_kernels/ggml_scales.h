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

}  // namespace spindle
