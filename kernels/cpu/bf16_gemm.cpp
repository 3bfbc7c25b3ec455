// y = x W^T (+ b) in bfloat16 for decode-size batches (tens of rows), on AVX512_BF16's
// vdpbf16ps: each 32-bit lane multiplies a pair of bf16 (two consecutive k of one
// output column) by a pair of x and adds both products to a float32 accumulator.
//
// Layout (bf16_gemm.py packs it once at load): the output columns go by panels of
// NB = 16 * NR; a panel holds all of K as pairs, column-interleaved, so that one 64-byte
// load is the k-pair of 16 consecutive columns:
//     packed[panel][k / 2][column in panel][k % 2]      (bf16; N and K zero-padded)
// A tile is MR rows x NR vectors of 16 columns: per k-pair, NR weight loads and MR
// broadcasts of an x pair feed MR * NR dot products into MR * NR accumulators (enough
// independent chains to cover vdpbf16ps' latency). Threads own whole panels; a panel
// (K x NB x 2 bytes, 37-74 KB at the model's K) stays in L1/L2 while every row of x
// passes over it, and x (M x K x 2 bytes) stays in L2 across panels.
//
// Without AVX512_BF16 this file builds to a stub that refuses (kvflow_bf16_gemm_isa()
// returns 0): those CPUs keep oneDNN. Built by native_build.py; the reference is
// torch.nn.functional.linear with float32 accumulation.
#include <omp.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define KVFLOW_DPBF16 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

using namespace kvflow_cpu;

// Tile shape: kRows rows x kVectors vectors of 16 columns (24 accumulators of the 32
// zmm registers). The panel width kPanel = 16 * kVectors is part of the packed layout
// (bf16_gemm.py's PANEL). Measured on Zen 4 against 8x2, 12x2, 6x4 (docs/benchmarks.md):
// all within 2% at one thread; 48 columns divide every SmolLM2 width into whole panels.
// 256-bit tiles (ymm vdpbf16ps, 8x4, 6x4, 8x3, 4x4) were 0-10% slower on Zen 4.
constexpr int kRows = 8, kVectors = 3;
constexpr int64_t kPanel = 16 * kVectors;

struct Problem {
    const uint16_t* x;     // [M, K] bf16, row stride xs
    const uint16_t* w;     // packed panels, see the header
    const uint16_t* bias;  // [N] bf16 or null
    uint16_t* y;           // [M, N] bf16 contiguous
    int64_t M, K, N, xs;
};

#if defined(KVFLOW_DPBF16)

inline __m512 bias_vector(const uint16_t* bias, int64_t n, __mmask16 mask) {
    if (bias == nullptr) return _mm512_setzero_ps();
    const __m256i h = _mm256_maskz_loadu_epi16(mask, bias + n);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __mmask16 column_mask(int64_t n, int64_t N) {
    const int64_t left = N - n;
    return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (left > 0 ? left : 0)) - 1);
}

// The float32 products of rows [m, m + MR) with one panel, into acc.
template <int MR, int NR>
inline void accumulate(const Problem& p, const uint16_t* panel, int64_t m, __m512 (&acc)[MR][NR]) {
    constexpr int64_t NB = 16 * NR;
    const int64_t pairs = p.K / 2;
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    const uint16_t* xrow = p.x + m * p.xs;
    for (int64_t k = 0; k < pairs; ++k) {
        __m512bh wv[NR];
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j)
            wv[j] = (__m512bh)_mm512_loadu_si512(panel + (k * NB + 16 * j) * 2);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
            int32_t pair;
            std::memcpy(&pair, xrow + i * p.xs + 2 * k, sizeof(pair));
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
            for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
}

// acc + bias rounded to bf16 (the GEMM's output), back as float32.
inline __m512 rounded(__m512 acc, __m512 bias) {
    return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_add_ps(acc, bias)));
}

// Rows [m, m + MR) x the panel starting at column n0.
template <int MR, int NR>
inline void tile(const Problem& p, const uint16_t* panel, int64_t m, int64_t n0) {
    __m512 acc[MR][NR];
    accumulate<MR, NR>(p, panel, m, acc);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
        const int64_t n = n0 + 16 * j;
        const __mmask16 mask = column_mask(n, p.N);
        if (!mask) break;
        const __m512 b = bias_vector(p.bias, n, mask);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
            const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b));
            _mm256_mask_storeu_epi16(p.y + (m + i) * p.N + n, mask, (__m256i)out);
        }
    }
}

// silu(gate) * up as elementwise.cpp's silu_and_mul computes it from the bf16 gate and
// up (the same operations on 16 lanes: the same bits), rounded to bf16.
inline __m256i silu_times(__m512 gate, __m512 up) {
    const f32x16 g = (f32x16)gate;
    const f32x16 silu = round_bf16(g / (1.0f + exp_approx(-g)));
    const __m512i bits = (__m512i)(round_bf16_bits(silu * (f32x16)up) >> 16);
    return _mm512_cvtepi32_epi16(bits);
}

// Rows [m, m + MR) of silu(gate) * up for the columns n0 .. n0 + NB of the gate panel and
// the up panel of the same columns: the gate's products wait, rounded, in L1 while the
// up panel's are computed.
template <int MR, int NR>
inline void glu_tile(const Problem& p, const uint16_t* gate_panel, const uint16_t* up_panel,
                     int64_t m, int64_t n0) {
    const int64_t inter = p.N / 2;
    __m512 acc[MR][NR];
    alignas(64) float gate[MR][NR][16];  // in L1, not registers: the up's products need them
    accumulate<MR, NR>(p, gate_panel, m, acc);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
        const int64_t n = n0 + 16 * j;
        const __m512 b = bias_vector(p.bias, n, column_mask(n, inter));
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) _mm512_store_ps(gate[i][j], rounded(acc[i][j], b));
    }
    accumulate<MR, NR>(p, up_panel, m, acc);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
        const int64_t n = n0 + 16 * j;
        const __mmask16 mask = column_mask(n, inter);
        if (!mask) break;
        const __m512 b = bias_vector(p.bias == nullptr ? nullptr : p.bias + inter, n, mask);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
            const __m256i out = silu_times(_mm512_load_ps(gate[i][j]), rounded(acc[i][j], b));
            _mm256_mask_storeu_epi16(p.y + (m + i) * inter + n, mask, out);
        }
    }
}

// The last `rows` (< MR) rows of a row block: a tile of exactly that many rows.
template <int NR, int R>
inline void rows_tail(const Problem& p, const uint16_t* panel, int64_t m, int64_t n0,
                      int64_t rows) {
    if constexpr (R > 0) {
        if (rows == R) return tile<R, NR>(p, panel, m, n0);
        rows_tail<NR, R - 1>(p, panel, m, n0, rows);
    }
}

template <int NR, int R>
inline void glu_rows_tail(const Problem& p, const uint16_t* gate_panel, const uint16_t* up_panel,
                          int64_t m, int64_t n0, int64_t rows) {
    if constexpr (R > 0) {
        if (rows == R) return glu_tile<R, NR>(p, gate_panel, up_panel, m, n0);
        glu_rows_tail<NR, R - 1>(p, gate_panel, up_panel, m, n0, rows);
    }
}

// Row blocks: x's rows in blocks of whole tiles whose x (up to kXBlockBytes) stays in L2
// while the panels stream past, as even as they can be and, where there are several, as
// many as a multiple of the threads. Tasks are (row block, panel), row blocks
// outermost, and a static schedule hands each thread a contiguous range of them: so
// every thread gets the same rows. (Blocks of a fixed 224 rows gave a 256-row prefill
// one block of 224 and one of 32: one thread did 7/8 of the work.)
struct RowBlocks {
    int64_t count, tiles, MR;

    int64_t first(int64_t b) const { return b * tiles / count * MR; }
};

template <int MR>
RowBlocks row_blocks(const Problem& p) {
    constexpr int64_t kXBlockBytes = 256 * 1024;
    const int64_t tiles = (p.M + MR - 1) / MR;
    const int64_t tiles_per_block = std::max<int64_t>(1, kXBlockBytes / (2 * p.K) / MR);
    int64_t count = (tiles + tiles_per_block - 1) / tiles_per_block;
    const int64_t threads = omp_get_max_threads();
    if (count > 1) count = std::min(tiles, (count + threads - 1) / threads * threads);
    return {std::max<int64_t>(count, 1), tiles, MR};
}

// body(q, m0, m1) for every task: panel q of rows [m0, m1). At decode sizes there is one
// row block and threads own whole panels.
template <int MR, typename Body>
void for_each_task(const Problem& p, int64_t panels, Body body) {
    const RowBlocks blocks = row_blocks<MR>(p);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < blocks.count * panels; ++t) {
        const int64_t q = t % panels, b = t / panels;
        body(q, blocks.first(b), std::min(p.M, blocks.first(b + 1)));
    }
}

template <int MR, int NR>
void gemm(const Problem& p) {
    constexpr int64_t NB = 16 * NR;
    const int64_t pairs = p.K / 2;
    for_each_task<MR>(p, (p.N + NB - 1) / NB, [&](int64_t q, int64_t m, int64_t m1) {
        const uint16_t* panel = p.w + q * pairs * NB * 2;
        for (; m + MR <= m1; m += MR) tile<MR, NR>(p, panel, m, q * NB);
        rows_tail<NR, MR - 1>(p, panel, m, q * NB, m1 - m);
    });
}

// The same tasks over pairs of panels (gate panel q, up panel q): p.N = 2 * inter, the
// gate's panels first, then the up's, each half padded to whole panels; y is [M, inter].
template <int MR, int NR>
void glu_gemm(const Problem& p) {
    constexpr int64_t NB = 16 * NR;
    const int64_t panels = (p.N / 2 + NB - 1) / NB, pairs = p.K / 2;
    for_each_task<MR>(p, panels, [&](int64_t q, int64_t m, int64_t m1) {
        const uint16_t* gate = p.w + q * pairs * NB * 2;
        const uint16_t* up = gate + panels * pairs * NB * 2;
        for (; m + MR <= m1; m += MR) glu_tile<MR, NR>(p, gate, up, m, q * NB);
        glu_rows_tail<NR, MR - 1>(p, gate, up, m, q * NB, m1 - m);
    });
}

#endif

}  // namespace

extern "C" {

// 1 if this build has the AVX512_BF16 kernel, 0 if it refuses every call.
int kvflow_bf16_gemm_isa() {
#if defined(KVFLOW_DPBF16)
    return 1;
#else
    return 0;
#endif
}

// The panel width of the packed layout (columns): bf16_gemm.py packs with it.
int kvflow_bf16_gemm_panel() { return int(kPanel); }

// x bf16 [rows, in_features] (row stride x_row_stride, unit column stride); w packed as
// in the header (panels of kPanel columns, in_features even); bias bf16 [out_features] or
// null; y bf16 [rows, out_features] contiguous. Returns 0, or nonzero for unsupported
// arguments (3: this build has no AVX512_BF16 kernel).
int kvflow_bf16_gemm(const void* x, const void* w, const void* bias, void* y, int64_t rows,
                     int64_t in_features, int64_t out_features, int64_t x_row_stride) {
#if defined(KVFLOW_DPBF16)
    if (rows < 0 || in_features <= 0 || in_features % 2 || out_features <= 0) return 1;
    const Problem p{static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
                    static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y),
                    rows, in_features, out_features, x_row_stride};
    gemm<kRows, kVectors>(p);
    return 0;
#else
    (void)x, (void)w, (void)bias, (void)y, (void)rows, (void)in_features, (void)out_features;
    (void)x_row_stride;
    return 3;
#endif
}

// silu(gate) * up of a gate|up layer [2 * inter, in_features] packed as two halves (the
// gate's panels, then the up's, each padded to whole panels): x as above, bias bf16
// [2 * inter] or null, y bf16 [rows, inter] contiguous. Bit for bit what
// kvflow_bf16_gemm on the whole layer followed by elementwise.cpp's kvflow_silu_and_mul
// gives, without writing and rereading the [rows, 2 * inter] intermediate.
int kvflow_bf16_gemm_silu_mul(const void* x, const void* w, const void* bias, void* y,
                              int64_t rows, int64_t in_features, int64_t inter,
                              int64_t x_row_stride) {
#if defined(KVFLOW_DPBF16)
    if (rows < 0 || in_features <= 0 || in_features % 2 || inter <= 0) return 1;
    const Problem p{static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
                    static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y),
                    rows, in_features, 2 * inter, x_row_stride};
    glu_gemm<kRows, kVectors>(p);
    return 0;
#else
    (void)x, (void)w, (void)bias, (void)y, (void)rows, (void)in_features, (void)inter;
    (void)x_row_stride;
    return 3;
#endif
}

}  // extern "C"
