// The bf16 dot-product kernels of rtpcore_native._kernels: products of bfloat16 weights in the
// blocked layout (bf16p, _kernels.cpp) with activations rounded to bfloat16, summed in float32.
// _kernels.cpp includes this file twice, each time in its own namespace:
//   RTPCORE_AMX 0  under `#pragma GCC target("...,avx512bf16")`: vdpbf16ps (linear_dot)
//   RTPCORE_AMX 1  with "amx-tile,amx-bf16" as well: AMX tiles too (linear_amx); _kernels.cpp
//                  picks one by the row count (one row of a 16-row tile costs as much as sixteen)
//
// Precision: a product of two bfloat16 values is exact in float32, and both instructions add
// them in float32 (vdpbf16ps two at a time into each lane, AMX 32 at a time into each output,
// in an order of its own; both flush denormal inputs and outputs to zero). What differs from
// the widening kernels (_kernels_isa.hpp), which keep float32 activations, is the one rounding
// of each activation to bfloat16 (round to nearest even: a relative error of at most 2^-9 per
// activation) -- the rounding torch applies to a bf16 model's activations anyway, where every
// tensor between the products is bf16.
//
// Each product runs single-threaded over the weight rows [n0, n1) it is given (n0 a multiple of
// 16); _kernels.cpp splits the work over its thread pool. The activations xb are bfloat16, M rows
// of Kp values (K padded with zeros to Kp, a multiple of 32), and, for AMX, M rounded up to a
// multiple of 16 rows (zeros): the caller prepares them once per product (to_bf16 / padded).

// float32 rows (M, K) -> bfloat16 rows (M, Kp), zero-padded to Kp, rounded to nearest even.
static void to_bf16(const float* x, int64_t M, int64_t K, uint16_t* out, int64_t Kp) {
    for (int64_t m = 0; m < M; ++m) {
        const float* src = x + m * K;
        uint16_t* dst = out + m * Kp;
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k));
            _mm512_storeu_si512(dst + k, (__m512i)v);
        }
        for (; k < K; k += 16) {
            const int64_t left = K - k < 16 ? K - k : 16;
            const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1u);
            const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + k));
            _mm256_mask_storeu_epi16(dst + k, mask, (__m256i)v);
        }
        std::memset(dst + K, 0, sizeof(uint16_t) * (Kp - K));
    }
}

// Row m's 16 outputs of block b (those below N): + bias, then stored or added (Out).
static inline __attribute__((always_inline)) void store16(__m512 v, int64_t m, int64_t b, int64_t N,
                                                          const float* bias, const Out& y) {
    const int64_t n = b * bf16p::kRows;
    const __mmask16 mask = N - n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (N - n)) - 1u);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n));
    if (y.h) {
        _mm256_mask_storeu_epi16(y.h + m * y.ld + n, mask, (__m256i)_mm512_cvtneps_pbh(v));
        return;
    }
    float* dst = y.f + m * y.ld + n;
    if (y.accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, dst));
    _mm512_mask_storeu_ps(dst, mask, v);
}

// ---- vdpbf16ps: MT activation rows by NB blocks of 16 outputs, one pair of inputs at a time
// (the pair broadcast to every lane, the block row of 16 outputs' pairs loaded as it lies), U
// pairs in flight in accumulators of their own (few rows leave too few chains to hide the
// instruction's latency).

template <int MT, int NB, int U>
static inline __attribute__((always_inline)) void dot_rows(const uint16_t* xb, int64_t Kp, const uint16_t* w,
                                                           const float* bias, const Out& y, int64_t N, int64_t b,
                                                           int64_t m) {
    const int64_t bstride = Kp * bf16p::kRows;
    const uint16_t* wb = w + b * bstride;
    const uint16_t* xm = xb + m * Kp;
    __m512 acc[U][MT][NB];
    for (int u = 0; u < U; ++u)
        for (int i = 0; i < MT; ++i)
            for (int j = 0; j < NB; ++j) acc[u][i][j] = _mm512_setzero_ps();
    const int64_t pairs = Kp / 2;  // a multiple of 16
    for (int64_t p = 0; p < pairs; p += U) {
        for (int u = 0; u < U; ++u) {
            __m512i wv[NB];
            for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(wb + j * bstride + (p + u) * 32);
            for (int i = 0; i < MT; ++i) {
                int32_t pair;
                std::memcpy(&pair, xm + i * Kp + 2 * (p + u), sizeof pair);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                for (int j = 0; j < NB; ++j) acc[u][i][j] = _mm512_dpbf16_ps(acc[u][i][j], xv, (__m512bh)wv[j]);
            }
        }
    }
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NB; ++j) {
            __m512 v = acc[0][i][j];
            for (int u = 1; u < U; ++u) v = _mm512_add_ps(v, acc[u][i][j]);
            store16(v, m + i, b + j, N, bias, y);
        }
}

// Rows [0, M) of blocks [b, b + NB).
template <int NB>
static inline __attribute__((always_inline)) void dot_blocks(const uint16_t* xb, int64_t M, int64_t Kp,
                                                             const uint16_t* w, const float* bias, const Out& y,
                                                             int64_t N, int64_t b) {
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) {  // 16 accumulators: two blocks at a time
        for (int j = 0; j + 2 <= NB; j += 2) dot_rows<8, 2, 1>(xb, Kp, w, bias, y, N, b + j, m);
        if constexpr (NB % 2 == 1) dot_rows<8, 1, 1>(xb, Kp, w, bias, y, N, b + NB - 1, m);
    }
    for (; m + 4 <= M; m += 4) dot_rows<4, NB, 1>(xb, Kp, w, bias, y, N, b, m);
    for (; m + 2 <= M; m += 2) dot_rows<2, NB, 2>(xb, Kp, w, bias, y, N, b, m);
    for (; m < M; ++m) dot_rows<1, NB, 2>(xb, Kp, w, bias, y, N, b, m);
}

static void linear_dot(const uint16_t* xb, int64_t M, int64_t Kp, const uint16_t* w, const float* bias,
                       const Out& y, int64_t N, int64_t n0, int64_t n1) {
    const int64_t b1 = (n1 + bf16p::kRows - 1) / bf16p::kRows;
    int64_t b = n0 / bf16p::kRows;
    for (; b + 4 <= b1; b += 4) dot_blocks<4>(xb, M, Kp, w, bias, y, N, b);
    for (; b < b1; ++b) dot_blocks<1>(xb, M, Kp, w, bias, y, N, b);
}

#if RTPCORE_AMX
// ---- AMX: tiles of 16 activation rows x 32 inputs (A), 16 pair-rows x 16 outputs (B: one bf16p
// block's 16 pairs, 1 KiB as it lies) into 16 x 16 float32 (C). Tiles 0-3 accumulate C for two
// 16-row tiles of activations by two blocks, 4 and 5 hold A, 6 and 7 B. The tile configuration
// is loaded per call (tile state belongs to the thread) and released at its end.

struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Rows [m, m + 16 * MT) by blocks [b, b + NB) of C (tiles 0 .. 3) out: + bias, stored or added.
template <int MT, int NB>
static inline __attribute__((always_inline)) void amx_out(int64_t M, int64_t m, int64_t b, int64_t N,
                                                          const float* bias, const Out& y) {
    alignas(64) float c[4][16 * 16];
    _tile_stored(0, c[0], 64);
    if constexpr (NB > 1) _tile_stored(1, c[1], 64);
    if constexpr (MT > 1) _tile_stored(2, c[2], 64);
    if constexpr (MT > 1 && NB > 1) _tile_stored(3, c[3], 64);
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NB; ++j) {
            const int64_t rows = M - (m + 16 * i) < 16 ? M - (m + 16 * i) : 16;
            for (int64_t r = 0; r < rows; ++r)
                store16(_mm512_load_ps(c[2 * i + j] + 16 * r), m + 16 * i + r, b + j, N, bias, y);
        }
}

// C (tiles 0 .. 3) = x rows [m, m + 16 MT) @ blocks [b, b + NB) over all of Kp. Each tile is
// loaded for the next 32 inputs right after its last use in this step (tiles are not renamed: a
// load waits for the products reading the tile before), so loads overlap the products.
template <int MT, int NB>
static inline __attribute__((always_inline)) void amx_tile(const uint16_t* xb, int64_t Kp, const uint16_t* w,
                                                           int64_t b, int64_t m) {
    const int64_t bstride = Kp * bf16p::kRows;
    const uint16_t* x0 = xb + m * Kp;
    const uint16_t* x1 = x0 + 16 * Kp;
    const uint16_t* w0 = w + b * bstride;
    const uint16_t* w1 = w0 + bstride;
    _tile_zero(0);
    if constexpr (NB > 1) _tile_zero(1);
    if constexpr (MT > 1) _tile_zero(2);
    if constexpr (MT > 1 && NB > 1) _tile_zero(3);
    _tile_loadd(4, x0, Kp * 2);
    _tile_loadd(6, w0, 64);
    if constexpr (NB > 1) _tile_loadd(7, w1, 64);
    if constexpr (MT > 1) _tile_loadd(5, x1, Kp * 2);
    int64_t k = 0;
    for (; k + 32 < Kp; k += 32) {
        const int64_t next = k + 32;
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (NB > 1) _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(4, x0 + next, Kp * 2);
        if constexpr (MT > 1) _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(6, w0 + next * bf16p::kRows, 64);
        if constexpr (MT > 1 && NB > 1) _tile_dpbf16ps(3, 5, 7);
        if constexpr (NB > 1) _tile_loadd(7, w1 + next * bf16p::kRows, 64);
        if constexpr (MT > 1) _tile_loadd(5, x1 + next, Kp * 2);
    }
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT > 1 && NB > 1) _tile_dpbf16ps(3, 5, 7);
}

// xb holds M rows, from 16 rows on rounded up to a multiple of 16 (zero rows past M).
static void linear_amx(const uint16_t* xb, int64_t M, int64_t Kp, const uint16_t* w, const float* bias,
                       const Out& y, int64_t N, int64_t n0, int64_t n1) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = t < 6 && M < 16 ? static_cast<uint8_t>(M) : 16;  // A and C: fewer rows below 16
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    // Chunks of kChunk blocks (their weights stay in L2), by 32 rows (whose activations stay in
    // L1 across the chunk), by pairs of blocks.
    constexpr int64_t kChunk = 16;
    const int64_t b1 = (n1 + bf16p::kRows - 1) / bf16p::kRows;
    for (int64_t c = n0 / bf16p::kRows; c < b1; c += kChunk) {
        const int64_t c1 = c + kChunk < b1 ? c + kChunk : b1;
        for (int64_t m = 0; m < M; m += 32) {
            const bool two_m = m + 16 < M;
            for (int64_t b = c; b < c1; b += 2) {
                const bool two_n = b + 1 < c1;
                if (two_m && two_n) {
                    amx_tile<2, 2>(xb, Kp, w, b, m);
                    amx_out<2, 2>(M, m, b, N, bias, y);
                } else if (two_m) {
                    amx_tile<2, 1>(xb, Kp, w, b, m);
                    amx_out<2, 1>(M, m, b, N, bias, y);
                } else if (two_n) {
                    amx_tile<1, 2>(xb, Kp, w, b, m);
                    amx_out<1, 2>(M, m, b, N, bias, y);
                } else {
                    amx_tile<1, 1>(xb, Kp, w, b, m);
                    amx_out<1, 1>(M, m, b, N, bias, y);
                }
            }
        }
    }
    _tile_release();
}

#endif
