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

#include "scratch.h"
#include "simd.h"

namespace {

using spindle::exp512;
using spindle::load_bf16;



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

// A sequence's rows (of K or V, one KV head) in order through its block table: a pointer step per row, the
// table read once per block, and only for a block a row is asked of (never past the table's end).
struct Rows {
    const uint16_t* base;
    const int32_t* table;
    long c_sblock, c_stok, head_off;
    int block_size, blk, left;
    const uint16_t* row;
    Rows(const Args& a, const uint16_t* cache, const int32_t* t, long h, int from)
        : base(cache), table(t), c_sblock(a.c_sblock), c_stok(a.c_stok), head_off(h), block_size(a.block_size),
          blk(from / a.block_size), left(a.block_size - from % a.block_size),
          row(cache + (long)t[from / a.block_size] * a.c_sblock + (long)(from % a.block_size) * a.c_stok + h) {}
    const uint16_t* next() {  // the current row, then step to the next
        if (left == 0) {
            ++blk;
            left = block_size;
            row = base + (long)table[blk] * c_sblock + head_off;
        }
        --left;
        const uint16_t* r = row;
        row += c_stok;
        return r;
    }
};

// Rows sit in blocks scattered through the cache: the hardware's prefetcher stops at each block's end, so the
// kernel asks for rows this many keys ahead itself, into L2: L1 has too few fill buffers to keep enough lines of
// scattered blocks in flight (bench/README.md, "Decode attention kernel").
constexpr int kAheadKeys = 64;

inline void prefetch_row(const uint16_t* row, int elements) {  // every 64-byte line the row's bf16 touch
    const uintptr_t end = (uintptr_t)(row + elements);
    for (uintptr_t at = (uintptr_t)row & ~(uintptr_t)63; at < end; at += 64) _mm_prefetch((const char*)at, _MM_HINT_T1);
}

// The scores of GN query heads over 16 keys: kt[p] holds pair p of k (two bf16) for each key, lane j key j; q
// (pairs as 32-bit words, head g at q + g * ldq). Each head's 16 sums build up lane by lane, no fold: the bf16
// products are exact and summed in float32 (vdpbf16ps) in two chains, even and odd pairs, then added.
template <int GN, int PAIRS>
void heads_of(const __m512i* kt, const uint32_t* q, long ldq, __m512 scale, float* s, long keys, __mmask16 mask) {
    __m512 even[GN], odd[GN];
    for (int g = 0; g < GN; ++g) even[g] = odd[g] = _mm512_setzero_ps();
    for (int p = 0; p < 16 * PAIRS; p += 2) {
        const __m512bh k0 = (__m512bh)kt[p], k1 = (__m512bh)kt[p + 1];
        for (int g = 0; g < GN; ++g) {
            even[g] = _mm512_dpbf16_ps(even[g], (__m512bh)_mm512_set1_epi32((int)q[g * ldq + p]), k0);
            odd[g] = _mm512_dpbf16_ps(odd[g], (__m512bh)_mm512_set1_epi32((int)q[g * ldq + p + 1]), k1);
        }
    }
    for (int g = 0; g < GN; ++g)
        _mm512_mask_storeu_ps(s + g * keys, mask, _mm512_mul_ps(_mm512_add_ps(even[g], odd[g]), scale));
}

constexpr int kHeadsPerScorePass = 8;  // two chains of sums per head stay in registers

// scores[g][t - lo] = scale * q_g . k_t, 16 keys at a time: their rows are transposed in registers (pairs of k
// across keys), then every query head of the group reads them. PAIRS (head_dim / 32) is a constant so that the
// transposed keys are an array the compiler lays out.
template <int PAIRS>
void scores_of(const Args& a, int b, int kvh, int lo, int n, float* scores) {
    const int group = a.heads / a.kv_heads, keys = n - lo;
    const int32_t* table = a.tables + (long)b * a.table_stride;
    const long head_off = (long)kvh * a.c_shead;
    const __m512 scale = _mm512_set1_ps(a.scale);
    const uint32_t* q = (const uint32_t*)(a.q + (long)b * a.q_sb + (long)kvh * group * a.q_sh);
    const long ldq = a.q_sh / 2;
    Rows walk(a, a.k, table, head_off, lo), ahead(a, a.k, table, head_off, lo);
    for (int t = lo; t < n && t < lo + kAheadKeys; ++t) prefetch_row(ahead.next(), 32 * PAIRS);
    __m512i kt[16 * PAIRS];
    for (int t0 = lo; t0 < n; t0 += 16) {
        const int count = n - t0 < 16 ? n - t0 : 16;
        const uint16_t* krow[16];
        for (int j = 0; j < count; ++j) krow[j] = walk.next();
        for (int j = count; j < 16; ++j) krow[j] = krow[0];  // lanes past the end: computed, never stored
        for (int t = t0 + kAheadKeys; t < n && t < t0 + 16 + kAheadKeys; ++t) prefetch_row(ahead.next(), 32 * PAIRS);
        for (int c = 0; c < PAIRS; ++c) {  // 16 pairs of every key at a time
            for (int j = 0; j < 16; ++j) kt[16 * c + j] = _mm512_loadu_si512(krow[j] + 32 * c);
            spindle::transpose16(kt + 16 * c);
        }
        const __mmask16 mask = spindle::first_lanes(count);
        for (int g0 = 0; g0 < group; g0 += kHeadsPerScorePass) {
            const int gn = group - g0 < kHeadsPerScorePass ? group - g0 : kHeadsPerScorePass;
            float* s = scores + (long)g0 * keys + (t0 - lo);
            switch (gn) {
#define HEADS(G) case G: heads_of<G, PAIRS>(kt, q + g0 * ldq, ldq, scale, s, keys, mask); break;
                HEADS(1) HEADS(2) HEADS(3) HEADS(4) HEADS(5) HEADS(6) HEADS(7) HEADS(8)
#undef HEADS
            }
        }
    }
}

void scores_any(const Args& a, int b, int kvh, int lo, int n, float* scores) {
    switch (a.d / 32) {
#define PAIRS(P) case P: scores_of<P>(a, b, kvh, lo, n, scores); return;
        PAIRS(1) PAIRS(2) PAIRS(3) PAIRS(4) PAIRS(5) PAIRS(6) PAIRS(7) PAIRS(8)
#undef PAIRS
    }
}

// out[g0 + g][16 c0 .. 16 (c0 + CN)] = sum_t p[g][t] v[t] for GN query heads of one KV head: each value row is
// widened once for all GN heads; GN * CN sums stay in registers (both constants).
template <int GN, int CN>
void values_of(const Args& a, const int32_t* table, long head_off, int lo, int n, const float* p, long keys,
               int c0, uint16_t* out, long o_sh) {
    __m512 acc[GN][CN];
    for (int g = 0; g < GN; ++g)
        for (int c = 0; c < CN; ++c) acc[g][c] = _mm512_setzero_ps();
    Rows walk(a, a.v + 16 * c0, table, head_off, lo), ahead(a, a.v + 16 * c0, table, head_off, lo);
    for (int t = 0; t < n - lo && t < kAheadKeys; ++t) prefetch_row(ahead.next(), 16 * CN);
    for (int t = 0; t < n - lo; ++t) {
        if (t + kAheadKeys < n - lo) prefetch_row(ahead.next(), 16 * CN);
        const uint16_t* vp = walk.next();
        for (int c = 0; c < CN; ++c) {  // one chunk of the row live at a time: GN * CN sums, a value, a weight
            const __m512 v = load_bf16(vp + 16 * c);
            for (int g = 0; g < GN; ++g) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * keys + t]), v, acc[g][c]);
        }
    }
    for (int g = 0; g < GN; ++g)
        for (int c = 0; c < CN; ++c)
            _mm256_storeu_si256((__m256i*)(out + g * o_sh + 16 * (c0 + c)), (__m256i)_mm512_cvtneps_pbh(acc[g][c]));
}

constexpr int kHeadsAtOnce = 8;  // query heads per pass over the values (the rest in further passes)

template <int GN>
void values_cols(const Args& a, const int32_t* table, long head_off, int lo, int n, const float* p, long keys,
                 int c0, int cn, uint16_t* out, long o_sh) {
    switch (cn) {  // up to 28 sums: 1 to 4 chunks of 16 columns at once (4 only for GN <= 7, as values_any
                   // passes it: the clamp keeps wider tiles from being instantiated)
        case 4: values_of<GN, (GN <= 7 ? 4 : 1)>(a, table, head_off, lo, n, p, keys, c0, out, o_sh); return;
        case 3: values_of<GN, 3>(a, table, head_off, lo, n, p, keys, c0, out, o_sh); return;
        case 2: values_of<GN, 2>(a, table, head_off, lo, n, p, keys, c0, out, o_sh); return;
        default: values_of<GN, 1>(a, table, head_off, lo, n, p, keys, c0, out, o_sh); return;
    }
}

void values_any(const Args& a, const int32_t* table, long head_off, int lo, int n, const float* p, long keys,
                int gn, int chunks, uint16_t* out, long o_sh) {
    const int most = gn <= 7 ? 4 : 3;  // chunks per pass: gn * most <= 28
    for (int c0 = 0; c0 < chunks; c0 += most) {
        const int cn = chunks - c0 < most ? chunks - c0 : most;
        switch (gn) {
#define HEADS(G) case G: values_cols<G>(a, table, head_off, lo, n, p, keys, c0, cn, out, o_sh); break;
            HEADS(1) HEADS(2) HEADS(3) HEADS(4) HEADS(5) HEADS(6) HEADS(7) HEADS(8)
#undef HEADS
        }
    }
}

void task(const Args& a, int b, int kvh, std::vector<float>& scores) {
    const int group = a.heads / a.kv_heads, chunks = a.d / 16;
    const int lo = a.los[b], n = a.lens[b], keys = n - lo;
    if (keys <= 0) return;
    spindle::grow(scores, (size_t)group * keys);
    const int32_t* table = a.tables + (long)b * a.table_stride;
    const long head_off = (long)kvh * a.c_shead;
    scores_any(a, b, kvh, lo, n, scores.data());
    for (int g = 0; g < group; ++g) {
        float* s = scores.data() + (long)g * keys;
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
    // out[h] = sum_t p[h, t] v[t]: up to kHeadsAtOnce query heads of the group per pass over the values
    for (int g0 = 0; g0 < group; g0 += kHeadsAtOnce) {
        const int gn = group - g0 < kHeadsAtOnce ? group - g0 : kHeadsAtOnce;
        uint16_t* op = a.out + (long)b * a.o_sb + (long)(kvh * group + g0) * a.o_sh;
        values_any(a, table, head_off, lo, n, scores.data() + (long)g0 * keys, keys, gn, chunks, op, a.o_sh);
    }
}

}  // namespace

extern "C" int spindle_decode_attention_abi() { return 2; }

// q [B, heads, D] bf16 (strides q_sb, q_sh; D contiguous); k, v caches bf16 addressed as
// block * c_sblock + token * c_stok + kv_head * c_shead (+ d); tables int32 [B, table_stride]: each sequence's
// blocks from position 0; sequence b attends keys [los[b], lens[b]). softcap <= 0: none. out like q.
// D must be a multiple of 32, at most 256; heads a multiple of kv_heads.
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
