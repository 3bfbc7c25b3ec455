// Causal prefill attention on CPUs for a prompt with no cached prefix: the q_len query
// rows attend the step's own K/V rows 0 .. i (top-left causal, no window). With
// causal = 0 every row attends all q_len keys (a vision tower's patches).
//
// Why native code: torch's CPU SDPA (flash path) reaches ~30-60 GFLOP/s of useful work
// on one core at 128-2048 tokens, a fraction of what the linear layers reach. Here one
// task is (KV head, tile of 32 query positions): the G query heads of the KV head make
// 32 * G query rows that share every K/V block of 64 keys, read from a packed copy made
// once per call:
//   * K transposed so that one vector holds 16 keys (x 2 dims for bf16): a query row's
//     scores against a block are up to 4 accumulators filled by broadcasts of the query
//     (vdpbf16ps on bf16 pairs with AVX512_BF16, FMA otherwise), no horizontal sums;
//   * V in rows of D (bf16: rows taken in interleaved pairs, so one vdpbf16ps adds two
//     keys' weighted values, the weights rounded to bf16 as FlashAttention does).
// Query rows go by 4 (their scores and a 64-column slice of their outputs stay in
// registers). Softmax is online (running max and sum per query row, in float32); keys
// past a group's last position are not computed; tasks run on torch's OpenMP pool.
// Without AVX512_BF16, bf16 inputs are widened to float32 when packed.
//
// Only where -march enables AVX-512 and head_dim % 32 == 0 (kvflow_prefill_attention_
// supports says so); the caller keeps torch SDPA for everything else, and as reference.
// Built at first use by native_build.py; launcher and reference in prefill_attention.py.

// GCC's -mtune=znver4 (what -march=native picks on Zen 4) made these loops 20-40% slower
// than its generic tuning (measured, float32 and bf16 alike). Before every include, so
// that the headers' inline functions share the target options and still inline.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("tune=generic")
#endif

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"
#if defined(__AVX512F__)
#include "paged_decode_avx512.h"
#endif

namespace {

using namespace kvflow_cpu;

struct Shape {
    int64_t q_len, num_heads, num_kv_heads, head_dim;
    int64_t q_stride, k_stride, v_stride, out_stride;  // elements between tokens
    float scale;
    bool causal;  // false: every query row sees every key
};

#if defined(__AVX512F__)
constexpr int64_t kQTile = 32;  // query positions per task
constexpr int64_t kKBlock = 64;  // keys per block (up to four vectors of scores per row)
constexpr int kMaxVecs = kKBlock / 16;
constexpr int kRows = 4;         // query rows whose scores stay in registers together

// Whether bf16 inputs take the vdpbf16ps path (else they are widened to float32).
template <typename T>
constexpr bool dot_bf16() {
#if defined(__AVX512BF16__)
    return sizeof(T) == 2;
#else
    return false;
#endif
}

// The call's packed operands. Float path: q [L, H, D] float, k [KH, blocks, D, 64]
// float, v [KH, Lpad, D] float. bf16 path: q is the caller's, k [KH, blocks, D / 2, 64,
// 2] bf16, v [KH, Lpad / 2, D, 2] bf16. Keys past L are zeros.
struct Packed {
    std::vector<float> qf, kf, vf;
    std::vector<uint16_t> kb, vb;
};

// bf16 path, one (KV head, block of kKBlock keys): K as 32-bit words (dim pairs), a
// transpose of [key, D / 2] into [D / 2, key]; V rows interleaved pairwise with
// vpermt2w. Keys past L are written as zeros (the buffers are reused, not cleared).
template <typename T>
void pack_block_bf16(const T* k, const T* v, const Shape& s, int64_t blocks, int64_t kh,
                     int64_t b, Packed& p) {
#if defined(__AVX512BF16__)
    const int64_t L = s.q_len, D = s.head_dim, pad = blocks * kKBlock;
    const int64_t t0 = b * kKBlock, n = std::min(kKBlock, L - t0);
    uint16_t* kd = p.kb.data() + (kh * blocks + b) * kKBlock * D;
    for (int64_t j = 0; j < kKBlock; ++j) {
        const T* kr = k + (t0 + j) * s.k_stride + kh * D;
        for (int64_t c = 0; c < D / 2; ++c) {
            uint32_t word = 0;
            if (j < n) std::memcpy(&word, kr + 2 * c, 4);
            std::memcpy(kd + (c * kKBlock + j) * 2, &word, 4);
        }
    }
    // vd[(t / 2) * D * 2 + d * 2 + t % 2] = v[t][d]: 32 dims of two rows, two vectors out.
    alignas(64) static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                    37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                    11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_load_si512(lo_idx);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    uint16_t* vd = p.vb.data() + kh * pad * D + t0 * D;
    for (int64_t j = 0; j < kKBlock; j += 2) {
        const T* r0 = v + (t0 + j) * s.v_stride + kh * D;
        const T* r1 = r0 + s.v_stride;
        uint16_t* dst = vd + j * D;
        for (int64_t d = 0; d < D; d += 32) {
            const __m512i a = j < n ? _mm512_loadu_si512(r0 + d) : _mm512_setzero_si512();
            const __m512i c = j + 1 < n ? _mm512_loadu_si512(r1 + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(a, lo, c));
            _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(a, hi, c));
        }
    }
#else
    (void)k, (void)v, (void)s, (void)blocks, (void)kh, (void)b, (void)p;
#endif
}

template <typename T>
void pack(const T* q, const T* k, const T* v, const Shape& s, int64_t blocks, Packed& p) {
    const int64_t L = s.q_len, H = s.num_heads, KH = s.num_kv_heads, D = s.head_dim;
    const int64_t pad = blocks * kKBlock;
    if constexpr (dot_bf16<T>()) {
        // resize, not assign: pack_block_bf16 writes every element, padding included.
        p.kb.resize(KH * pad * D);
        p.vb.resize(KH * pad * D);
#pragma omp parallel for schedule(static)
        for (int64_t task = 0; task < KH * blocks; ++task)
            pack_block_bf16(k, v, s, blocks, task / blocks, task % blocks, p);
        (void)q;
        return;
    }
    p.qf.resize(L * H * D);
    p.kf.assign(KH * pad * D, 0.0f);
    p.vf.assign(KH * pad * D, 0.0f);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < L; ++t) {
        for (int64_t kh = 0; kh < KH; ++kh) {
            const T* kr = k + t * s.k_stride + kh * D;
            const T* vr = v + t * s.v_stride + kh * D;
            const int64_t b = t / kKBlock, j = t % kKBlock;
            float* kd = p.kf.data() + (kh * blocks + b) * kKBlock * D;
            float* vd = p.vf.data() + (kh * pad + t) * D;
            for (int64_t d = 0; d < D; ++d) {
                kd[d * kKBlock + j] = load(kr[d]);
                vd[d] = load(vr[d]);
            }
        }
        for (int64_t i = 0; i < H * D; ++i) p.qf[t * H * D + i] = load(q[t * s.q_stride + i]);
    }
}

// Running softmax state and output accumulators of one task's kQTile * G query rows.
struct TaskState {
    std::vector<float> acc;         // [rows, D]
    std::vector<float> spare;       // [D]: where a repeated row's accumulators go
    std::vector<float> max;         // [rows]
    std::vector<float> sum;         // [rows, 16]: partial sums, added up at the end
    std::vector<float> weights;     // [kRows, kKBlock] float path
    std::vector<uint16_t> bweights; // [kRows, kKBlock] bf16 path
    std::vector<const void*> query; // [rows]: each row's query (no divisions per block)
    std::vector<int64_t> pos;       // [rows]: each row's position
};

// Scores of kRows query rows against the first 16 * NK keys of a block, into s[r][0..NK).
template <int NK, typename T>
inline void score_block(const void* const* q, const float* kf, const uint16_t* kb, int64_t D,
                        __m512 (*s)[kMaxVecs]) {
    for (int r = 0; r < kRows; ++r)
        for (int v = 0; v < NK; ++v) s[r][v] = _mm512_setzero_ps();
    if constexpr (dot_bf16<T>()) {
#if defined(__AVX512BF16__)
        (void)kf;
        for (int64_t c = 0; c < D / 2; ++c) {
            __m512bh k[NK];
            for (int v = 0; v < NK; ++v)
                k[v] = (__m512bh)_mm512_loadu_si512(kb + (c * kKBlock + 16 * v) * 2);
#pragma GCC unroll 4
            for (int r = 0; r < kRows; ++r) {
                uint32_t pair;
                std::memcpy(&pair, static_cast<const uint16_t*>(q[r]) + 2 * c, 4);
                const __m512bh qc = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
                for (int v = 0; v < NK; ++v) s[r][v] = _mm512_dpbf16_ps(s[r][v], k[v], qc);
            }
        }
#endif
    } else {
        (void)kb;
        for (int64_t d = 0; d < D; ++d) {
            __m512 k[NK];
            for (int v = 0; v < NK; ++v) k[v] = _mm512_loadu_ps(kf + d * kKBlock + 16 * v);
#pragma GCC unroll 4
            for (int r = 0; r < kRows; ++r) {
                const __m512 qd = _mm512_set1_ps(static_cast<const float*>(q[r])[d]);
                for (int v = 0; v < NK; ++v) s[r][v] = _mm512_fmadd_ps(qd, k[v], s[r][v]);
            }
        }
    }
}

// acc[r][col .. col + 16 NV) = acc * alpha[r] + sum over the block's keys of weight * v.
template <int NV, typename T>
inline void accumulate_block(const float* vf, const uint16_t* vb, int64_t D, int64_t col,
                             int keys, const TaskState& w, __m512 alpha, float* const* acc) {
    alignas(64) float al[16];
    _mm512_store_ps(al, alpha);
    __m512 a[kRows][NV];
    for (int r = 0; r < kRows; ++r)
        for (int i = 0; i < NV; ++i)
            a[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + col + 16 * i), _mm512_set1_ps(al[r]));
    if constexpr (dot_bf16<T>()) {
#if defined(__AVX512BF16__)
        (void)vf;
        for (int j = 0; j < keys; j += 2) {
            __m512bh v[NV];
            for (int i = 0; i < NV; ++i)
                v[i] = (__m512bh)_mm512_loadu_si512(vb + ((j / 2) * D + col + 16 * i) * 2);
            for (int r = 0; r < kRows; ++r) {
                uint32_t pair;
                std::memcpy(&pair, w.bweights.data() + r * kKBlock + j, 4);
                const __m512bh pw = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
                for (int i = 0; i < NV; ++i) a[r][i] = _mm512_dpbf16_ps(a[r][i], v[i], pw);
            }
        }
#endif
    } else {
        (void)vb;
        for (int j = 0; j < keys; ++j) {
            __m512 v[NV];
            for (int i = 0; i < NV; ++i) v[i] = _mm512_loadu_ps(vf + j * D + col + 16 * i);
            for (int r = 0; r < kRows; ++r) {
                const __m512 pw = _mm512_set1_ps(w.weights[r * kKBlock + j]);
                for (int i = 0; i < NV; ++i) a[r][i] = _mm512_fmadd_ps(pw, v[i], a[r][i]);
            }
        }
    }
    for (int r = 0; r < kRows; ++r)
        for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc[r] + col + 16 * i, a[r][i]);
}

// exp of x <= 0 (or -inf), as avx512::exp16 (the same reduction and polynomial, so the
// same values down to e^-87) in fewer instructions: vscalefps makes p * 2^k, which also
// gives 0 below e^-87 without avx512::exp16's clamp. Lanes where x is -inf come out NaN:
// every caller masks them.
inline __m512 exp_nonpositive(__m512 x) {
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    return _mm512_scalef_ps(p, k);
}

// Lanes of keys key0 .. key0 + 15 at or before position pos (causal).
inline __mmask16 visible(int64_t key0, int64_t pos) {
    const int64_t n = pos - key0 + 1;
    return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

// The online-softmax step of kRows rows over one block's NK score vectors: weights
// (bf16 or float, per path) into w, new running maxima, and the factor alpha (lane r)
// by which row r's sum and accumulators are rescaled. pos[r] < 0: a repeated row,
// weights zero.
template <int NK, typename T>
inline __m512 softmax_block(__m512 (*sc)[kMaxVecs], const int64_t* pos, int64_t key0,
                            float scale, float* max, __m512* sum, TaskState& w) {
    const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512 scale_v = _mm512_set1_ps(scale);
    alignas(64) float old_max[16] = {}, new_max[16] = {};
    __mmask16 masks[kRows][NK];
    for (int r = 0; r < kRows; ++r) {
        __m512 m = lowest;
        for (int v = 0; v < NK; ++v) {
            masks[r][v] = pos[r] < 0 ? 0 : visible(key0 + 16 * v, pos[r]);
            sc[r][v] = _mm512_mask_mul_ps(lowest, masks[r][v], sc[r][v], scale_v);
            m = _mm512_max_ps(m, sc[r][v]);
        }
        // Key key0 <= q0 <= pos is visible to every real row, so its max is finite.
        old_max[r] = pos[r] < 0 ? 0.0f : max[r];
        new_max[r] = pos[r] < 0 ? 0.0f : std::max(max[r], _mm512_reduce_max_ps(m));
        if (pos[r] >= 0) max[r] = new_max[r];
    }
    // On a row's first block the old max is -inf: exp_nonpositive gives NaN, alpha is 0.
    const __m512 om = _mm512_load_ps(old_max), nm = _mm512_load_ps(new_max);
    const __mmask16 had = _mm512_cmp_ps_mask(om, lowest, _CMP_NEQ_OQ);
    const __m512 alpha = _mm512_maskz_mov_ps(had, exp_nonpositive(_mm512_sub_ps(om, nm)));
    alignas(64) float al[16];
    _mm512_store_ps(al, alpha);
    for (int r = 0; r < kRows; ++r) {
        const __m512 mx = _mm512_set1_ps(new_max[r]);
        __m512 total = _mm512_mul_ps(sum[r], _mm512_set1_ps(al[r]));
        for (int v = 0; v < NK; ++v) {
            __m512 e = _mm512_maskz_mov_ps(masks[r][v], exp_nonpositive(_mm512_sub_ps(sc[r][v], mx)));
            if constexpr (dot_bf16<T>()) {
#if defined(__AVX512BF16__)
                const __m256bh b = _mm512_cvtneps_pbh(e);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.bweights.data() + r * kKBlock + 16 * v),
                                    (__m256i)b);
                e = _mm512_cvtpbh_ps(b);  // the sum of the weights V is multiplied by
#endif
            } else {
                _mm512_storeu_ps(w.weights.data() + r * kKBlock + 16 * v, e);
            }
            total = _mm512_add_ps(total, e);
        }
        if (pos[r] >= 0) sum[r] = total;
    }
    return alpha;
}

// One task: query positions [q0, q0 + kQTile) of the G heads of KV head kh.
template <typename T>
void attend_tile(const T* q, const Packed& p, T* out, const Shape& s, int64_t blocks,
                 int64_t kh, int64_t q0, TaskState& w) {
    const int64_t G = s.num_heads / s.num_kv_heads, D = s.head_dim, L = s.q_len;
    const int64_t positions = std::min(kQTile, L - q0), rows = positions * G;
    const int64_t pad = blocks * kKBlock;
    w.acc.assign(rows * D, 0.0f);
    w.spare.assign(D, 0.0f);
    w.max.assign(rows, -std::numeric_limits<float>::infinity());
    w.sum.assign(rows * 16, 0.0f);
    w.weights.assign(kRows * kKBlock, 0.0f);
    w.bweights.assign(kRows * kKBlock, 0);
    // Row r = position offset r / G, head kh * G + r % G; a group past `rows` repeats row 0.
    w.query.resize(rows);
    w.pos.resize(rows);
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = q0 + r / G, h = kh * G + r % G;
        w.pos[r] = s.causal ? t : L - 1;  // the last key a row sees
        if constexpr (dot_bf16<T>()) w.query[r] = q + t * s.q_stride + h * D;
        else w.query[r] = p.qf.data() + (t * s.num_heads + h) * D;
    }
    // Keys past the tile's last position are unseen (causal).
    const int64_t end = s.causal ? q0 + positions : L;
    for (int64_t key0 = 0; key0 < end; key0 += kKBlock) {
        const int64_t b = key0 / kKBlock;
        const float* kf = dot_bf16<T>() ? nullptr : p.kf.data() + (kh * blocks + b) * kKBlock * D;
        const uint16_t* kb = dot_bf16<T>() ? p.kb.data() + (kh * blocks + b) * kKBlock * D : nullptr;
        const float* vf = dot_bf16<T>() ? nullptr : p.vf.data() + (kh * pad + key0) * D;
        const uint16_t* vb = dot_bf16<T>() ? p.vb.data() + (kh * pad + key0) * D : nullptr;
        for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
            const void* qr[kRows];
            float* acc[kRows];
            int64_t pos[kRows];
            __m512 sum[kRows];
            float max[kRows];
            for (int r = 0; r < kRows; ++r) {
                const bool real = r0 + r < rows;
                const int64_t row = real ? r0 + r : 0;
                qr[r] = w.query[row];
                acc[r] = real ? w.acc.data() + row * D : w.spare.data();
                pos[r] = real ? w.pos[row] : -1;
                sum[r] = _mm512_loadu_ps(w.sum.data() + row * 16);
                max[r] = w.max[row];
            }
            // Keys past the group's last position are masked for all its rows: not computed.
            const int64_t last = w.pos[std::min(rows - 1, r0 + kRows - 1)];
            const int64_t seen = std::min(kKBlock, last + 1 - key0);
            const int nk = static_cast<int>((seen + 15) / 16);
            const int keys = static_cast<int>(seen + 1) & ~1;  // whole pairs (padding: zeros)
            __m512 sc[kRows][kMaxVecs];
            __m512 alpha;
            switch (nk) {
#define KVFLOW_BLOCK(NK)                                                           \
    case NK:                                                                       \
        score_block<NK, T>(qr, kf, kb, D, sc);                                     \
        alpha = softmax_block<NK, T>(sc, pos, key0, s.scale, max, sum, w);         \
        break;
                KVFLOW_BLOCK(1)
                KVFLOW_BLOCK(2)
                KVFLOW_BLOCK(3)
                default: KVFLOW_BLOCK(4)
#undef KVFLOW_BLOCK
            }
            for (int r = 0; r < kRows && r0 + r < rows; ++r) {
                _mm512_storeu_ps(w.sum.data() + (r0 + r) * 16, sum[r]);
                w.max[r0 + r] = max[r];
            }
            for (int64_t col = 0; col < D; col += 64) {
                if (col + 64 <= D)
                    accumulate_block<4, T>(vf, vb, D, col, keys, w, alpha, acc);
                else
                    accumulate_block<2, T>(vf, vb, D, col, keys, w, alpha, acc);
            }
        }
    }
    for (int64_t row = 0; row < rows; ++row) {
        const int64_t t = q0 + row / G, h = kh * G + row % G;
        const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(w.sum.data() + row * 16));
        const float* a = w.acc.data() + row * D;
        T* o = out + t * s.out_stride + h * D;
        for (int64_t d = 0; d < D; ++d) store(o + d, a[d] * inv);
    }
}

template <typename T>
void prefill(const T* q, const T* k, const T* v, T* out, const Shape& s) {
    const int64_t blocks = (s.q_len + kKBlock - 1) / kKBlock;
    // Per calling thread, kept: no allocation (nor page faults) per call. Named through a
    // reference: inside the parallel region a thread_local would be each worker's own.
    thread_local Packed kept;
    Packed& packed = kept;
    pack(q, k, v, s, blocks, packed);
    const int64_t tiles = (s.q_len + kQTile - 1) / kQTile, KH = s.num_kv_heads;
#pragma omp parallel
    {
        TaskState state;
        // KV head by KV head, so consecutive tasks reread the same packed K/V (one head's
        // fits the L2 at 2048 tokens, all three do not); within one, later query tiles
        // see more keys: handed out first, so the short ones fill in.
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tiles * KH; ++task) {
            const int64_t kh = task / tiles, tile = tiles - 1 - task % tiles;
            attend_tile(q, packed, out, s, blocks, kh, tile * kQTile, state);
        }
    }
}
#endif

}  // namespace

extern "C" {

// 1 where this build runs kvflow_prefill_attention for this head_dim, else 0.
int kvflow_prefill_attention_supports(int64_t head_dim) {
#if defined(__AVX512F__)
    return head_dim > 0 && head_dim % 32 == 0;
#else
    (void)head_dim;
    return 0;
#endif
}

// dtype: 0 = float32, 1 = bfloat16. q [L, H, D], k and v [L, KH, D], out [L, H, D], each
// with contiguous [heads, D] rows and its own token stride; causal 1 (top-left) or 0
// (every row sees every key). Status: 0 done, 1 bad dtype,
// 2 unsupported here (see kvflow_prefill_attention_supports), 3 bad shape.
int kvflow_prefill_attention(int dtype, const void* q, const void* k, const void* v, void* out,
                             int64_t q_len, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t q_stride, int64_t k_stride,
                             int64_t v_stride, int64_t out_stride, float scale, int causal) {
    if (!kvflow_prefill_attention_supports(head_dim)) return 2;
    if (q_len < 1 || num_kv_heads < 1 || num_heads % num_kv_heads) return 3;
#if defined(__AVX512F__)
    const Shape s{q_len, num_heads, num_kv_heads, head_dim, q_stride, k_stride, v_stride,
                  out_stride, scale, causal != 0};
    if (dtype == 0) {
        prefill(static_cast<const float*>(q), static_cast<const float*>(k),
                static_cast<const float*>(v), static_cast<float*>(out), s);
        return 0;
    }
    if (dtype == 1) {
        prefill(static_cast<const Bf16*>(q), static_cast<const Bf16*>(k),
                static_cast<const Bf16*>(v), static_cast<Bf16*>(out), s);
        return 0;
    }
    return 1;
#else
    (void)dtype, (void)q, (void)k, (void)v, (void)out, (void)q_stride, (void)k_stride;
    (void)v_stride, (void)out_stride, (void)scale, (void)causal;
    return 2;
#endif
}

}  // extern "C"
