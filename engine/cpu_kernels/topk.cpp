// The top-k sampler's candidates over float32 logits: each row's k largest values and their columns, in one
// streaming AVX-512 pass. torch's CPU topk costs ~0.8 ms on a 262,144-column row (Gemma's vocabulary), most of
// a decode step's sampling; here a running threshold (the k-th largest seen so far) rejects 16 columns per compare,
// and the few that pass are appended to a small buffer that is cut back to k whenever it fills.
// Ties keep the smaller column. Rows with fewer than k values above -inf are left to the caller (torch.topk).
// Built and loaded by engine/cpu_kernels/build.py; called through engine/cpu_kernels/topk.py.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

namespace {

struct Cand {
    float v;
    int at;
};

inline bool before(const Cand& a, const Cand& b) { return a.v > b.v || (a.v == b.v && a.at < b.at); }

// row x[0, n): its k best (value descending, then column ascending) into vals / idx; false where the row has
// fewer than k values above -inf
bool topk_row(const float* x, long n, int k, float* vals, int64_t* idx) {
    const long cap = 8L * k + 64;  // cut back to k when full: a cut per (cap - k) passing columns
    std::vector<float> bv(cap + 16);
    std::vector<int> bi(cap + 16);
    long used = 0;
    float t = -INFINITY;  // strict: a column must beat the k-th best kept so far (ties keep the earlier one)
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    auto cut = [&]() {
        std::vector<Cand> c(used);
        for (long j = 0; j < used; ++j) c[j] = Cand{bv[j], bi[j]};
        std::nth_element(c.begin(), c.begin() + (k - 1), c.end(), before);
        // everything before position k-1 is at least as good; keep those k
        for (int j = 0; j < k; ++j) bv[j] = c[j].v, bi[j] = c[j].at;
        t = c[k - 1].v;
        used = k;
    };
    for (long i = 0; i < n; i += 16) {
        const __mmask16 take = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), take, x + i);
        const __mmask16 pass = _mm512_cmp_ps_mask(v, _mm512_set1_ps(t), _CMP_GT_OQ);
        if (!pass) continue;
        _mm512_mask_compressstoreu_ps(bv.data() + used, pass, v);
        _mm512_mask_compressstoreu_epi32(bi.data() + used, pass, _mm512_add_epi32(lanes, _mm512_set1_epi32((int)i)));
        used += __builtin_popcount(pass);
        if (used >= cap) cut();
    }
    if (used < k) return false;
    std::vector<Cand> c(used);
    for (long j = 0; j < used; ++j) c[j] = Cand{bv[j], bi[j]};
    std::partial_sort(c.begin(), c.begin() + k, c.end(), before);
    for (int j = 0; j < k; ++j) vals[j] = c[j].v, idx[j] = c[j].at;
    return true;
}

}  // namespace

extern "C" int spindle_topk_abi() { return 1; }

// x [rows, n] float32 (row stride ld, n < 2^31, no NaN or +inf: the sampler repairs those first), 0 < k <= n:
// vals / idx [rows, k] the k largest of each row, descending, ties by column. Returns how many rows were left
// undecided (fewer than k values above -inf; their outputs are unspecified).
extern "C" int spindle_topk(const float* x, long ld, int rows, long n, int k, float* vals, int64_t* idx, int threads) {
    int undecided = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : undecided)
    for (int r = 0; r < rows; ++r) undecided += !topk_row(x + r * ld, n, k, vals + (long)r * k, idx + (long)r * k);
    return undecided;
}
