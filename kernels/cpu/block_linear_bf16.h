// bfloat16 rows times GGUF blocks, up to 16 rows per pass over the weights: the linear
// layers of a speculative verification step (k + 1 rows) on a bf16 model whose bf16
// weights are the blocks' float32 values rounded (block_linear.py).
//
// It computes the bf16 model's own function, the one its bf16 GEMM computes: each weight
// expanded exactly (as block_linear.cpp) and rounded to bf16 to nearest even, products
// with the bf16 rows exact in float32, float32 sums, y rounded to bf16 once. Each block
// is expanded once per call, into registers, and applied to every row, so k + 1 rows
// read the weights once, as one row does. With AVX512_BF16 a block of one weight row is
// one vector of 32 bf16 (in the block's own order, the order of x) and each x row adds
// 32 products to its accumulator in one vdpbf16ps: half the float32 kernel's
// multiply-adds, the wide-row cost a verification step pays. Elsewhere the same values
// go through float32 vectors (vec.h).
//
// Included by block_linear.cpp after its layout (Format, Record, record_bytes, dequant8).
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVFLOW_BLOCK_DPBF16 1
constexpr int kDotMaxRows = 16;  // rows per pass: accumulators in the 32 vector registers

// One weight row's block (32 weights) as bf16 in the block's order. Q8_0: q * d in
// float32, rounded. Q4_*: the 16 values a block can hold, table[q] (exact in float32, as
// block_linear.cpp), rounded, in both halves of a 32-word table; vpermw reads the low 5
// bits of each index word: the low nibble's word (the whole byte) then lands on its copy
// in either half, the high nibble's word is shifted down first.
template <int F>
inline __m512bh weights_bf16(const Record<F>& rec, int r) {
    const __m512 d = _mm512_set1_ps(rec.d(r));
    const uint8_t* codes = rec.codes(r);
    if constexpr (F == kQ8_0) {
        const __m128i* p = reinterpret_cast<const __m128i*>(codes);
        const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))), d);
        const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))), d);
        return _mm512_cvtne2ps_pbh(hi, lo);
    } else {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 values = F == kQ4_1 ? _mm512_fmadd_ps(iota, d, _mm512_set1_ps(rec.m(r)))
                                         : _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.0f)), d);
        const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(values, values));
        const __m512i bytes = _mm512_cvtepu8_epi16(
            _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
        const __m512i shift = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                               0x0004000400040004, 0, 0, 0, 0);
        return reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(_mm512_srlv_epi16(bytes, shift), table));
    }
}

// Weight rows [r0, r0 + R) of a tile for rows x[0..M) (row stride `stride` elements).
template <int F, int M, int R>
inline void dot_rows(const Bf16* x, int64_t stride, const uint8_t* tile, int64_t blocks, int r0,
                     float out[M][R]) {
    __m512 acc[M][R];
    for (int i = 0; i < M; ++i)
        for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const Record<F> rec{tile + b * record_bytes<F>()};
        __builtin_prefetch(rec.p + kPrefetchAhead);
        __m512bh w[R];
        for (int r = 0; r < R; ++r) w[r] = weights_bf16<F>(rec, r0 + r);
        for (int i = 0; i < M; ++i) {
            const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + i * stride + b * kBlock));
            for (int r = 0; r < R; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], w[r], xv);
        }
    }
    for (int i = 0; i < M; ++i)
        for (int r = 0; r < R; ++r) out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}

// Weight rows held per pass: M * R accumulators plus R weight vectors within 32 registers.
constexpr int dot_rows_per_pass(int M) { return M <= 6 ? 4 : M <= 12 ? 2 : 1; }
#else
constexpr int kDotMaxRows = 8;

template <int F, int M, int R>
inline void dot_rows(const Bf16* x, int64_t stride, const uint8_t* tile, int64_t blocks, int r0,
                     float out[M][R]) {
    f32x8 acc[M][R] = {};
    for (int64_t b = 0; b < blocks; ++b) {
        const Record<F> rec{tile + b * record_bytes<F>()};
        __builtin_prefetch(rec.p + kPrefetchAhead);
        for (int part = 0; part < 4; ++part) {
            f32x8 w[R];
            for (int r = 0; r < R; ++r)
                w[r] = round_bf16(dequant8<F>(rec.codes(r0 + r), rec.d(r0 + r), rec.m(r0 + r), part));
            for (int i = 0; i < M; ++i) {
                const f32x8 xv = load8(x + i * stride + b * kBlock + 8 * part);
                for (int r = 0; r < R; ++r) acc[i][r] += xv * w[r];
            }
        }
    }
    for (int i = 0; i < M; ++i)
        for (int r = 0; r < R; ++r) out[i][r] = hsum(acc[i][r]);
}

// M * R accumulators within the 16 vector registers of AVX2.
constexpr int dot_rows_per_pass(int M) { return M <= 2 ? 4 : M <= 4 ? 2 : 1; }
#endif

// y[0..M) for every tile; threads own ranges of tiles (output features).
template <int F, int M>
void dot_linear_rows(const Bf16* x, int64_t stride, const uint8_t* packed, const Bf16* bias, Bf16* y,
                     int64_t K, int64_t N) {
    constexpr int R = dot_rows_per_pass(M);
    const int64_t blocks = K / kBlock, tiles = (N + kTile - 1) / kTile;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        const uint8_t* tile = packed + t * blocks * record_bytes<F>();
        for (int r0 = 0; r0 < kTile; r0 += R) {
            float out[M][R];
            dot_rows<F, M, R>(x, stride, tile, blocks, r0, out);
            for (int r = 0; r < R && t * kTile + r0 + r < N; ++r) {
                const int64_t n = t * kTile + r0 + r;
                const float b = bias ? load(bias[n]) : 0.0f;
                for (int i = 0; i < M; ++i) store(&y[i * N + n], out[i][r] + b);
            }
        }
    }
}

template <int F, int M>
void dot_linear_up_to(const Bf16* x, int64_t stride, const uint8_t* packed, const Bf16* bias, Bf16* y,
                      int64_t rows, int64_t K, int64_t N) {
    if constexpr (M > 1) {
        if (rows < M) return dot_linear_up_to<F, M - 1>(x, stride, packed, bias, y, rows, K, N);
    }
    dot_linear_rows<F, M>(x, stride, packed, bias, y, K, N);
}

// At most kDotMaxRows rows per pass over the weights.
template <int F>
void dot_linear(const Bf16* x, int64_t stride, const uint8_t* packed, const Bf16* bias, Bf16* y,
                int64_t rows, int64_t K, int64_t N) {
    for (int64_t start = 0; start < rows; start += kDotMaxRows)
        dot_linear_up_to<F, kDotMaxRows>(x + start * stride, stride, packed, bias, y + start * N,
                                         std::min<int64_t>(kDotMaxRows, rows - start), K, N);
}
