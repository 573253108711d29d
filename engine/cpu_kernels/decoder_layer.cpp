// One decoder layer of a decode step in one call: the kernels of this package in the order the model runs them
// (engine/models/decoder.py), without a trip through Python between them. Projections are packed bf16 weights
// (gemm_bf16.cpp, or gemm_amx.cpp's tiles) or a GGUF file's blocks (quant_gemm.cpp, called through the step's pointer to it, which keeps
// the two libraries apart). Dense layers only: fused q|k|v,
// optional per-head q/k norms, rotary over the whole head (the layer's table: global or local), SiLU- or
// GELU-tanh-gated MLP, Gemma's norms (float32 (1 + w) weights, rounded once; one closing each sub-block). Each step rounds as the separate
// calls do, so the result is bitwise theirs (tests/engine/models/test_fused_decode.py).
// Built and loaded by engine/cpu_kernels/build.py; called through engine/cpu_kernels/decoder_layer.py.
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "scratch.h"

extern "C" {
void spindle_gemm_bf16(const uint16_t* x, long ldx, int M, int K, const void* w, const float* scale, int N,
                       const uint16_t* bias, uint16_t* y, long ldy, float* yf, long ldyf, int threads);
int spindle_gemm_bf16_silu(const uint16_t* x, long ldx, int M, int K, const void* w, const float* scale, int N,
                           const uint16_t* bias, uint16_t* act, long ldact, int threads);
void spindle_add_rms_norm(const uint16_t* x, long ldx, const uint16_t* h, long ldh, const uint16_t* w,
                          uint16_t* x_out, long ldxo, uint16_t* norm, long ldn, int rows, int n, float eps, int threads);
void spindle_rope(uint16_t* x, long st, long sh, int tokens, int heads, int d, const uint16_t* cos,
                  const uint16_t* sin, long lc, int threads);
int spindle_gemm_amx(const uint16_t* x, long ldx, int M, int K, const uint16_t* w, int N, const uint16_t* bias,
                     uint16_t* y, long ldy, float* yf, long ldyf, int threads);
void spindle_silu_mul(const uint16_t* gu, long ldg, uint16_t* out, long ldo, int rows, int n, int threads);
void spindle_gelu_tanh_mul(const uint16_t* gu, long ldg, uint16_t* out, long ldo, int rows, int n, int threads);
void spindle_add_rms_norm_f32w(const uint16_t* x, long ldx, const uint16_t* h, long ldh, const float* w,
                               uint16_t* x_out, long ldxo, uint16_t* norm, long ldn, int rows, int n, float eps,
                               int threads);
void spindle_decode_attention(const uint16_t* q, long q_sb, long q_sh, int batch, int heads, int kv_heads, int d,
                              const uint16_t* k, const uint16_t* v, long c_sblock, long c_stok, long c_shead,
                              int block_size, const int32_t* tables, long table_stride, const int32_t* lens,
                              const int32_t* los, float scale, float softcap, uint16_t* out, long o_sb, long o_sh,
                              int threads);
}

namespace {

struct Projection {  // a PackedWeight (w packed as gemm_bf16.cpp says) or GGUF blocks; n outputs, k inputs
    const void* w;
    const float* scale;  // int8 weights' scales, else null
    const uint16_t* bias;
    int n, k;
    int ggml_type;   // -1: packed bf16; -2: packed for AMX tiles (gemm_amx.cpp); else rows of ggml blocks
    long row_bytes;
};

// quant_gemm.cpp's spindle_quant_gemm
using QuantGemm = int (*)(int type, const void* x, int x_bf16, long ldx, int M, int K, const uint8_t* w, long rb,
                          int N, void* y, int y_bf16, long ldy, int threads);

}  // namespace

extern "C" {

struct SpindleLayer {  // static, built at load (engine/cpu_kernels/decoder_layer.py mirrors it)
    Projection qkv[3], o, gate_up[2], down;  // q|k|v and gate|up: their parts (types differing in a GGUF file)
    const void* ln2;        // the norm before the MLP (norm weights: bf16, or float32 where f32_norms)
    const void* next_ln1;   // the next layer's input norm; null for the last layer
    const void* q_norm;     // per-head norms (Qwen3, Gemma 3) or null
    const void* k_norm;
    const void* post_attn;  // Gemma's norms of the attention's and the MLP's outputs, or null
    const void* post_ff;
    const uint16_t* k_cache;   // this layer's caches, addressed as the step's strides say
    const uint16_t* v_cache;
    const int32_t* los;        // each sequence's first visible key under this layer's window
    int heads, kv_heads, head_dim, hidden;
    float eps, scale, softcap;  // softcap <= 0: none
    int f32_norms;  // Gemma: norm weights float32 holding (1 + w), each norm rounded once
    int gelu;       // the MLP's activation: 1 gelu_tanh, 0 SiLU
    int rope;       // the layer's rope table: 0 the step's cos / sin, 1 its local ones (Gemma 3's windowed layers)
    int qkv_parts, gate_up_parts;  // how many of qkv[], gate_up[] hold parts, each into its columns
};

struct SpindleStep {  // per step
    int tokens;
    const uint16_t* cos;  // [T, head_dim / 2]
    const uint16_t* sin;
    const int64_t* slots;  // [T] where each new K/V goes: block * block_size + offset
    const int32_t* tables;
    long table_stride;
    const int32_t* lens;
    long c_sblock, c_stok, c_shead;
    int block_size;
    int threads;           // the step's threads for products big enough (engine/layers/parallel.py's rule)
    long parallel_macs, parallel_bytes;
    QuantGemm quant_gemm;  // for projections of GGUF blocks; null where there are none
    const uint16_t* cos_local;  // [T, head_dim / 2] the local rope table's, or null
    const uint16_t* sin_local;
};

int spindle_decoder_layer_abi() { return 4; }

// The structs' sizes and last fields' offsets: decoder_layer.py checks its ctypes mirror against them at load.
void spindle_decoder_layer_layout(long* out) {
    out[0] = sizeof(Projection);
    out[1] = offsetof(Projection, row_bytes);
    out[2] = sizeof(SpindleLayer);
    out[3] = offsetof(SpindleLayer, gate_up_parts);
    out[4] = sizeof(SpindleStep);
    out[5] = offsetof(SpindleStep, sin_local);
}

}  // extern "C"

namespace {

constexpr int kAmx = -2;

int pick(const SpindleStep& s, long macs, long bytes) {
    return macs >= s.parallel_macs || bytes >= s.parallel_bytes ? s.threads : 1;
}

constexpr long kQuantWork = 16;  // engine/layers/parallel.py's QUANT_WORK: blocks decode in registers

int threads_for(const SpindleStep& s, const Projection& p) {
    const long bytes = p.ggml_type >= 0 ? p.row_bytes * p.n : (p.scale ? 1L : 2L) * p.n * p.k;  // AMX: bf16
    return pick(s, (long)s.tokens * p.n * p.k * (p.ggml_type >= 0 ? kQuantWork : 1), bytes);
}

float widen(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t round_bf16(float f) {  // to nearest even, as torch's float32 -> bfloat16 copy (a NaN stays a NaN)
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// y [T, ldy] (its first p.n columns) = x [T, p.k] @ p's weight
void project(const SpindleStep& s, const Projection& p, const uint16_t* x, uint16_t* y, long ldy) {
    if (p.ggml_type == kAmx) {  // its tiles were granted when the layer was built (FusedDecode checks)
        spindle_gemm_amx(x, p.k, s.tokens, p.k, (const uint16_t*)p.w, p.n, p.bias, y, ldy, nullptr, 0,
                         threads_for(s, p));
        return;
    }
    if (p.ggml_type < 0) {
        spindle_gemm_bf16(x, p.k, s.tokens, p.k, p.w, p.scale, p.n, p.bias, y, ldy, nullptr, 0, threads_for(s, p));
        return;
    }
    const uint8_t* w = (const uint8_t*)p.w;
    if (!p.bias) {  // the kernel rounds its float32 sums to bf16 itself
        s.quant_gemm(p.ggml_type, x, 1, p.k, s.tokens, p.k, w, p.row_bytes, p.n, y, 1, ldy, threads_for(s, p));
        return;
    }
    // float32 sums, the bias added, one rounding: as engine/layers/quant_linear.py's path with a bias
    static thread_local std::vector<float> wide_buf;
    float* wide = spindle::grow(wide_buf, (long)s.tokens * p.n);
    s.quant_gemm(p.ggml_type, x, 1, p.k, s.tokens, p.k, w, p.row_bytes, p.n, wide, 0, p.n, threads_for(s, p));
    for (long t = 0; t < s.tokens; ++t)
        for (int i = 0; i < p.n; ++i) y[t * ldy + i] = round_bf16(wide[t * p.n + i] + widen(p.bias[i]));
}

int width(const Projection* parts, int count) {
    int n = 0;
    for (int i = 0; i < count; ++i) n += parts[i].n;
    return n;
}

// y [T, width]: each part's product into its columns, as engine/layers/quant_linear.py's QuantPartsLinear
void project_parts(const SpindleStep& s, const Projection* parts, int count, const uint16_t* x, uint16_t* y) {
    const int n = width(parts, count);
    for (int i = 0, at = 0; i < count; at += parts[i++].n) project(s, parts[i], x, y + at, n);
}

// x_out = x + h (h null: x), norm = x_out normed by w (norm may be x_out): the layer's kind of norm, rows of n
void add_norm(const SpindleLayer& l, const uint16_t* x, const uint16_t* h, const void* w, uint16_t* x_out,
              uint16_t* norm, int rows, int n, int threads) {
    if (l.f32_norms)
        spindle_add_rms_norm_f32w(x, n, h, n, (const float*)w, x_out, n, norm, n, rows, n, l.eps, threads);
    else
        spindle_add_rms_norm(x, n, h, n, (const uint16_t*)w, x_out, n, norm, n, rows, n, l.eps, threads);
}

}  // namespace

// x [T, hidden]: the residual stream, updated in place; normed [T, hidden]: this layer's input norm of x on the way
// in, the next layer's on the way out (untouched after the last layer, whose x the final norm reads).
extern "C" void spindle_decoder_layer(const SpindleLayer* L, const SpindleStep* S, uint16_t* x, uint16_t* normed) {
    static thread_local std::vector<uint16_t> qkv_buf, attn_buf, h_buf, gu_buf, act_buf;
    const SpindleLayer& l = *L;
    const SpindleStep& s = *S;
    const int t_n = s.tokens, d = l.head_dim, qn = width(l.qkv, l.qkv_parts), inter = l.down.k;
    const long q_size = (long)l.heads * d, kv_size = (long)l.kv_heads * d;
    uint16_t* qkv = spindle::grow(qkv_buf, (long)t_n * qn);
    uint16_t* attn = spindle::grow(attn_buf, t_n * q_size);
    uint16_t* h = spindle::grow(h_buf, (long)t_n * l.hidden);
    uint16_t* gu = spindle::grow(gu_buf, 2L * t_n * inter);
    uint16_t* act = spindle::grow(act_buf, (long)t_n * inter);
    const int small = pick(s, 0, 4L * t_n * qn);

    project_parts(s, l.qkv, l.qkv_parts, normed, qkv);
    if (l.q_norm)  // per head, in place: rows of head_dim
        for (int t = 0; t < t_n; ++t) {
            uint16_t* q = qkv + (long)t * qn;
            add_norm(l, q, nullptr, l.q_norm, q, q, l.heads, d, 1);
            add_norm(l, q + q_size, nullptr, l.k_norm, q + q_size, q + q_size, l.kv_heads, d, 1);
        }
    const uint16_t* cos = l.rope ? s.cos_local : s.cos;
    const uint16_t* sin = l.rope ? s.sin_local : s.sin;
    spindle_rope(qkv, qn, d, t_n, l.heads, d, cos, sin, d / 2, small);
    spindle_rope(qkv + q_size, qn, d, t_n, l.kv_heads, d, cos, sin, d / 2, small);
    for (int t = 0; t < t_n; ++t) {  // the new K and V into their slots
        const long slot = s.slots[t];
        const long at = slot / s.block_size * s.c_sblock + slot % s.block_size * s.c_stok;
        for (int j = 0; j < l.kv_heads; ++j) {
            memcpy((uint16_t*)l.k_cache + at + j * s.c_shead, qkv + (long)t * qn + q_size + j * d, 2L * d);
            memcpy((uint16_t*)l.v_cache + at + j * s.c_shead, qkv + (long)t * qn + q_size + kv_size + j * d, 2L * d);
        }
    }
    long keys = 0;
    for (int t = 0; t < t_n; ++t) keys += s.lens[t] - l.los[t];
    spindle_decode_attention(qkv, qn, d, t_n, l.heads, l.kv_heads, d, l.k_cache, l.v_cache, s.c_sblock, s.c_stok,
                             s.c_shead, s.block_size, s.tables, s.table_stride, s.lens, l.los, l.scale, l.softcap,
                             attn, q_size, d, pick(s, 2 * keys * q_size, 4 * keys * kv_size));
    project(s, l.o, attn, h, l.o.n);
    if (l.post_attn) add_norm(l, h, nullptr, l.post_attn, h, h, t_n, l.hidden, small);
    add_norm(l, x, h, l.ln2, x, normed, t_n, l.hidden, small);
    const Projection& g = l.gate_up[0];
    const int gn = 2 * inter;
    if (l.gelu) {
        project_parts(s, l.gate_up, l.gate_up_parts, normed, gu);
        spindle_gelu_tanh_mul(gu, gn, act, inter, t_n, inter, pick(s, 0, 3L * t_n * gn));
    } else if (l.gate_up_parts > 1 || g.ggml_type != -1 ||
               !spindle_gemm_bf16_silu(normed, g.k, t_n, g.k, g.w, g.scale, g.n, g.bias, act, inter,
                                       threads_for(s, g))) {
        project_parts(s, l.gate_up, l.gate_up_parts, normed, gu);  // too many rows for the one call
        spindle_silu_mul(gu, gn, act, inter, t_n, inter, pick(s, 0, 3L * t_n * gn));
    }
    project(s, l.down, act, h, l.down.n);
    if (l.post_ff) add_norm(l, h, nullptr, l.post_ff, h, h, t_n, l.hidden, small);
    if (l.next_ln1) {
        add_norm(l, x, h, l.next_ln1, x, normed, t_n, l.hidden, small);
        return;
    }
    // the last layer: x + h alone, rounded once as torch's bf16 add
    for (long i = 0; i < (long)t_n * l.hidden; ++i) x[i] = round_bf16(widen(x[i]) + widen(h[i]));
}
