// Decode attention over the paged KV cache in bfloat16 with AVX-512: one query token per sequence.
// Built and loaded by engine/cpu_kernels/build.py; called through engine/cpu_kernels/decode_attention.py.
//
// One task per (sequence, kv head): its query heads (GQA: no K/V repeated) read the sequence's keys block
// by block in place in the cache (no gather, no padding to the longest sequence), then a float32 softmax,
// then the weighted sum of values. Tasks go to OpenMP's threads as they come free (contexts differ).
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <vector>

namespace {

inline __m512 load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// e^x within a few float32 ulps: 2^n * e^r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial
inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // below: 0 (scalef underflows); -inf stays finite here
    x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

struct Args {
    const uint16_t* q;
    long q_sb, q_sh;
    int heads, kv_heads, d;
    const uint16_t* k;
    const uint16_t* v;
    long c_sblock, c_stok, c_shead;
    int block_size;
    const int32_t* tables;
    long table_stride;
    const int32_t* lens;
    const int32_t* los;
    float scale, softcap;
    uint16_t* out;
    long o_sb, o_sh;
};

constexpr int kMaxChunks = 16;  // head_dim up to 256, in chunks of 16 lanes

void task(const Args& a, int b, int kvh, std::vector<float>& scores) {
    const int group = a.heads / a.kv_heads, chunks = a.d / 16;
    const int lo = a.los[b], n = a.lens[b], keys = n - lo;
    if (keys <= 0) return;
    scores.resize((size_t)group * keys);
    const int32_t* table = a.tables + (long)b * a.table_stride;
    const long head_off = (long)kvh * a.c_shead;
    for (int g = 0; g < group; ++g) {
        const int h = kvh * group + g;
        const uint16_t* qp = a.q + (long)b * a.q_sb + (long)h * a.q_sh;
        __m512 qv[kMaxChunks];
        for (int c = 0; c < chunks; ++c) qv[c] = _mm512_mul_ps(load_bf16(qp + 16 * c), _mm512_set1_ps(a.scale));
        float* s = scores.data() + (long)g * keys;
        for (int t = lo; t < n; ++t) {
            const uint16_t* kp = a.k + (long)table[t / a.block_size] * a.c_sblock + (long)(t % a.block_size) * a.c_stok + head_off;
            __m512 acc = _mm512_mul_ps(qv[0], load_bf16(kp));
            for (int c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(qv[c], load_bf16(kp + 16 * c), acc);
            s[t - lo] = _mm512_reduce_add_ps(acc);
        }
        if (a.softcap > 0)
            for (int i = 0; i < keys; ++i) s[i] = a.softcap * tanhf(s[i] / a.softcap);
        // softmax over the row, in float32
        __m512 mx = _mm512_set1_ps(-INFINITY);
        int i = 0;
        for (; i + 16 <= keys; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + i));
        float m = _mm512_reduce_max_ps(mx);
        for (; i < keys; ++i) m = s[i] > m ? s[i] : m;
        __m512 sum = _mm512_setzero_ps();
        const __m512 mv = _mm512_set1_ps(m);
        for (i = 0; i + 16 <= keys; i += 16) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
            _mm512_storeu_ps(s + i, e);
            sum = _mm512_add_ps(sum, e);
        }
        if (i < keys) {
            const __mmask16 mask = (__mmask16)((1u << (keys - i)) - 1);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + i), mv));
            _mm512_mask_storeu_ps(s + i, mask, e);
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
        }
        const float inv = 1.0f / _mm512_reduce_add_ps(sum);
        for (i = 0; i < keys; ++i) s[i] *= inv;
    }
    // out[h] = sum_t p[h, t] v[t], every query head of the group over one read of each value row
    for (int g0 = 0; g0 < group; g0 += 4) {
        const int gn = group - g0 < 4 ? group - g0 : 4;
        __m512 acc[4][kMaxChunks];
        for (int g = 0; g < gn; ++g)
            for (int c = 0; c < chunks; ++c) acc[g][c] = _mm512_setzero_ps();
        for (int t = lo; t < n; ++t) {
            const uint16_t* vp = a.v + (long)table[t / a.block_size] * a.c_sblock + (long)(t % a.block_size) * a.c_stok + head_off;
            for (int c = 0; c < chunks; ++c) {
                const __m512 vv = load_bf16(vp + 16 * c);
                for (int g = 0; g < gn; ++g)
                    acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[(long)(g0 + g) * keys + t - lo]), vv, acc[g][c]);
            }
        }
        for (int g = 0; g < gn; ++g) {
            uint16_t* op = a.out + (long)b * a.o_sb + (long)(kvh * group + g0 + g) * a.o_sh;
            for (int c = 0; c < chunks; ++c)
                _mm256_storeu_si256((__m256i*)(op + 16 * c), (__m256i)_mm512_cvtneps_pbh(acc[g][c]));
        }
    }
}

}  // namespace

extern "C" int spindle_decode_attention_abi() { return 1; }

// q [B, heads, D] bf16 (strides q_sb, q_sh; D contiguous); k, v caches bf16 addressed as
// block * c_sblock + token * c_stok + kv_head * c_shead (+ d); tables int32 [B, table_stride]: each sequence's
// blocks from position 0; sequence b attends keys [los[b], lens[b]). softcap <= 0: none. out like q.
// D must be a multiple of 16, at most 256; heads a multiple of kv_heads.
extern "C" void spindle_decode_attention(const uint16_t* q, long q_sb, long q_sh, int batch, int heads,
                                         int kv_heads, int d, const uint16_t* k, const uint16_t* v,
                                         long c_sblock, long c_stok, long c_shead, int block_size,
                                         const int32_t* tables, long table_stride, const int32_t* lens,
                                         const int32_t* los, float scale, float softcap, uint16_t* out,
                                         long o_sb, long o_sh, int threads) {
    const Args a{q, q_sb, q_sh, heads, kv_heads, d, k, v, c_sblock, c_stok, c_shead, block_size,
                 tables, table_stride, lens, los, scale, softcap, out, o_sb, o_sh};
    const int tasks = batch * kv_heads;
#pragma omp parallel num_threads(threads)
    {
        static thread_local std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < tasks; ++i) task(a, i / kv_heads, i % kv_heads, scores);
    }
}
