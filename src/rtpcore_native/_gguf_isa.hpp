// The quantized GGUF matrix kernels of rtpcore_native._kernels (DESIGN §20), written once for
// every instruction set: _kernels.cpp includes this file five times, each inside its own
// namespace and `#pragma GCC target`, with
//   RTPCORE_Q_SIMD  1: x86 AVX2 intrinsics for the byte products; 0: portable scalar C++
//   RTPCORE_Q_VNNI  2: AVX512-VNNI (EVEX vpdpbusd), 1: AVX-VNNI (VEX vpdpbusd), 0: none
//   RTPCORE_Q_MT    activation rows per tile: 8 with AVX-512 (32 vector registers hold two
//                   accumulators per row and the operands), 4 with AVX2 (16 registers), 2 in
//                   the baseline
// The rest is GCC vector extensions over 32-byte vectors (one 32-element block, or a 32-element
// sub-block of a K type, per vector), which lower to that target's instructions.
//
// y (M, N) (+)= x (M, K) @ dequant(W).T + bias, with x already quantized to 8-bit blocks
// (gguf::QActs: q8_0-style blocks of 32 for q8_0 / q4_0 / q5_0 / q5_1, q8_K-style blocks of 256
// for the K types). Per block, the weights' small unsigned integers u (or signed q8_0 values)
// meet the activations' int8 q in exact integer dot products; their offsets and mins multiply
// the activation block's sum of q; floats enter once per block:
//   q8_0:  d_w d_x sum(q_w q_x)
//   q4_0:  d_w d_x sum(u q_x) - 8 d_w s_x             (s_x = d_x sum q_x)
//   q5_0:  d_w d_x sum(u q_x) - 16 d_w s_x
//   q5_1:  d_w d_x sum(u q_x) + m_w s_x
//   q4_k, q5_k:  d d_x sum_j sc_j sum(u q_x)_j - dmin d_x sum_j m_j sum(q_x)_j  (j: 32-sub-blocks)
//   q6_k:  d d_x (sum_j sc_j sum(u q_x)_j - 32 sum_j sc_j sum(q_x)_j)         (j: 16-sub-blocks)
// so every instruction set computes the same integers and differs only in float summation
// order. Each function runs single-threaded over the weight rows [n0, n1) it is given.
//
// Also per instruction set (gguf::QKernels): the activations' quantizer (bit for bit the same
// on every set), the weights' dequantizer (bit for bit gguf::dequantize_row's values; prefill
// multiplies a weight so dequantized with torch's GEMM) and the product of rtpcore's own int8
// weights (one scale per row) over q8_0-style activations, a q8_0 product without block scales.

typedef uint8_t U8 __attribute__((vector_size(32)));
typedef int8_t S8 __attribute__((vector_size(32)));
typedef int16_t I16 __attribute__((vector_size(32)));
typedef int32_t I32 __attribute__((vector_size(32)));
typedef float F32 __attribute__((vector_size(32)));
constexpr int kQMT = RTPCORE_Q_MT;
constexpr int64_t kPrefetchRows = 8;  // weight rows read ahead (see tile)

// Every helper is inlined: none passes a 32-byte vector in a call (whose ABI without AVX
// differs, and GCC would say so).
#define RTPCORE_QINLINE static inline __attribute__((always_inline))

RTPCORE_QINLINE U8 ld32(const void* p) {
    U8 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// The IEEE half at p (F16C's conversion where there is one).
RTPCORE_QINLINE float half(const uint8_t* p) {
#if RTPCORE_Q_SIMD
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
#else
    return gguf::f16_at(p);
#endif
}

// 16 bytes of packed nibbles -> 32 bytes: the low nibbles, then the high ones.
RTPCORE_QINLINE U8 nibbles(const uint8_t* p) {
#if RTPCORE_Q_SIMD
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(h), _mm_srli_epi16(h, 4), 1);
    return (U8)_mm256_and_si256(v, _mm256_set1_epi8(0x0f));
#else
    U8 v;
    for (int i = 0; i < 16; ++i) {
        v[i] = p[i] & 0xf;
        v[i + 16] = p[i] >> 4;
    }
    return v;
#endif
}

// Byte j = 0x10 where bit j of qh is set, else 0 (the fifth bit of q5_0 / q5_1 element j).
RTPCORE_QINLINE U8 fifth_bits(uint32_t qh) {
#if RTPCORE_Q_SIMD
    // Byte j takes byte j / 8 of qh, then tests its bit j % 8.
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                    _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return (U8)_mm256_and_si256(v, _mm256_set1_epi8(0x10));
#else
    U8 v;
    for (int j = 0; j < 32; ++j) v[j] = static_cast<uint8_t>(((qh >> j) & 1) << 4);
    return v;
#endif
}

// acc + the sums of every 4 consecutive products u[i] * s[i] (u unsigned, at most 128, s signed).
RTPCORE_QINLINE I32 dot_us(const I32& acc, const U8& u, const S8& s) {
#if RTPCORE_Q_VNNI == 2
    return (I32)_mm256_dpbusd_epi32((__m256i)acc, (__m256i)u, (__m256i)s);
#elif RTPCORE_Q_VNNI == 1
    return (I32)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)u, (__m256i)s);
#elif RTPCORE_Q_SIMD
    // u * s pairs fit int16 (128 * 127 * 2 < 2^15), so maddubs does not saturate.
    return acc + (I32)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)u, (__m256i)s), _mm256_set1_epi16(1));
#else
    I32 r = acc;
    for (int i = 0; i < 8; ++i)
        for (int k = 0; k < 4; ++k) r[i] += static_cast<int32_t>(u[4 * i + k]) * static_cast<int32_t>(s[4 * i + k]);
    return r;
#endif
}

// The same for two signed operands: |a| times b with a's sign (the byte product takes one
// unsigned operand).
RTPCORE_QINLINE I32 dot_ss(const I32& acc, const S8& a, const S8& b) {
#if RTPCORE_Q_SIMD
    return dot_us(acc, (U8)_mm256_sign_epi8((__m256i)a, (__m256i)a), (S8)_mm256_sign_epi8((__m256i)b, (__m256i)a));
#else
    I32 r = acc;
    for (int i = 0; i < 8; ++i)
        for (int k = 0; k < 4; ++k) r[i] += static_cast<int32_t>(a[4 * i + k]) * static_cast<int32_t>(b[4 * i + k]);
    return r;
#endif
}

// acc + lane i: the sum over bytes 4i..4i+3 of u * s * sc16[byte / 2] (u at most 63: the pairs
// fit int16). VNNI's vpdpwssd multiplies the pairs by the scales and adds in one instruction.
RTPCORE_QINLINE I32 dot_us_scaled(const I32& acc, const U8& u, const S8& s, const I16& sc16) {
#if RTPCORE_Q_SIMD
    const __m256i pairs = _mm256_maddubs_epi16((__m256i)u, (__m256i)s);
#if RTPCORE_Q_VNNI == 2
    return (I32)_mm256_dpwssd_epi32((__m256i)acc, pairs, (__m256i)sc16);
#elif RTPCORE_Q_VNNI == 1
    return (I32)_mm256_dpwssd_avx_epi32((__m256i)acc, pairs, (__m256i)sc16);
#else
    return acc + (I32)_mm256_madd_epi16(pairs, (__m256i)sc16);
#endif
#else
    I32 r = acc;
    for (int i = 0; i < 8; ++i)
        for (int k = 0; k < 4; ++k)
            r[i] += static_cast<int32_t>(u[4 * i + k]) * static_cast<int32_t>(s[4 * i + k]) * sc16[(4 * i + k) / 2];
    return r;
#endif
}

// Lane i: a[2i] b[2i] + a[2i+1] b[2i+1] in int32.
RTPCORE_QINLINE I32 madd16(const I16& a, const I16& b) {
#if RTPCORE_Q_SIMD
    return (I32)_mm256_madd_epi16((__m256i)a, (__m256i)b);
#else
    I32 r;
    for (int i = 0; i < 8; ++i) r[i] = static_cast<int32_t>(a[2 * i]) * b[2 * i] + static_cast<int32_t>(a[2 * i + 1]) * b[2 * i + 1];
    return r;
#endif
}

RTPCORE_QINLINE F32 to_f32(const I32& v) { return __builtin_convertvector(v, F32); }

RTPCORE_QINLINE float hsum8(const F32& v) {
#if RTPCORE_Q_SIMD
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
#else
    float s = 0.0f;
    for (int i = 0; i < 8; ++i) s += v[i];
    return s;
#endif
}

// ---- weight blocks decoded into registers

// A 32-element block: its integers, its scale and the coefficient c of the activation
// block's s (the offset or min term).
struct Block32 {
    U8 q;
    float d, c;
};

template <gguf::Type T>
RTPCORE_QINLINE Block32 decode32(const uint8_t* p) {
    Block32 b;
    b.d = half(p);
    if constexpr (T == gguf::Type::q8_0) {
        b.q = ld32(p + 2);
        b.c = 0.0f;
    } else if constexpr (T == gguf::Type::q4_0) {
        b.q = nibbles(p + 2);
        b.c = -8.0f * b.d;
    } else if constexpr (T == gguf::Type::q5_0) {
        uint32_t qh;
        std::memcpy(&qh, p + 2, sizeof qh);
        b.q = nibbles(p + 6) | fifth_bits(qh);
        b.c = -16.0f * b.d;
    } else {  // q5_1
        uint32_t qh;
        std::memcpy(&qh, p + 4, sizeof qh);
        b.q = nibbles(p + 8) | fifth_bits(qh);
        b.c = half(p + 2);
    }
    return b;
}

// A 256-element K block, read one 32-element sub-block c (0-7) at a time: its integers
// (k_sub), the int16 scales that multiply them (k_scale: one per 16 elements, as lanes of the
// madd that applies them), and per block (KHead) the 16 per-16 coefficients of the activations'
// per-16 sums and the float scales of both terms (dmin = d for q6_k, whose offset term folds
// into the main sum). The scales are unpacked with vector shuffles, once per block: a scalar
// unpacking cost as much as the block's products at batch 1.
struct KHead {
    float d, dmin;
    I16 mn;
#if RTPCORE_Q_SIMD
    __m256i sc_lo, sc_hi;  // int16 scales; both 128-bit halves of sc_lo hold scales 0-7, of sc_hi 8-15
#else
    int16_t sc[16];  // per 16 elements
#endif
};

#if RTPCORE_Q_SIMD
// The eight 6-bit scales (bytes 0-7) and mins (bytes 8-15) of a q4_k / q5_k block, from its 12
// packed scale bytes at s (read as 16: the 4 after them are the block's own qh or qs). As
// ggml's kmask arithmetic on the three 32-bit words a0 a1 a2:
//   scales 0-3 = a0 & 0x3f..; scales 4-7 = (a2 & 0x0f..) | ((a0 >> 6) & 0x03..) << 4
//   mins 0-3   = a1 & 0x3f..; mins 4-7   = ((a2 >> 4) & 0x0f..) | ((a1 >> 6) & 0x03..) << 4
RTPCORE_QINLINE __m128i scales_mins_k4(const uint8_t* s) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    __m128i lo = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));  // a0 a2 a1 a2
    lo = _mm_srlv_epi32(lo, _mm_set_epi32(4, 0, 0, 0));
    lo = _mm_and_si128(lo, _mm_set_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f));
    __m128i hi = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 0, 0));  // . a0 . a1
    hi = _mm_and_si128(_mm_srli_epi32(hi, 6), _mm_set_epi32(0x03030303, 0, 0x03030303, 0));
    return _mm_or_si128(lo, _mm_slli_epi32(hi, 4));
}
#endif

template <gguf::Type T>
RTPCORE_QINLINE KHead k_head(const uint8_t* p) {
    KHead h;
    if constexpr (T == gguf::Type::q6_k) {
        h.d = h.dmin = half(p + 208);
#if RTPCORE_Q_SIMD
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
        h.sc_lo = _mm256_permute4x64_epi64(s16, 0x44);
        h.sc_hi = _mm256_permute4x64_epi64(s16, 0xee);
        h.mn = (I16)_mm256_slli_epi16(s16, 5);
#else
        const auto* sc = reinterpret_cast<const int8_t*>(p + 192);
        for (int g = 0; g < 16; ++g) {
            h.sc[g] = sc[g];
            h.mn[g] = static_cast<int16_t>(32 * sc[g]);
        }
#endif
    } else {  // q4_k, q5_k
        h.d = half(p);
        h.dmin = half(p + 2);
#if RTPCORE_Q_SIMD
        const __m128i sm = scales_mins_k4(p + 4);
        h.sc_lo = h.sc_hi = _mm256_permute4x64_epi64(_mm256_cvtepu8_epi16(sm), 0x44);
        const __m128i mins2 = _mm_shuffle_epi8(sm, _mm_set_epi8(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8));
        h.mn = (I16)_mm256_cvtepu8_epi16(mins2);
#else
        for (int j = 0; j < 8; ++j) {
            int sc, m;
            gguf::scale_min_k4(j, p + 4, sc, m);
            h.sc[2 * j] = h.sc[2 * j + 1] = static_cast<int16_t>(sc);
            h.mn[2 * j] = h.mn[2 * j + 1] = static_cast<int16_t>(m);
        }
#endif
    }
    return h;
}

// The scales of sub-block c: words 0-7 that of its first 16 elements, 8-15 of its last 16.
template <gguf::Type T>
RTPCORE_QINLINE I16 k_scale(const KHead& h, int c) {
#if RTPCORE_Q_SIMD
    if constexpr (T == gguf::Type::q6_k) {
        const int lo = 4 * (c % 4);  // byte of word 2c (mod 8), then of word 2c + 1
        const __m256i pick = _mm256_set_epi64x(0x0101010101010101ll * (lo + 2) + 0x0100010001000100ll,
                                               0x0101010101010101ll * (lo + 2) + 0x0100010001000100ll,
                                               0x0101010101010101ll * lo + 0x0100010001000100ll,
                                               0x0101010101010101ll * lo + 0x0100010001000100ll);
        return (I16)_mm256_shuffle_epi8(c < 4 ? h.sc_lo : h.sc_hi, pick);
    } else {
        return (I16)_mm256_shuffle_epi8(h.sc_lo, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * c)));
    }
#else
    I16 v;
    for (int i = 0; i < 8; ++i) {
        v[i] = h.sc[2 * c];
        v[i + 8] = h.sc[2 * c + 1];
    }
    return v;
#endif
}

// Bit `shift` of every byte of v moved to bit 4, the rest cleared (q5_k's fifth bits).
RTPCORE_QINLINE U8 bit_to_4(const U8& v, int shift) {
#if RTPCORE_Q_SIMD
    const __m256i s = shift <= 4 ? _mm256_slli_epi16((__m256i)v, 4 - shift) : _mm256_srli_epi16((__m256i)v, shift - 4);
    return (U8)_mm256_and_si256(s, _mm256_set1_epi8(0x10));
#else
    return ((v >> shift) & 1) << 4;
#endif
}

// The unsigned integers of sub-block c (elements 32c .. 32c + 31) of the K block at p.
template <gguf::Type T>
RTPCORE_QINLINE U8 k_sub(const uint8_t* p, int c) {
    if constexpr (T == gguf::Type::q6_k) {
        // Each half h (128 elements) has ql (64 B) and qh (32 B): sub-block 4h + i takes the low
        // (i < 2) or high nibbles of ql[32 (i % 2) ...] and bits 2i, 2i + 1 of qh.
        const int h = c / 4, i = c % 4;
        const U8 ql = ld32(p + 64 * h + 32 * (i % 2)), qh = ld32(p + 128 + 32 * h);
        const U8 lo = i < 2 ? (ql & 0xf) : (ql >> 4);
#if RTPCORE_Q_SIMD
        const __m256i hb = 2 * i <= 4 ? _mm256_slli_epi16((__m256i)qh, 4 - 2 * i) : _mm256_srli_epi16((__m256i)qh, 2 * i - 4);
        return lo | (U8)_mm256_and_si256(hb, _mm256_set1_epi8(0x30));
#else
        return lo | (((qh >> (2 * i)) & 3) << 4);
#endif
    } else {  // q4_k, q5_k: each 32 bytes of qs hold sub-blocks 2j (low nibbles) and 2j + 1
        constexpr bool five = T == gguf::Type::q5_k;
        const U8 raw = ld32(p + (five ? 48 : 16) + 32 * (c / 2));
        U8 q = c % 2 ? raw >> 4 : raw & 0xf;
        if constexpr (five) q |= bit_to_4(ld32(p + 16), c);
        return q;
    }
}

// ---- the products

// out[i] = dot(activation row m0 + i, weight row w) for MT rows, 32-element block types; with
// I8, w is a row of K int8 weights (rtpcore's own int8, one scale per row applied by the
// caller), a q8_0 row without block scales. With one or two rows, even and odd blocks go to
// two accumulators: one would make every block wait for the last one's add.
template <gguf::Type T, int MT, bool I8 = false>
RTPCORE_QINLINE void dot_rows32(const gguf::QActs& a, int64_t m0, const uint8_t* w,
                                                            float (&out)[kQMT]) {
    constexpr int bytes = I8 ? 32 : gguf::info(T).bytes;
    constexpr int U = MT <= 2 ? 2 : 1;
    const int64_t K = a.K, nb = K / 32;
    F32 acc[U][MT];
    float sacc[U][MT];
    for (int u = 0; u < U; ++u)
        for (int i = 0; i < MT; ++i) {
            acc[u][i] = F32{};
            sacc[u][i] = 0.0f;
        }
    auto step = [&](int64_t b, int u) __attribute__((always_inline)) {
        Block32 wb;
        if constexpr (I8) {
            wb.q = ld32(w + 32 * b);
            wb.d = 1.0f;
        } else {
            wb = decode32<T>(w + b * bytes);
        }
        for (int i = 0; i < MT; ++i) {
            const int64_t r = m0 + i;
            const S8 xq = (S8)ld32(a.qs + r * K + 32 * b);
            I32 isum = I32{};
            if constexpr (I8 || T == gguf::Type::q8_0) {
                isum = dot_ss(isum, (S8)wb.q, xq);
            } else {
                isum = dot_us(isum, wb.q, xq);
                sacc[u][i] += wb.c * a.s[r * nb + b];
            }
            acc[u][i] += to_f32(isum) * (I8 ? a.d[r * nb + b] : wb.d * a.d[r * nb + b]);
        }
    };
    int64_t b = 0;
    if constexpr (U == 2)
        for (; b + 1 < nb; b += 2) {
            step(b, 0);
            step(b + 1, 1);
        }
    for (; b < nb; ++b) step(b, 0);
    for (int i = 0; i < MT; ++i) {
        F32 s = acc[0][i];
        float c = sacc[0][i];
        if constexpr (U == 2) {
            s += acc[1][i];
            c += sacc[1][i];
        }
        out[i] = hsum8(s) + c;
    }
}

// The same for the 256-element K types.
template <gguf::Type T, int MT>
RTPCORE_QINLINE void dot_rowsK(const gguf::QActs& a, int64_t m0, const uint8_t* w,
                                                           float (&out)[kQMT]) {
    constexpr int bytes = gguf::info(T).bytes;
    const int64_t K = a.K, nb = K / 256;
    F32 acc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = F32{};
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = w + b * bytes;
        const KHead h = k_head<T>(p);
        I32 isum[MT];
        for (int i = 0; i < MT; ++i) isum[i] = I32{};
#pragma GCC unroll 8  // c must be a constant in k_sub and k_scale
        for (int c = 0; c < 8; ++c) {
            const U8 q = k_sub<T>(p, c);
            const I16 sc = k_scale<T>(h, c);
            for (int i = 0; i < MT; ++i)
                isum[i] = dot_us_scaled(isum[i], q, (S8)ld32(a.qs + (m0 + i) * K + 256 * b + 32 * c), sc);
        }
        for (int i = 0; i < MT; ++i) {
            const int64_t r = m0 + i;
            I16 bs;
            std::memcpy(&bs, a.bsum + r * (K / 16) + 16 * b, sizeof bs);
            const I32 corr = madd16(h.mn, bs);
            const float dx = a.d[r * nb + b];
            if constexpr (T == gguf::Type::q6_k) {
                acc[i] += to_f32(isum[i] - corr) * (h.d * dx);
            } else {
                acc[i] += to_f32(isum[i]) * (h.d * dx);
                acc[i] -= to_f32(corr) * (h.dmin * dx);
            }
        }
    }
    for (int i = 0; i < MT; ++i) out[i] = hsum8(acc[i]);
}

// Rows [m0, m0 + MT) of y for weight rows [n0, n1) (I8: int8 rows, scaled by scale[n]; a
// function of its own: inlined into qlinear, GCC keeps a one-row tile's loop counters in memory).
template <gguf::Type T, int MT, bool I8 = false>
__attribute__((noinline)) static void tile(const gguf::QActs& a, int64_t m0, const uint8_t* w, int64_t row_bytes,
                                           const float* scale, const float* bias, float* y, int64_t N,
                                           bool accumulate, int64_t n0, int64_t n1) {
    float out[kQMT];
    for (int64_t n = n0; n < n1; ++n) {
#if RTPCORE_Q_SIMD
        // The weight row kPrefetchRows ahead, into L1: the hardware prefetcher stops at each 4 KiB
        // page, and a decode step reads every weight once from memory (measured on a Q8_0 decode
        // step of SmolLM2's shape, 2 threads: 15.8 -> 9.0 ms).
        if (n + kPrefetchRows < n1) {
            const char* ahead = reinterpret_cast<const char*>(w + (n + kPrefetchRows) * row_bytes);
            for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        }
#endif
        if constexpr (I8 || gguf::info(T).block == 32)
            dot_rows32<T, MT, I8>(a, m0, w + n * row_bytes, out);
        else
            dot_rowsK<T, MT>(a, m0, w + n * row_bytes, out);
        const float bn = bias ? bias[n] : 0.0f;
        for (int i = 0; i < MT; ++i) {
            const float v = (I8 ? out[i] * scale[n] : out[i]) + bn;
            float* dst = y + (m0 + i) * N + n;
            *dst = accumulate ? *dst + v : v;
        }
    }
}

// y[:, n0:n1] (+)= x @ dequant(W[n0:n1]).T + bias for quantized activations `a` of M rows.
// Weight rows are taken in groups of about 64 KiB (kept in L2 while every tile of activation
// rows passes over them); each weight block is decoded once per tile of rows.
template <gguf::Type T, bool I8 = false>
static void qlinear_rows(const gguf::QActs& a, int64_t M, const uint8_t* w, const float* scale, const float* bias,
                         float* y, int64_t N, bool accumulate, int64_t n0, int64_t n1) {
    const int64_t row_bytes = I8 ? a.K : gguf::row_bytes(T, a.K);
    int64_t group = (int64_t{1} << 16) / row_bytes;
    group = group < 1 ? 1 : group;
    for (int64_t g0 = n0; g0 < n1; g0 += group) {
        const int64_t g1 = g0 + group < n1 ? g0 + group : n1;
        int64_t m = 0;
        for (; m + kQMT <= M; m += kQMT) tile<T, kQMT, I8>(a, m, w, row_bytes, scale, bias, y, N, accumulate, g0, g1);
        if constexpr (kQMT > 4)
            for (; m + 4 <= M; m += 4) tile<T, 4, I8>(a, m, w, row_bytes, scale, bias, y, N, accumulate, g0, g1);
        if constexpr (kQMT > 2)
            for (; m + 2 <= M; m += 2) tile<T, 2, I8>(a, m, w, row_bytes, scale, bias, y, N, accumulate, g0, g1);
        for (; m < M; ++m) tile<T, 1, I8>(a, m, w, row_bytes, scale, bias, y, N, accumulate, g0, g1);
    }
}

#if RTPCORE_Q_SIMD
// ---- many activation rows: the 32-element types and int8 as a GEMM over repacked weights
//
// qlinear_rows computes one weight row against a tile of activation rows: each (row, block) pair
// ends in a horizontal sum's worth of float work (convert, scale, add), as many float operations
// as byte dot products. Here, for kGN output columns at a time, the blocks are decoded once
// into bytes and repacked as the byte dot product wants them: per block, per 4 consecutive k,
// the kGN columns' 4 bytes side by side (a vector holds 8 columns x 4 k). An activation row's 4
// bytes, broadcast, meet 8 columns in one byte dot product; per block and row the float work is
// one convert and one multiply-add per 8 columns. The integers are those of qlinear_rows (the
// same sum of q_w q_x per block); the float sums run in another order.
//
// With VNNI (vpdpbusd: unsigned by signed bytes, summed into int32 lanes) the activations enter
// as q + 128 (unsigned), the weights as signed int8 with their offsets folded in, and each
// column's integer sum starts at -128 times its block's sum of weights; q5_1's min meets the
// activations' block sums.
//
// Without VNNI (AVX2's vpmaddubsw: unsigned by signed bytes into int16 pairs, which saturate;
// vpmaddwd then widens to int32) the activations stay signed (|q| <= 127) and:
//   q4_0, q5_0, q5_1 keep their unsigned integers u (at most 15 / 31): a pair u q + u' q' is at
//     most 3810 / 7874, so the int16 pairs of 8 / 4 consecutive steps add up before one
//     vpmaddwd widens them (a vpmaddwd per 8 / 4 products instead of one each); the offset or
//     min c (-8 d, -16 d, m) multiplies the activations' block sum s_x;
//   q8_0 and int8 are signed on both sides: |q_w| (once per 4 k, for every row of the tile)
//     times q_x with q_w's sign (|q_x| <= 127, |q_w| <= 128: a pair fits int16, and a weight of
//     -128 is exact), a vpmaddwd per product.
constexpr int kGN = 16;  // output columns per group: two vectors
#if RTPCORE_Q_VNNI
constexpr bool kGemmUnsigned = true;                   // activations as q + 128
constexpr int kGMT = RTPCORE_Q_VNNI == 2 ? 4 : 2;      // activation rows per tile (32 / 16 registers)
#else
constexpr bool kGemmUnsigned = false;
constexpr int kGMT = RTPCORE_Q_MT > 4 ? 4 : 2;         // 32 registers (AVX-512's set) / 16 (AVX2)
#endif
constexpr int64_t kGemmRows = 16;  // from this many rows on (fewer: qlinear_rows)

// The weights of a group, per block j of 32 k: w (8, kGN) 4 bytes per (k / 4, column), each
// column's integers as bytes (with VNNI: q8_0, q4_0, q5_0, int8 signed, offsets folded in; q5_1
// unsigned; without: q8_0 and int8 signed, the others unsigned); off (kGN, VNNI only): -128 *
// the column's sum of them; d (kGN): the column's scale; mn (kGN): the coefficient of the
// activations' block sum (with VNNI q5_1's min m only; without, q4_0's -8 d, q5_0's -16 d,
// q5_1's m). The weight is d * w + mn.
// (The K types keep qlinear_rows: their sub-block scales, applied in integers per 256, make it
// faster than this GEMM with its float step per 32 was for them; measured, one thread: q4_k
// 576 x 1536 at 512 rows 6.5 ms against 10.0, q6_k 5.9 against 10.4.)
struct Repacked {
    std::vector<int32_t> w, off;
    std::vector<float> d, mn;
    std::vector<uint8_t> xu;  // (M, K): q_x + 128 where the activations came without it
};

static Repacked& repacked() {
    thread_local Repacked r;
    return r;
}

// Whether type T (or int8) multiplies with the coefficient mn of the activations' block sums.
template <gguf::Type T, bool I8>
constexpr bool gemm_min() {
    if constexpr (I8 || T == gguf::Type::q8_0)
        return false;
    else
        return !kGemmUnsigned || T == gguf::Type::q5_1;
}

// Column c of a group: weight row `row`'s blocks, repacked (see Repacked).
template <gguf::Type T, bool I8>
static void repack_column(const uint8_t* row, int64_t K, const float* scale_n, int c, int32_t* w, int32_t* off,
                          float* d, float* mn) {
    auto put = [&](int64_t j, const int8_t* q, float dj, float mj) {
        if constexpr (kGemmUnsigned) {
            int32_t sum = 0;
            for (int e = 0; e < 32; ++e) sum += q[e];
            off[j * kGN + c] = -128 * sum;
        }
        d[j * kGN + c] = dj;
        if (mn) mn[j * kGN + c] = mj;
        for (int k4 = 0; k4 < 8; ++k4) std::memcpy(&w[(j * 8 + k4) * kGN + c], q + 4 * k4, 4);
    };
    if constexpr (I8) {
        for (int64_t j = 0; j < K / 32; ++j) put(j, reinterpret_cast<const int8_t*>(row + 32 * j), *scale_n, 0.0f);
    } else {
        for (int64_t j = 0; j < K / 32; ++j) {
            const Block32 wb = decode32<T>(row + j * gguf::info(T).bytes);
            S8 q = (S8)wb.q;
            if constexpr (kGemmUnsigned && T == gguf::Type::q4_0) q = q - 8;
            if constexpr (kGemmUnsigned && T == gguf::Type::q5_0) q = q - 16;
            put(j, reinterpret_cast<const int8_t*>(&q), wb.d, wb.c);  // wb.c: -8 d, -16 d, m
        }
    }
}

// Without VNNI: how many steps of 4 k a block's int16 pairs add up before vpmaddwd widens them
// (see above); 0: q8_0 and int8, signed, widened every step.
template <gguf::Type T, bool I8>
constexpr int gemm_steps() {
    if constexpr (I8 || T == gguf::Type::q8_0)
        return 0;
    else
        return T == gguf::Type::q4_0 ? 8 : 4;
}

// out (MT, kGN) = the float sums over blocks [j0, j1) of activation rows [m0, m0 + MT) against
// one group's columns (xu: the activations as q + 128, with VNNI only).
template <int MT, bool MIN, int STEPS>
__attribute__((noinline)) static void gemm_tile(const uint8_t* xu, const gguf::QActs& a, int64_t j0, int64_t j1,
                                                int64_t m0, const int32_t* w, const int32_t* off, const float* d,
                                                const float* mn, float* out) {
    const int64_t K = a.K, nb = K / 32;
    F32 fa[MT][2];
    for (int i = 0; i < MT; ++i) fa[i][0] = fa[i][1] = F32{};
    for (int64_t j = j0; j < j1; ++j) {
        I32 ia[MT][2];
        const int32_t* wj = w + j * 8 * kGN;
#if RTPCORE_Q_VNNI
        I32 o0, o1;
        std::memcpy(&o0, off + j * kGN, sizeof o0);
        std::memcpy(&o1, off + j * kGN + 8, sizeof o1);
        for (int i = 0; i < MT; ++i) {
            ia[i][0] = o0;
            ia[i][1] = o1;
        }
#pragma GCC unroll 8
        for (int k4 = 0; k4 < 8; ++k4) {
            I32 w0, w1;
            std::memcpy(&w0, wj + k4 * kGN, sizeof w0);
            std::memcpy(&w1, wj + k4 * kGN + 8, sizeof w1);
            for (int i = 0; i < MT; ++i) {
                int32_t x4;
                std::memcpy(&x4, xu + (m0 + i) * K + 32 * j + 4 * k4, sizeof x4);
                const U8 xb = (U8)(I32{} + x4);
                ia[i][0] = dot_us(ia[i][0], xb, (S8)w0);
                ia[i][1] = dot_us(ia[i][1], xb, (S8)w1);
            }
        }
#else
        (void)xu;
        (void)off;
        const __m256i ones = _mm256_set1_epi16(1);
        for (int i = 0; i < MT; ++i) ia[i][0] = ia[i][1] = I32{};
        // (Not unrolled: unrolled, GCC sums the 8 steps' products as a tree and spills them.)
        if constexpr (STEPS == 0) {  // signed: |q_w| times q_x with q_w's sign
#pragma GCC unroll 1
            for (int k4 = 0; k4 < 8; ++k4) {
                __m256i w0, w1;
                std::memcpy(&w0, wj + k4 * kGN, sizeof w0);
                std::memcpy(&w1, wj + k4 * kGN + 8, sizeof w1);
                const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
                for (int i = 0; i < MT; ++i) {
                    int32_t x4;
                    std::memcpy(&x4, a.qs + (m0 + i) * K + 32 * j + 4 * k4, sizeof x4);
                    const __m256i xb = _mm256_set1_epi32(x4);
                    ia[i][0] += (I32)_mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0)), ones);
                    ia[i][1] += (I32)_mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1)), ones);
                }
            }
        } else {  // unsigned weights: int16 pairs summed over STEPS steps, then widened
            for (int s0 = 0; s0 < 8; s0 += STEPS) {
                I16 p[MT][2];
                for (int i = 0; i < MT; ++i) p[i][0] = p[i][1] = I16{};
#pragma GCC unroll 1
                for (int k4 = s0; k4 < s0 + STEPS; ++k4) {
                    __m256i w0, w1;
                    std::memcpy(&w0, wj + k4 * kGN, sizeof w0);
                    std::memcpy(&w1, wj + k4 * kGN + 8, sizeof w1);
                    for (int i = 0; i < MT; ++i) {
                        int32_t x4;
                        std::memcpy(&x4, a.qs + (m0 + i) * K + 32 * j + 4 * k4, sizeof x4);
                        const __m256i xb = _mm256_set1_epi32(x4);
                        p[i][0] += (I16)_mm256_maddubs_epi16(w0, xb);
                        p[i][1] += (I16)_mm256_maddubs_epi16(w1, xb);
                    }
                }
                for (int i = 0; i < MT; ++i)
                    for (int h = 0; h < 2; ++h) ia[i][h] += (I32)_mm256_madd_epi16((__m256i)p[i][h], ones);
            }
        }
#endif
        F32 d0, d1;
        std::memcpy(&d0, d + j * kGN, sizeof d0);
        std::memcpy(&d1, d + j * kGN + 8, sizeof d1);
        for (int i = 0; i < MT; ++i) {
            const float s = a.d[(m0 + i) * nb + j];
            fa[i][0] += to_f32(ia[i][0]) * (d0 * s);
            fa[i][1] += to_f32(ia[i][1]) * (d1 * s);
        }
        if constexpr (MIN) {  // + mn * the activations' block sum s_x = d_x sum q_x
            F32 n0, n1;
            std::memcpy(&n0, mn + j * kGN, sizeof n0);
            std::memcpy(&n1, mn + j * kGN + 8, sizeof n1);
            for (int i = 0; i < MT; ++i) {
                const float sx = a.s[(m0 + i) * nb + j];
                fa[i][0] += n0 * sx;
                fa[i][1] += n1 * sx;
            }
        }
    }
    for (int i = 0; i < MT; ++i) {
        std::memcpy(out + i * kGN, &fa[i][0], sizeof fa[i][0]);
        std::memcpy(out + i * kGN + 8, &fa[i][1], sizeof fa[i][1]);
    }
}

// Rows of activations, and k, per pass over the repacked columns: the rows' q + 128 stay in L2
// (64 rows of 512: 32 KiB) and a group's slice of weights in L1 (512 k x 16 columns: 8 KiB)
// while every tile of rows passes over it; y holds the sums between passes.
constexpr int64_t kGemmRowBlock = 64;
constexpr int64_t kGemmDepth = 16;  // blocks of 32

// y[:, n0:n1] (+)= x @ dequant(W[n0:n1]).T (* scale) + bias from the quantized activations `a`
// (I8: rtpcore's int8 rows, each column's scale[n] folded into its scales).
template <gguf::Type T, bool I8 = false>
static void qgemm(const gguf::QActs& a, int64_t M, const uint8_t* w, const float* scale, const float* bias, float* y,
                  int64_t N, bool accumulate, int64_t n0, int64_t n1) {
    constexpr bool MIN = gemm_min<T, I8>();
    constexpr int STEPS = gemm_steps<T, I8>();
    const int64_t K = a.K, nb = K / 32, row_bytes = I8 ? K : gguf::row_bytes(T, K);
    const int64_t groups = (n1 - n0 + kGN - 1) / kGN;
    Repacked& r = repacked();
    const uint8_t* xu = a.qu;
    if (kGemmUnsigned && !xu) {  // activations quantized without their unsigned copy
        r.xu.resize(static_cast<size_t>(M * K));
        for (int64_t i = 0; i < M * K; ++i) r.xu[i] = static_cast<uint8_t>(a.qs[i]) ^ 0x80u;
        xu = r.xu.data();
    }
    const int64_t gw_size = nb * 8 * kGN, gs_size = nb * kGN;
    r.w.assign(static_cast<size_t>(groups * gw_size), 0);
    r.off.assign(kGemmUnsigned ? static_cast<size_t>(groups * gs_size) : 0, 0);
    r.d.assign(static_cast<size_t>(groups * gs_size), 0.0f);
    r.mn.assign(MIN ? static_cast<size_t>(groups * gs_size) : 0, 0.0f);
    for (int64_t g = 0; g < groups; ++g)  // every column of the range, once (padding columns stay 0)
        for (int c = 0; c < kGN && n0 + g * kGN + c < n1; ++c) {
            const int64_t n = n0 + g * kGN + c;
            repack_column<T, I8>(w + n * row_bytes, K, I8 ? scale + n : nullptr, c, &r.w[g * gw_size],
                                 kGemmUnsigned ? &r.off[g * gs_size] : nullptr, &r.d[g * gs_size],
                                 MIN ? &r.mn[g * gs_size] : nullptr);
        }
    float out[kGMT * kGN];
    for (int64_t mb = 0; mb < M; mb += kGemmRowBlock) {
        const int64_t me = mb + kGemmRowBlock < M ? mb + kGemmRowBlock : M;
        for (int64_t j0 = 0; j0 < nb; j0 += kGemmDepth) {
            const int64_t j1 = j0 + kGemmDepth < nb ? j0 + kGemmDepth : nb;
            const bool first = j0 == 0;
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t g0 = n0 + g * kGN;
                const int cols = static_cast<int>(n1 - g0 < kGN ? n1 - g0 : kGN);
                const int32_t* gw = &r.w[g * gw_size];
                const int32_t* goff = kGemmUnsigned ? &r.off[g * gs_size] : nullptr;
                const float* gd = &r.d[g * gs_size];
                const float* gmn = MIN ? &r.mn[g * gs_size] : nullptr;
                auto store = [&](int64_t m0, int rows) {
                    for (int i = 0; i < rows; ++i) {
                        float* dst = y + (m0 + i) * N + g0;
                        const float* src = out + i * kGN;
                        if (cols == kGN) {  // two vectors
                            for (int h = 0; h < kGN; h += 8) {
                                F32 v, bv = F32{};
                                std::memcpy(&v, src + h, sizeof v);
                                if (bias && first) std::memcpy(&bv, bias + g0 + h, sizeof bv);
                                v += bv;
                                if (!first || accumulate) {
                                    F32 prev;
                                    std::memcpy(&prev, dst + h, sizeof prev);
                                    v += prev;
                                }
                                std::memcpy(dst + h, &v, sizeof v);
                            }
                        } else if (!first || accumulate) {
                            for (int c = 0; c < cols; ++c) dst[c] += src[c] + (first && bias ? bias[g0 + c] : 0.0f);
                        } else {
                            for (int c = 0; c < cols; ++c) dst[c] = src[c] + (bias ? bias[g0 + c] : 0.0f);
                        }
                    }
                };
                int64_t m = mb;
                for (; m + kGMT <= me; m += kGMT) {
                    gemm_tile<kGMT, MIN, STEPS>(xu, a, j0, j1, m, gw, goff, gd, gmn, out);
                    store(m, kGMT);
                }
                for (; m < me; ++m) {
                    gemm_tile<1, MIN, STEPS>(xu, a, j0, j1, m, gw, goff, gd, gmn, out);
                    store(m, 1);
                }
            }
        }
    }
}
#endif

template <gguf::Type T>
static void qlinear(const gguf::QActs& a, int64_t M, const uint8_t* w, const float* bias, float* y, int64_t N,
                    bool accumulate, int64_t n0, int64_t n1) {
#if RTPCORE_Q_SIMD
    if constexpr (gguf::info(T).block == 32) {
        if (M >= kGemmRows) return qgemm<T>(a, M, w, nullptr, bias, y, N, accumulate, n0, n1);
    }
#endif
    qlinear_rows<T>(a, M, w, nullptr, bias, y, N, accumulate, n0, n1);
}

// rtpcore's int8 weights (N, K) with one float scale per row, K a multiple of 32, over
// activations quantized to q8_0-style blocks: y = scale[n] * sum_b d_x[b] dot(w_b, q_x[b]).
static void linear_i8(const gguf::QActs& a, int64_t M, const int8_t* w, const float* scale, const float* bias,
                      float* y, int64_t N, bool accumulate, int64_t n0, int64_t n1) {
#if RTPCORE_Q_SIMD
    if (M >= kGemmRows)
        return qgemm<gguf::Type::q8_0, true>(a, M, reinterpret_cast<const uint8_t*>(w), scale, bias, y, N, accumulate,
                                             n0, n1);
#endif
    qlinear_rows<gguf::Type::q8_0, true>(a, M, reinterpret_cast<const uint8_t*>(w), scale, bias, y, N, accumulate,
                                         n0, n1);
}

// ---- activations quantized, weights dequantized

// Rows [0, M) of x (M, a.K) quantized into `a` as gguf::quantize_row does, bit for bit: the
// product x * (127 / amax) rounded to nearest even (cvtps2dq under the default rounding mode).
static void quantize(const float* x, int64_t M, gguf::QActs& a) {
#if RTPCORE_Q_SIMD
    const int64_t K = a.K, B = a.block, nb = K / B;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleaving
    for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * K;
        int8_t* qs = a.qs + m * K;
        for (int64_t b = 0; b < nb; ++b) {
            const float* xb = xr + b * B;
            __m256 mx = _mm256_setzero_ps();
            for (int64_t i = 0; i < B; i += 8) mx = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)), mx);
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            for (int64_t i = 0; i < B; i += 32) {
                const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), id));
                const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), id));
                const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 16), id));
                const __m256i q3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 24), id));
                __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
                q = _mm256_max_epi8(q, _mm256_set1_epi8(-127));  // as the scalar clamp (only NaN gets here)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + b * B + i), _mm256_permutevar8x32_epi32(q, order));
            }
            a.d[m * nb + b] = amax / 127.0f;
        }
        // Sums of every 16 q: bytes summed in pairs, then the pairs.
        const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
        for (int64_t g = 0; g < K / 16; g += 2) {
            const __m256i pairs = _mm256_maddubs_epi16(ones8, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 16 * g)));
            const __m256i quads = _mm256_madd_epi16(pairs, ones16);  // group g: lanes 0-3, g + 1: 4-7
            const __m128i h = _mm_hadd_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
            const __m128i t = _mm_hadd_epi32(h, h);  // group g, group g + 1 (twice)
            a.bsum[m * (K / 16) + g] = static_cast<int16_t>(_mm_cvtsi128_si32(t));
            a.bsum[m * (K / 16) + g + 1] = static_cast<int16_t>(_mm_extract_epi32(t, 1));
        }
        if (B == 32)
            for (int64_t b = 0; b < nb; ++b)
                a.s[m * nb + b] = a.d[m * nb + b] * static_cast<float>(a.bsum[m * (K / 16) + 2 * b] +
                                                                       a.bsum[m * (K / 16) + 2 * b + 1]);
    }
#else
    for (int64_t m = 0; m < M; ++m) gguf::quantize_row(x + m * a.K, m, a);
#endif
}

#if RTPCORE_Q_SIMD
// v unchanged, but GCC may no longer fuse the product that made it with the sum that follows
// (the scalar reference rounds both).
RTPCORE_QINLINE __m256 rounded(__m256 v) {
    __asm__("" : "+x"(v));
    return v;
}

// y[0:32] = d * float(v - off) (- m), d = d_lo for elements 0-15, d_hi for 16-31; v's bytes
// signed or unsigned.
template <bool Signed, bool Minus>
RTPCORE_QINLINE void emit32(float* y, const U8& v, int32_t off, float d_lo, float d_hi, float m) {
    const __m128i lo = _mm256_castsi256_si128((__m256i)v), hi = _mm256_extracti128_si256((__m256i)v, 1);
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
        const __m128i h = k < 2 ? lo : hi, src = k % 2 ? _mm_srli_si128(h, 8) : h;
        __m256i iv = Signed ? _mm256_cvtepi8_epi32(src) : _mm256_cvtepu8_epi32(src);
        if (off) iv = _mm256_sub_epi32(iv, _mm256_set1_epi32(off));
        __m256 f = _mm256_mul_ps(_mm256_set1_ps(k < 2 ? d_lo : d_hi), _mm256_cvtepi32_ps(iv));
        if constexpr (Minus) f = _mm256_sub_ps(rounded(f), _mm256_set1_ps(m));
        _mm256_storeu_ps(y + 8 * k, f);
    }
}

template <gguf::Type T>
static void dequantize_blocks(const uint8_t* row, int64_t K, float* out) {
    if constexpr (T == gguf::Type::f16) {  // single halves, eight per conversion
        int64_t k = 0;
        for (; k + 8 <= K; k += 8)
            _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k))));
        for (; k < K; ++k) out[k] = half(row + 2 * k);
        return;
    } else {
        constexpr int bytes = gguf::info(T).bytes, block = gguf::info(T).block;
        for (int64_t b = 0; b < K / block; ++b) {
            const uint8_t* p = row + b * bytes;
            float* y = out + b * block;
            if constexpr (block == 32) {
                const Block32 wb = decode32<T>(p);
                if constexpr (T == gguf::Type::q8_0) emit32<true, false>(y, wb.q, 0, wb.d, wb.d, 0.0f);
                else if constexpr (T == gguf::Type::q4_0) emit32<false, false>(y, wb.q, 8, wb.d, wb.d, 0.0f);
                else if constexpr (T == gguf::Type::q5_0) emit32<false, false>(y, wb.q, 16, wb.d, wb.d, 0.0f);
                else emit32<false, true>(y, wb.q, 0, wb.d, wb.d, -wb.c);  // q5_1: d v + m
            } else if constexpr (T == gguf::Type::q6_k) {
                const float d = half(p + 208);
                const auto* sc = reinterpret_cast<const int8_t*>(p + 192);
#pragma GCC unroll 8
                for (int c = 0; c < 8; ++c)
                    emit32<false, false>(y + 32 * c, k_sub<T>(p, c), 32, d * static_cast<float>(sc[2 * c]),
                                         d * static_cast<float>(sc[2 * c + 1]), 0.0f);
            } else {  // q4_k, q5_k
                const float d = half(p), dmin = half(p + 2);
#pragma GCC unroll 8
                for (int c = 0; c < 8; ++c) {
                    int sc, m;
                    gguf::scale_min_k4(c, p + 4, sc, m);
                    const float dj = d * static_cast<float>(sc);
                    emit32<false, true>(y + 32 * c, k_sub<T>(p, c), 0, dj, dj, dmin * static_cast<float>(m));
                }
            }
        }
    }
}
#endif

// out[0:K] = the K weights of one row, exactly gguf::dequantize_row's values.
static void dequantize(gguf::Type t, const uint8_t* row, int64_t K, float* out) {
#if RTPCORE_Q_SIMD
    switch (t) {
        case gguf::Type::q8_0: return dequantize_blocks<gguf::Type::q8_0>(row, K, out);
        case gguf::Type::q4_0: return dequantize_blocks<gguf::Type::q4_0>(row, K, out);
        case gguf::Type::q5_0: return dequantize_blocks<gguf::Type::q5_0>(row, K, out);
        case gguf::Type::q5_1: return dequantize_blocks<gguf::Type::q5_1>(row, K, out);
        case gguf::Type::q4_k: return dequantize_blocks<gguf::Type::q4_k>(row, K, out);
        case gguf::Type::q5_k: return dequantize_blocks<gguf::Type::q5_k>(row, K, out);
        case gguf::Type::q6_k: return dequantize_blocks<gguf::Type::q6_k>(row, K, out);
        case gguf::Type::f16: return dequantize_blocks<gguf::Type::f16>(row, K, out);
    }
#else
    gguf::dequantize_row(t, row, K, out);
#endif
}

typedef void (*QLinearFn)(const gguf::QActs&, int64_t, const uint8_t*, const float*, float*, int64_t, bool, int64_t,
                          int64_t);

// The kernels by gguf::Type (f16 is a float32 kernel of _kernels_isa.hpp: none here).
constexpr QLinearFn kQLinear[7] = {
    qlinear<gguf::Type::q8_0>, qlinear<gguf::Type::q4_0>, qlinear<gguf::Type::q5_0>, qlinear<gguf::Type::q5_1>,
    qlinear<gguf::Type::q4_k>, qlinear<gguf::Type::q5_k>, qlinear<gguf::Type::q6_k>,
};

#if RTPCORE_Q_SIMD
constexpr gguf::QKernels kQKernels = {quantize, dequantize, linear_i8, kGemmRows, kGemmUnsigned};
#else
constexpr gguf::QKernels kQKernels = {quantize, dequantize, linear_i8, 0, false};
#endif

#undef RTPCORE_QINLINE
