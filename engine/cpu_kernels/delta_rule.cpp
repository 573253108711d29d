// The gated delta rule's decode update (one token per sequence) with AVX-512, each state advanced in place at its slot
// in one pass: S = g S; kv = S^T k; S += k (beta (v - kv))^T; o = S^T q. torch's form reads each float32 d_k x d_v
// state about five times (bench/README.md, "Hybrid decode against the memory bound"); here a block of up to 128
// columns is read once for g S and kv (its columns' kv need only those columns), then updated and reduced against q
// while it is still in L1/L2, so memory sees each state read once and written once.
// q and k are l2-normed in float32 (eps 1e-6 inside the rsqrt) and q scaled by 1/sqrt(d_k), as transformers'
// torch_recurrent_gated_delta_rule; a key head serves hv / hk consecutive value heads (no repeat).
// Built and loaded by engine/cpu_kernels/build.py; called through engine/cpu_kernels/delta_rule.py.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"

namespace {

constexpr int kMaxDk = 1024;  // the normed q and k of one head live on the stack
constexpr int kBlock = 8;     // zmm per column block: 128 columns, 24 accumulators with kv, delta and o
constexpr int kAhead = 8;     // rows prefetched ahead in the first pass (4 KB at d_v 128): the states are cold

struct Args {
    const void* q;
    long q_sb, q_sh;
    const void* k;
    long k_sb, k_sh;
    const void* v;
    long v_sb, v_sh;
    int bf16;  // q, k, v and out: 1 bfloat16, 0 float32
    const float* g;
    const float* beta;  // [B, hv] each, contiguous
    float* states;
    long s_slot, s_head;  // a head's state: dk rows of dv contiguous floats
    const int64_t* slots;
    void* out;
    long o_sb, o_sh;
    int hk, hv, dk, dv;
};

inline __m512 load_row(const void* p, long at, __mmask16 m, int bf16) {
    return bf16 ? spindle::load_bf16_n((const uint16_t*)p + at, m) : _mm512_maskz_loadu_ps(m, (const float*)p + at);
}

inline void store_row(void* p, long at, __mmask16 m, int bf16, __m512 x) {
    if (bf16)
        _mm256_mask_storeu_epi16((uint16_t*)p + at, m, spindle::narrow(x));
    else
        _mm512_mask_storeu_ps((float*)p + at, m, x);
}

// x (n values at p + at, bf16 or float32) l2-normed in float32 and times `scale`, into dst
void normed(const void* p, long at, int n, int bf16, float scale, float* dst) {
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = spindle::first_lanes(n - i);
        const __m512 x = load_row(p, at + i, m, bf16);
        _mm512_mask_storeu_ps(dst + i, m, x);
        ss = _mm512_fmadd_ps(x, x, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) + 1e-6f));
    const __m512 s = _mm512_set1_ps(scale);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = spindle::first_lanes(n - i);
        _mm512_mask_storeu_ps(dst + i, m, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, dst + i), inv), s));
    }
}

// Columns [j0, j0 + 16 NZ) of one head's state S (dk rows, row stride dv; lanes past `last` in the last zmm
// untouched): decay, kv, delta, the rank-1 update and o for those columns.
template <int NZ>
void column_block(float* S, const Args& a, int j0, __mmask16 last, const float* kn, const float* qn, float decay,
                  float beta, const void* v, long v_at, void* out, long o_at) {
    const long ld = a.dv;
    const __m512 gd = _mm512_set1_ps(decay);
    __m512 kv[NZ];
    for (int c = 0; c < NZ; ++c) kv[c] = _mm512_setzero_ps();
    for (int i = 0; i < a.dk; ++i) {
        float* r = S + i * ld + j0;
        if (i + kAhead < a.dk)
            for (int c = 0; c < NZ; ++c) _mm_prefetch((const char*)(r + kAhead * ld + 16 * c), _MM_HINT_T0);
        const __m512 ki = _mm512_set1_ps(kn[i]);
        for (int c = 0; c < NZ; ++c) {
            const __mmask16 m = c == NZ - 1 ? last : (__mmask16)0xFFFF;
            kv[c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, r + 16 * c), gd), ki, kv[c]);
        }
    }
    __m512 delta[NZ], o[NZ];
    const __m512 b = _mm512_set1_ps(beta);
    for (int c = 0; c < NZ; ++c) {
        const __mmask16 m = c == NZ - 1 ? last : (__mmask16)0xFFFF;
        delta[c] = _mm512_mul_ps(_mm512_sub_ps(load_row(v, v_at + j0 + 16 * c, m, a.bf16), kv[c]), b);
        o[c] = _mm512_setzero_ps();
    }
    for (int i = 0; i < a.dk; ++i) {  // the block again, from cache: S = g S + k_i delta, o += S_i q_i
        float* r = S + i * ld + j0;
        const __m512 ki = _mm512_set1_ps(kn[i]), qi = _mm512_set1_ps(qn[i]);
        for (int c = 0; c < NZ; ++c) {
            const __mmask16 m = c == NZ - 1 ? last : (__mmask16)0xFFFF;
            const __m512 s = _mm512_fmadd_ps(ki, delta[c], _mm512_mul_ps(_mm512_maskz_loadu_ps(m, r + 16 * c), gd));
            _mm512_mask_storeu_ps(r + 16 * c, m, s);
            o[c] = _mm512_fmadd_ps(s, qi, o[c]);
        }
    }
    for (int c = 0; c < NZ; ++c) store_row(out, o_at + j0 + 16 * c, c == NZ - 1 ? last : (__mmask16)0xFFFF, a.bf16, o[c]);
}

using BlockFn = void (*)(float*, const Args&, int, __mmask16, const float*, const float*, float, float, const void*,
                         long, void*, long);
constexpr BlockFn kBlocks[kBlock] = {column_block<1>, column_block<2>, column_block<3>, column_block<4>,
                                     column_block<5>, column_block<6>, column_block<7>, column_block<8>};

// sequence b, value head h: its q and k normed, then its state block by block
void head(const Args& a, int b, int h) {
    alignas(64) float kn[kMaxDk], qn[kMaxDk];
    const int kh = h / (a.hv / a.hk);
    normed(a.k, b * a.k_sb + kh * a.k_sh, a.dk, a.bf16, 1.0f, kn);
    normed(a.q, b * a.q_sb + kh * a.q_sh, a.dk, a.bf16, 1.0f / sqrtf((float)a.dk), qn);
    const float decay = expf(a.g[(long)b * a.hv + h]), beta = a.beta[(long)b * a.hv + h];
    float* S = a.states + a.slots[b] * a.s_slot + h * a.s_head;
    for (int j0 = 0; j0 < a.dv; j0 += 16 * kBlock) {
        const int cols = a.dv - j0 < 16 * kBlock ? a.dv - j0 : 16 * kBlock;
        const int nz = (cols + 15) / 16;
        const __mmask16 last = spindle::first_lanes(cols - 16 * (nz - 1));
        kBlocks[nz - 1](S, a, j0, last, kn, qn, decay, beta, a.v, b * a.v_sb + h * a.v_sh, a.out,
                        b * a.o_sb + h * a.o_sh);
    }
}

}  // namespace

extern "C" int spindle_delta_rule_abi() { return 1; }

// q, k [B, hk, dk] and v, out [B, hv, dv] (strides per sequence and head, the last dim contiguous; bf16 or float32
// as `bf16` says), g (the log decay) and beta float32 [B, hv], states float32 [slots, hv, dk, dv] (strides per slot
// and head, each head's dk x dv contiguous), slots int64 [B] (distinct): out = the rows' outputs, each row's state
// advanced in place at its slot. One task per (sequence, value head); dk <= 1024.
extern "C" void spindle_delta_rule(const void* q, long q_sb, long q_sh, const void* k, long k_sb, long k_sh,
                                   const void* v, long v_sb, long v_sh, int bf16, const float* g, const float* beta,
                                   float* states, long s_slot, long s_head, const int64_t* slots, void* out, long o_sb,
                                   long o_sh, int batch, int hk, int hv, int dk, int dv, int threads) {
    const Args a{q,   q_sb,   q_sh,  k,    k_sb, k_sh, v,    v_sb, v_sh, bf16, g,  beta,
                 states, s_slot, s_head, slots, out,  o_sb, o_sh, hk,   hv,   dk,   dv};
    const int tasks = batch * hv;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < tasks; ++t) head(a, t / hv, t % hv);
}
