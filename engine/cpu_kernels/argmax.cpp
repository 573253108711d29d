// The greedy sampler's pass over float32 logits: each row's first maximal column, as torch.argmax answers, in one
// streaming AVX-512 pass. torch's CPU argmax runs scalar, and the sampler's two-level amax read logits the LM head
// had just pushed out of cache twice (bench/README.md, "Greedy argmax in one pass"). Rows holding a NaN or
// +inf, or no finite value, are left to the caller (its careful path repairs them first).
// Built and loaded by engine/cpu_kernels/build.py; called through engine/cpu_kernels/argmax.py.
#include <immintrin.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

namespace {

constexpr long kAhead = 4096;  // bytes prefetched ahead: the logits are cold, just pushed out by the LM head's weights
constexpr int kChains = 4;  // independent (max, column) pairs per lane: the compare-and-blend chain is not the limit

struct Best {
    __m512 v;
    __m512i at;
};

// folds 16 values starting at column i (lanes past `take` read as -inf) into b; flags NaN and +inf in bad
inline void fold(Best& b, const float* p, long i, __mmask16 take, __mmask16& bad) {
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), take, p);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, b.v, _CMP_GT_OQ);  // strict: a lane keeps its first maximum
    b.v = _mm512_mask_mov_ps(b.v, gt, v);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    b.at = _mm512_mask_mov_epi32(b.at, gt, _mm512_add_epi32(lanes, _mm512_set1_epi32((int)i)));
    bad |= _mm512_cmp_ps_mask(v, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);  // NaN (unordered) or +inf
}

// row x[0, n): the first column holding its max, or -1 where it holds a NaN or +inf, or nothing above -inf
long argmax_row(const float* x, long n) {
    Best b[kChains];
    for (Best& c : b) c = Best{_mm512_set1_ps(-INFINITY), _mm512_set1_epi32(INT_MAX)};
    __mmask16 bad = 0;
    long i = 0;
    for (; i + 16 * kChains <= n; i += 16 * kChains)
        for (int c = 0; c < kChains; ++c) {
            _mm_prefetch((const char*)(x + i + 16 * c) + kAhead, _MM_HINT_T0);
            fold(b[c], x + i + 16 * c, i + 16 * c, 0xffff, bad);
        }
    for (; i < n; i += 16) fold(b[0], x + i, i, n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1), bad);
    for (int c = 1; c < kChains; ++c) {  // per lane: the larger value, on a tie the earlier column
        const __mmask16 take = _mm512_cmp_ps_mask(b[c].v, b[0].v, _CMP_GT_OQ) |
            (_mm512_cmp_ps_mask(b[c].v, b[0].v, _CMP_EQ_OQ) & _mm512_cmplt_epi32_mask(b[c].at, b[0].at));
        b[0].v = _mm512_mask_mov_ps(b[0].v, take, b[c].v);
        b[0].at = _mm512_mask_mov_epi32(b[0].at, take, b[c].at);
    }
    const float top = _mm512_reduce_max_ps(b[0].v);
    if (bad || !(top > -INFINITY)) return -1;
    return _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(b[0].v, _mm512_set1_ps(top), _CMP_EQ_OQ), b[0].at);
}

}  // namespace

extern "C" int spindle_argmax_abi() { return 1; }

// x [rows, n] float32 (row stride ld, n < 2^31): idx[r] = the first column of row r's max. Returns how many rows
// were left undecided (idx -1): those holding a NaN or +inf, or nothing above -inf.
extern "C" int spindle_argmax(const float* x, long ld, int rows, long n, int64_t* idx, int threads) {
    int undecided = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : undecided)
    for (int r = 0; r < rows; ++r) {
        idx[r] = argmax_row(x + r * ld, n);
        undecided += idx[r] < 0;
    }
    return undecided;
}
