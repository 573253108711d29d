// y = x @ W^T + b in bf16 through AMX tiles (TDPBF16PS), for a decode step's few rows: the weight is packed once
// so that each thread reads one straight stream of 1 KiB tiles, and the tiles' arithmetic is so cheap that the
// product is the weight's read alone. Built into the package's library (its functions carry the AMX target, so
// the rest of the library needs no AMX); called through engine/cpu_kernels/gemm_amx.py, which packs.
//
// Packed layout, N padded to a multiple of 32: for each pair of 16-column blocks p and each step s of 32 inputs,
// two tiles of 16 rows x 64 bytes, row r of block b holding (W[32p + 16b + c][32s + 2r + j]) for c < 16, j < 2
// (the VNNI pairs TDPBF16PS reads). A thread owns pairs, so its tiles follow each other in memory.
// Linux hands out the tile state only on request: every thread asks once (arch_prctl ARCH_REQ_XCOMP_PERM) before
// its first tile instruction, or the first one kills the process.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"

namespace {

using spindle::first_lanes;
using spindle::load_bf16_n;
using spindle::narrow;
using spindle::widen;

constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
constexpr int kTileRows = 16;  // rows of x per tile (a C tile's rows)
// rows of x taken at a time: half of this core's L2 as Linux reports it (1 MiB where it does not)
long chunk_bytes() {
    static const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? l2 / 2 : 1L << 20;
}

bool tiles_permitted() {
    static thread_local int ok = -1;
    if (ok < 0) ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? 1 : 0;
    return ok == 1;
}

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// tmm0-3: C (m rows of 16 float32: row blocks 0 and 1 by column blocks 0 and 1); tmm4, 5: A (m rows of 32 bf16,
// row blocks 0 and 1); tmm6, 7: B (16 rows of 64 bytes, column blocks 0 and 1)
__attribute__((target("amx-tile,amx-bf16"))) void configure(int m) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = (uint8_t)(t < 6 ? m : 16);
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

struct Out {
    const uint16_t* bias;
    uint16_t* y;
    long ldy;
    float* yf;
    long ldyf;
    int N;
    // c: the two column blocks' sums for m rows from row m0, columns from 32p; + bias, rounded to bf16 (to nearest
    // even), stored (or widened and stored) 16 columns at a time
    void put(const float (*c)[kTileRows * 16], int m0, int m, int p) const {
        for (int b = 0; b < 2; ++b) {
            const int n0 = 32 * p + 16 * b;
            if (n0 >= N) return;
            const __mmask16 mask = first_lanes(N - n0);
            const __m512 add = bias ? load_bf16_n(bias + n0, mask) : _mm512_setzero_ps();
            for (int r = 0; r < m; ++r) {
                const __m256i v = narrow(_mm512_add_ps(_mm512_load_ps(c[b] + r * 16), add));
                if (yf) _mm512_mask_storeu_ps(yf + (long)(m0 + r) * ldyf + n0, mask, widen(v));
                else _mm256_mask_storeu_epi16(y + (long)(m0 + r) * ldy + n0, mask, v);
            }
        }
    }
};

// `blocks` blocks of m rows from row `first` against column pairs [p0, p1). Per pair, two row blocks at a time
// share each B tile (2 x 2 C tiles), and the pair's tiles, read from memory for the first blocks, stay in L2.
__attribute__((target("amx-tile,amx-bf16"))) void pairs(const uint16_t* x, long ldx, int first, int blocks, int m,
                                                         int K, const uint16_t* w, const Out& o, int p0, int p1) {
    const int steps = K / 32;
    alignas(64) float c[4][kTileRows * 16];
    for (int p = p0; p < p1; ++p) {
        const uint16_t* w0 = w + (long)p * steps * 1024;  // 2 tiles of 512 bf16 per step
        int blk = 0;
        for (; blk + 1 < blocks; blk += 2) {
            const uint16_t* a = x + (long)(first + blk * m) * ldx;
            const uint16_t* t = w0;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int s = 0; s < steps; ++s, t += 1024) {
                _tile_loadd(4, a + 32 * s, ldx * 2);
                _tile_loadd(5, a + (long)m * ldx + 32 * s, ldx * 2);
                _tile_loadd(6, t, 64);
                _tile_loadd(7, t + 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
            o.put(c, first + blk * m, m, p);
            o.put(c + 2, first + (blk + 1) * m, m, p);
        }
        if (blk < blocks) {
            const uint16_t* a = x + (long)(first + blk * m) * ldx;
            const uint16_t* t = w0;
            _tile_zero(0);
            _tile_zero(1);
            for (int s = 0; s < steps; ++s, t += 1024) {
                _tile_loadd(4, a + 32 * s, ldx * 2);
                _tile_loadd(6, t, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, t + 512, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            o.put(c, first + blk * m, m, p);
        }
    }
}

}  // namespace

extern "C" {

int spindle_gemm_amx_abi() { return 1; }

// Whether this thread may use tiles (asks Linux once); 0 where the CPU or the kernel has no AMX.
int spindle_gemm_amx_usable() { return tiles_permitted() ? 1 : 0; }

// y [M, N] bf16 (row stride ldy), or into yf (float32, row stride ldyf) when yf is not null, the bf16 result
// widened (as torch's bf16 linear and then .float()) = x [M, K] bf16 (row stride ldx, K a multiple of
// 32) @ W^T + bias, W packed as above. Returns nonzero, with nothing written, where a thread may not use tiles.
__attribute__((target("amx-tile,amx-bf16"))) int spindle_gemm_amx(const uint16_t* x, long ldx, int M, int K,
                                                                    const uint16_t* w, int N, const uint16_t* bias,
                                                                    uint16_t* y, long ldy, float* yf, long ldyf,
                                                                    int threads) {
    if (!tiles_permitted() || K % 32) return 1;
    const int np = (N + 31) / 32;
    const Out o{bias, y, ldy, yf, ldyf, N};
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        if (!tiles_permitted()) {
            failed = 1;
        } else {
            const int nt = omp_get_num_threads(), id = omp_get_thread_num();
            const int p0 = (int)((long)np * id / nt), p1 = (int)((long)np * (id + 1) / nt);
            // rows in chunks whose x stays in L2 while the thread's pairs pass (each chunk reads the weight once)
            const int chunk = (int)(chunk_bytes() / (2L * K)) / (2 * kTileRows) * (2 * kTileRows);
            const int step = chunk > 2 * kTileRows ? chunk : 2 * kTileRows;
            const int full = M / kTileRows, rest = M % kTileRows;
            if (full) configure(kTileRows);
            for (int b0 = 0; b0 < full; b0 += step / kTileRows) {
                const int blocks = full - b0 < step / kTileRows ? full - b0 : step / kTileRows;
                pairs(x, ldx, b0 * kTileRows, blocks, kTileRows, K, w, o, p0, p1);
            }
            if (rest) {
                configure(rest);
                pairs(x, ldx, full * kTileRows, 1, rest, K, w, o, p0, p1);
            }
            _tile_release();
        }
    }
    return failed;
}

}  // extern "C"
