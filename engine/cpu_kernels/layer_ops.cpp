// A decoder layer's small bfloat16 ops in one pass each, with AVX-512: residual add + RMSNorm (Gemma's too), rotary
// embedding (in place), SiLU(gate) * up, GELU-tanh(gate) * up. Each rounds to bf16 exactly where the torch ops it replaces do
// (engine/attention.py, engine/models/decoder.py), so only float32 sums taken in another order and exp's
// last float32 bits can move a result, by one bf16 step, rarely.
// Built and loaded by engine/cpu_kernels/build.py; called through engine/cpu_kernels/layer_ops.py.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"

namespace {

using spindle::narrow;
using spindle::round_bf16;
inline __m512 load_n(const uint16_t* p, __mmask16 m) { return spindle::load_bf16_n(p, m); }
inline __mmask16 first(int n) { return spindle::first_lanes(n); }


}  // namespace

extern "C" int spindle_layer_ops_abi() { return 2; }

// Rows of n: x_out = bf16(x + h) (h null: x_out = x, may be x itself), then the norm of x_out into `norm`:
// bf16 weights: bf16(w * bf16(x_out * rsqrt(mean(x_out^2) + eps)));
// float32 weights (Gemma's 1 + weight): bf16(x_out * rsqrt(...) * w), one rounding, as engine/models/decoder.py's
// gemma_rms_norm. norm may be x_out itself (each chunk is read before it is written).
template <typename W>
void add_rms_norm(const uint16_t* x, long ldx, const uint16_t* h, long ldh, const W* w, uint16_t* x_out, long ldxo,
                  uint16_t* norm, long ldn, int rows, int n, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; ++r) {
        const uint16_t* xr = x + r * ldx;
        uint16_t* xo = x_out + r * ldxo;
        __m512 ss = _mm512_setzero_ps();
        for (int i = 0; i < n; i += 16) {
            const __mmask16 m = first(n - i);
            __m512 v = load_n(xr + i, m);
            if (h) {
                v = round_bf16(_mm512_add_ps(v, load_n(h + r * ldh + i, m)));
                _mm256_mask_storeu_epi16(xo + i, m, narrow(v));
            } else if (xo != xr) {
                _mm256_mask_storeu_epi16(xo + i, m, narrow(v));
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / __builtin_sqrtf(_mm512_reduce_add_ps(ss) / n + eps));
        for (int i = 0; i < n; i += 16) {
            const __mmask16 m = first(n - i);
            const __m512 normed = _mm512_mul_ps(load_n(xo + i, m), inv);
            __m512 out;
            if constexpr (sizeof(W) == 4)
                out = _mm512_mul_ps(normed, _mm512_maskz_loadu_ps(m, w + i));
            else
                out = _mm512_mul_ps(load_n(w + i, m), round_bf16(normed));
            _mm256_mask_storeu_epi16(norm + r * ldn + i, m, narrow(out));
        }
    }
}

extern "C" void spindle_add_rms_norm(const uint16_t* x, long ldx, const uint16_t* h, long ldh, const uint16_t* w,
                                     uint16_t* x_out, long ldxo, uint16_t* norm, long ldn, int rows, int n,
                                     float eps, int threads) {
    add_rms_norm(x, ldx, h, ldh, w, x_out, ldxo, norm, ldn, rows, n, eps, threads);
}

extern "C" void spindle_add_rms_norm_f32w(const uint16_t* x, long ldx, const uint16_t* h, long ldh, const float* w,
                                          uint16_t* x_out, long ldxo, uint16_t* norm, long ldn, int rows, int n,
                                          float eps, int threads) {
    add_rms_norm(x, ldx, h, ldh, w, x_out, ldxo, norm, ldn, rows, n, eps, threads);
}

// Rotary embedding in place, the non-interleaved halves: for token t, head j of x (strides st, sh; d contiguous),
// x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)) with cos, sin [T, d/2] bf16 (row stride lc).
extern "C" void spindle_rope(uint16_t* x, long st, long sh, int tokens, int heads, int d, const uint16_t* cos,
                             const uint16_t* sin, long lc, int threads) {
    const int half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < tokens; ++t) {
        for (int j = 0; j < heads; ++j) {
            uint16_t* p = x + t * st + j * sh;
            for (int i = 0; i < half; i += 16) {
                const __mmask16 m = first(half - i);
                const __m512 c = load_n(cos + t * lc + i, m), s = load_n(sin + t * lc + i, m);
                const __m512 a = load_n(p + i, m), b = load_n(p + half + i, m);
                // first half: a cos - b sin; second: b cos + a sin (each product rounded, then the sum)
                const __m512 lo = _mm512_sub_ps(round_bf16(_mm512_mul_ps(a, c)), round_bf16(_mm512_mul_ps(b, s)));
                const __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(b, c)), round_bf16(_mm512_mul_ps(a, s)));
                _mm256_mask_storeu_epi16(p + i, m, narrow(lo));
                _mm256_mask_storeu_epi16(p + half + i, m, narrow(hi));
            }
        }
    }
}

// out [rows, n] = bf16(bf16(silu(gate)) * up) with gate = gu[:, :n], up = gu[:, n:2n] (row stride ldg).
extern "C" void spindle_silu_mul(const uint16_t* gu, long ldg, uint16_t* out, long ldo, int rows, int n,
                                 int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; ++r) {
        const uint16_t* g = gu + r * ldg;
        for (int i = 0; i < n; i += 16) {
            const __mmask16 m = first(n - i);
            const __m512 silu = spindle::silu_bf16(load_n(g + i, m));
            _mm256_mask_storeu_epi16(out + r * ldo + i, m, narrow(_mm512_mul_ps(silu, load_n(g + n + i, m))));
        }
    }
}

// out [rows, n] = bf16(bf16(gelu_tanh(gate)) * up), gate|up as spindle_silu_mul's: 0.5 x (1 + tanh(u)) with
// u = sqrt(2/pi) (x + 0.044715 x^3) in torch's order, tanh(|u|) = 1 - 2 / (e^(2|u|) + 1) (1 where torch's is).
extern "C" void spindle_gelu_tanh_mul(const uint16_t* gu, long ldg, uint16_t* out, long ldo, int rows, int n,
                                      int threads) {
    const __m512 beta = _mm512_set1_ps(0.7978845608028654f), kappa = _mm512_set1_ps(0.044715f);
    const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f), half = _mm512_set1_ps(0.5f);
    const __m512i sign = _mm512_set1_epi32(0x80000000);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; ++r) {
        const uint16_t* g = gu + r * ldg;
        for (int i = 0; i < n; i += 16) {
            const __mmask16 m = first(n - i);
            const __m512 x = load_n(g + i, m);
            const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
            const __m512 u = _mm512_mul_ps(beta, _mm512_add_ps(x, _mm512_mul_ps(kappa, cube)));
            const __m512 au = _mm512_abs_ps(u);
            __m512 t = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(spindle::exp512(_mm512_mul_ps(two, au)), one)));
            t = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t),
                                                    _mm512_and_si512(_mm512_castps_si512(u), sign)));
            const __m512 gelu = round_bf16(_mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, t)));
            _mm256_mask_storeu_epi16(out + r * ldo + i, m, narrow(_mm512_mul_ps(gelu, load_n(g + n + i, m))));
        }
    }
}
