/* Decode attention whose every output has one operation order: the same bits for a query
   row whatever the forward's row count, the row's place among them, the thread count, or
   how many masked keys follow its own (agentspec/targets/kernels/attention_kernel.py).

   Why: a library's matrix products pick their blocking, and so the order of a sum, by
   shape, thread count and CPU; a verify's row then rounds otherwise than the one-row step
   that computes it in plain decoding, and a greedy answer can change under speculation
   (docs/cpu_step.md). Here one thread computes each output row from start to end, and
   every sum has an order fixed by the code alone:

   - score s_j = (q . k_j) * scale + mask_j: lane l of 16 sums q[d] k_j[d] over d = l,
     l + 16, ... in order, then the 16 lanes add in one fixed tree (pairs l, l + 8; then
     l, l + 4; l, l + 2; l, l + 1), computed for 16 keys at once by a transposition whose
     every key takes that same tree;
   - softmax: max (exact in any order), e_j = exp(s_j - max) by one polynomial of IEEE
     operations (vexp), their sum in 16 lanes by j mod 16, then the same tree;
   - out = (sum_j e_j v_j) / sum: each element adds its terms in key order, one key after
     another (vectorized over d, never over j), then one division.

   A key past the query (masked: weight exactly 0) adds exact zeros, so a longer key span
   gives the same bits. The vector type is 16 fp32 lanes on every CPU (the compiler splits
   it into its registers: one AVX-512 register, two AVX2 ones, four SSE ones), compiled
   with no fused multiply-add and no fast-math, so every x86-64 CPU computes the same
   values; only the register tiling, which never changes an operation, depends on the ISA.

   Work: the query rows of a batch entry and a key/value head (the g query heads of a
   group times the forward's q rows) are numbered in order, every group after the other,
   and the threads take contiguous ranges of them; a thread passes over the keys and values
   once per tile of up to TILE of its rows, each key and value converted to fp32 once per
   tile and used by all of its rows. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_native.h"

/* A function returning a vector wider than the CPU's registers: static, so no ABI is
   crossed (vectors are never passed as arguments: GCC notes their convention on AVX2). */
#pragma GCC diagnostic ignored "-Wpsabi"

#define LANES 16
#define TILE 32     /* query rows that share one pass over the keys */
#define MAX_DIM 256 /* head_dim (larger: the Python side keeps torch) */
#define VKEYS 32    /* keys converted per block of the value pass */

/* Register tiles, which change no operation: VROWS x VVECS accumulators of the value pass
   held in registers, SROWS query rows sharing each key's loads in the score pass. */
#if defined(__AVX512F__)
#define VROWS 4
#define VVECS 4
#define SROWS 2
#elif defined(__AVX__)
#define VROWS 2
#define VVECS 2
#define SROWS 1
#else
#define VROWS 1
#define VVECS 2
#define SROWS 1
#endif

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint8_t vb __attribute__((vector_size(16)));

#if defined(__clang__) || __GNUC__ >= 12
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

enum { MASK_NONE = 0, MASK_BOOL = 1, MASK_F32 = 2, MASK_BF16 = 3 };

typedef struct {
    const void *q, *k, *v, *mask; /* [B, H, Q, D], [B, KV, N, D] twice, [B, H, Q, N] */
    void *out;                    /* [B, Q, H, D], contiguous */
    int bf16, mask_kind;
    int64_t heads, kv_heads, rows, keys, dim, padded; /* padded: dim up to 16 lanes */
    const int64_t *st; /* strides (elements) of batch, head, row: q, k, v, mask */
    float scale;
    atomic_int failed;
} attn_args;

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
#define VSTORE(p, v) \
    do { \
        vf v_ = (v); \
        memcpy((p), &v_, sizeof v_); \
    } while (0)
#if defined(__AVX2__) && !defined(__AVX512F__)
/* On AVX2 a 16-lane vector is two registers, and GCC lowers some operations on it lane by
   lane through memory: a scalar broadcast became 16 scalar stores and a vector load (a
   store-forwarding stall each), and the shuffles below scalar inserts and extracts, so
   attention ran 13x slower than on AVX-512. Those few operations are written with 8-lane
   intrinsics there: the same values (a broadcast, data movement), so the same bits. */
#define AVX2_ONLY 1
#include <immintrin.h>
typedef struct { __m256 lo, hi; } vf2; /* lanes 0-7, 8-15 */
/* A vector's two registers (a macro: vectors are never passed as arguments). */
#define split(v) __extension__({ vf v_ = (v); vf2 r_; memcpy(&r_, &v_, sizeof r_); r_; })
static inline vf join(__m256 lo, __m256 hi) {
    vf2 r = {lo, hi};
    vf v;
    memcpy(&v, &r, sizeof v);
    return v;
}
static inline vf vsplat(float x) { __m256 b = _mm256_set1_ps(x); return join(b, b); }
#else
#define AVX2_ONLY 0
static inline vf vsplat(float x) { return (vf){0} + x; }
#endif
#define VSELECT(m, a, b) ((vf)(((vi)(a) & (m)) | ((vi)(b) & ~(m))))

/* 16 bf16 values widened to fp32 (exact). */
static inline vf widen(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

/* e^x from IEEE fp32 additions and multiplications alone (Cephes' expf: x = n ln2 + r with
   ln2 in two parts, the first exact in 9 bits, e^r by a degree-7 polynomial; within ~1
   ulp): the same bits on every CPU and for every lane. Below -87.34 (2^-126) it gives 0,
   above 88.37 infinity; exp(0) is exactly 1; NaN stays NaN. */
static inline vf vexp(const float *at, float shift) { /* e^(at[0..16) - shift) */
    const vf lo = vsplat(-87.33654475f), hi = vsplat(88.3762626647949f);
    vf x = vload(at) - vsplat(shift);
    vf c = VSELECT(x < lo, lo, VSELECT(x > hi, hi, x)); /* NaN passes through */
    vf t = c * 1.44269504088896341f + 12582912.0f;      /* 1.5 * 2^23: rounds to an integer */
    vf n = t - 12582912.0f;
    vf r = c - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf z = r * r;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * z + r + 1.0f;
    vf whole = VSELECT(n == n, n, vsplat(0.0f)); /* NaN: no float-to-int conversion of it */
    vi e = (__builtin_convertvector(whole, vi) + 127) << 23; /* 2^n */
    vf y = p * (vf)e;
    y = VSELECT(x < lo, vsplat(0.0f), y);
    return VSELECT(x > hi, vsplat(__builtin_inff()), y);
}

/* The lanes of 16 vectors summed, one sum per vector: lane i of the result sums a[REV[i]]
   (REV: 4-bit reversal), each by the tree (l, l+8), (l, l+4), (l, l+2), (l, l+1). */
static const int REV[LANES] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

/* Lanes of a and b folded in pairs w apart (w = 8, 4, 2, 1), key by key: in blocks of w
   lanes, result block B takes block 2 (B / 2) plus block 2 (B / 2) + 1 of a (B even) or
   of b (B odd). IDX: the lane of a:b that result lane i reads for half h (0: the first
   block of the pair, 1: the second). */
#define IDX(i, w, h) (((i) / (w)) % 2 * LANES + (2 * ((i) / (w) / 2) + (h)) * (w) + (i) % (w))
#define HALF(a, b, w, h)                                                                 \
    SHUF(a, b, IDX(0, w, h), IDX(1, w, h), IDX(2, w, h), IDX(3, w, h), IDX(4, w, h),      \
         IDX(5, w, h), IDX(6, w, h), IDX(7, w, h), IDX(8, w, h), IDX(9, w, h),            \
         IDX(10, w, h), IDX(11, w, h), IDX(12, w, h), IDX(13, w, h), IDX(14, w, h),       \
         IDX(15, w, h))
#if AVX2_ONLY
/* The folds by 8-lane intrinsics: the same additions of the same pairs (IEEE addition
   commutes), so the same bits. */
/* w = 8: [a lanes 0-7 + 8-15, b lanes 0-7 + 8-15]. */
static inline vf fold8(vf2 x, vf2 y) {
    return join(_mm256_add_ps(x.lo, x.hi), _mm256_add_ps(y.lo, y.hi));
}
/* w = 4, per register: [a quads 0 + 1, b quads 0 + 1]. */
static inline __m256 fold4_half(__m256 a, __m256 b) {
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
static inline vf fold4(vf2 x, vf2 y) {
    return join(fold4_half(x.lo, y.lo), fold4_half(x.hi, y.hi));
}
/* w = 2, per 128-bit quad q: [a pairs (q, 0) + (q, 1), b pairs (q, 0) + (q, 1)]. */
static inline __m256 fold2_half(__m256 a, __m256 b) {
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
static inline vf fold2(vf2 x, vf2 y) {
    return join(fold2_half(x.lo, y.lo), fold2_half(x.hi, y.hi));
}
/* w = 1, per quad: [a0 + a1, b0 + b1, a2 + a3, b2 + b3]. */
static inline __m256 fold1_half(__m256 a, __m256 b) {
    __m256 s = _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),  /* a0 a2 b0 b2 */
                             _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))); /* a1 a3 b1 b3 */
    return _mm256_permute_ps(s, _MM_SHUFFLE(3, 1, 2, 0));
}
static inline vf fold1(vf2 x, vf2 y) {
    return join(fold1_half(x.lo, y.lo), fold1_half(x.hi, y.hi));
}
#define FOLD(a, b, w) fold##w(split(a), split(b))
#else
#define FOLD(a, b, w) (HALF(a, b, w, 0) + HALF(a, b, w, 1))
#endif

static inline vf sums16(const vf *a) {
    vf u[8], x[4], y0, y1;
    for (int m = 0; m < 8; m++) u[m] = FOLD(a[2 * m], a[2 * m + 1], 8);
    for (int m = 0; m < 4; m++) x[m] = FOLD(u[2 * m], u[2 * m + 1], 4);
    y0 = FOLD(x[0], x[1], 2);
    y1 = FOLD(x[2], x[3], 2);
    return FOLD(y0, y1, 1);
}

/* One vector's lanes summed by the same tree (maximum: exact in any order). */
static float lane_sum(const vf *v) {
    float a[LANES];
    memcpy(a, v, sizeof a);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) a[l] = a[l] + a[l + w];
    return a[0];
}

static float lane_max(const vf *v) {
    float a[LANES], m;
    memcpy(a, v, sizeof a);
    m = a[0];
    for (int l = 1; l < LANES; l++) m = a[l] > m ? a[l] : m;
    return m;
}

/* d values at base + off as fp32 in dst, zero up to `padded`. */
static inline void load_row(const void *base, int bf16, int64_t off, int64_t d,
                            int64_t padded, float *dst) {
    int64_t i = 0;
    if (bf16) {
        const uint16_t *h = (const uint16_t *)base + off;
        for (; i + LANES <= d; i += LANES) VSTORE(dst + i, widen(h + i));
        for (; i < d; i++) {
            uint32_t b = (uint32_t)h[i] << 16;
            memcpy(dst + i, &b, 4);
        }
    } else {
        memcpy(dst, (const float *)base + off, (size_t)d * sizeof(float));
        i = d;
    }
    for (; i < padded; i++) dst[i] = 0.0f;
}

/* Dot products of R query rows (q, rows dp apart) with K = 16 / R keys (k, likewise): lane
   r * K + j of the result is row r's with key j. Lane l of a product sums q[c] k[c] over
   c = l, l + 16, ... in order; each key's 16 lanes then take the tree of sums16, which
   every input slot shares, so neither R nor a key's place changes its bits. Each key's
   vectors are loaded once for the R rows (R and dp constants once inlined). */
static inline __attribute__((always_inline)) vf dots(const float *q, const float *k,
                                                     int64_t dp, const int R) {
    const int K = LANES / R;
    vf acc[LANES];
    for (int j = 0; j < K; j++) {
        vf x = vload(k + j * dp);
        for (int r = 0; r < R; r++) acc[REV[r * K + j]] = vload(q + r * dp) * x;
        for (int64_t c = LANES; c < dp; c += LANES) {
            x = vload(k + j * dp + c);
            for (int r = 0; r < R; r++) {
                int at = REV[r * K + j];
                acc[at] = acc[at] + vload(q + r * dp + c) * x;
            }
        }
    }
    return sums16(acc);
}

/* Raw scores of R rows against the 16 keys of kbuf: raw[r * 16 + j]. */
static inline __attribute__((always_inline)) void dot_rows(const float *q, const float *kbuf,
                                                           int64_t dp, const int R,
                                                           float *raw) {
    const int K = LANES / R;
    for (int h = 0; h < R; h++) { /* keys h * K .. h * K + K */
        vf s = dots(q, kbuf + h * K * dp, dp, R);
        float lane[LANES];
        memcpy(lane, &s, sizeof lane);
        for (int r = 0; r < R; r++) memcpy(raw + r * LANES + h * K, lane + r * K, K * 4);
    }
}

static void dot_block(const float *q, const float *kbuf, int64_t dp, int R, float *raw) {
    if (R == SROWS && dp == 64) dot_rows(q, kbuf, 64, SROWS, raw);
    else if (R == SROWS && dp == 128) dot_rows(q, kbuf, 128, SROWS, raw);
    else if (R == SROWS) dot_rows(q, kbuf, dp, SROWS, raw);
    else if (dp == 64) dot_rows(q, kbuf, 64, 1, raw);
    else if (dp == 128) dot_rows(q, kbuf, 128, 1, raw);
    else dot_rows(q, kbuf, dp, 1, raw);
}

/* One row's scores of 16 keys from j0 (nk of them real) from its raw dot products:
   raw * scale, then the mask (additive: + mask; boolean: finfo.min where it is false, as
   torch's masked_fill); keys past nk get -inf (weight exactly 0). */
static void finish_scores(const attn_args *p, const float *raw, int64_t moff, int64_t j0,
                          int64_t nk, float *out) {
    vf sc = vload(raw) * vsplat(p->scale);
    if (p->mask_kind == MASK_BOOL) {
        vb mb = {0};
        memcpy(&mb, (const uint8_t *)p->mask + moff + j0, (size_t)nk);
        vi keep = __builtin_convertvector(mb, vi) != 0;
        sc = VSELECT(keep, sc, vsplat(-__FLT_MAX__));
    } else if (p->mask_kind == MASK_F32) {
        const float *m = (const float *)p->mask + moff + j0;
        if (nk == LANES) {
            sc = sc + vload(m);
        } else {
            float part[LANES] = {0};
            memcpy(part, m, (size_t)nk * sizeof(float));
            sc = sc + vload(part);
        }
    } else if (p->mask_kind == MASK_BF16) {
        const uint16_t *m = (const uint16_t *)p->mask + moff + j0;
        if (nk == LANES) {
            sc = sc + widen(m);
        } else {
            uint16_t part[LANES] = {0};
            memcpy(part, m, (size_t)nk * 2);
            sc = sc + widen(part);
        }
    }
    VSTORE(out, sc);
    for (int64_t j = nk; j < LANES; j++) out[j] = -__builtin_inff();
}

/* Scores of a tile's t rows against 16 keys from j0 (nk of them real): s[r * np + j]. */
static void score_block(const attn_args *p, const float *qf, int64_t t, const int64_t *moff,
                        const float *kbuf, int64_t j0, int64_t nk, float *s, int64_t np) {
    int64_t dp = p->padded;
    float raw[SROWS * LANES];
    for (int64_t r = 0; r < t;) {
        int R = r + SROWS <= t ? SROWS : 1;
        dot_block(qf + r * dp, kbuf, dp, R, raw);
        for (int i = 0; i < R; i++, r++)
            finish_scores(p, raw + i * LANES, moff[r], j0, nk, s + r * np + j0);
    }
}

/* s[0, np) := e^(s - max s); returns their sum (16 lanes by j mod 16, then the tree). */
static float softmax_row(float *s, int64_t np) {
    vf m = vload(s);
    for (int64_t c = LANES; c < np; c += LANES) {
        vf x = vload(s + c);
        m = VSELECT(x > m, x, m);
    }
    float top = lane_max(&m);
    vf sum = vsplat(0.0f);
    for (int64_t c = 0; c < np; c += LANES) {
        vf e = vexp(s + c, top);
        VSTORE(s + c, e);
        sum = sum + e;
    }
    return lane_sum(&sum);
}

/* acc[r][c, c + 16 * NV) += e[r][j] * v_j[c, ...] for j in [0, nb), in key order, for R
   rows (R, NV constants once inlined: the accumulators stay in registers). */
#if AVX2_ONLY
/* The same loop on 8-lane registers (GCC kept the 16-lane accumulators on the stack):
   each element still adds e * v in key order, a product then a sum. */
static inline __attribute__((always_inline)) void value_tile(
    float *acc, const float *e, int64_t np, const float *vbuf, int64_t nb, int64_t dp,
    int64_t c, const int R, const int NV) {
    __m256 a[VROWS][2 * VVECS];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 2 * NV; i++) a[r][i] = _mm256_loadu_ps(acc + r * dp + c + i * 8);
    for (int64_t j = 0; j < nb; j++) {
        __m256 x[2 * VVECS];
        for (int i = 0; i < 2 * NV; i++) x[i] = _mm256_loadu_ps(vbuf + j * dp + c + i * 8);
        for (int r = 0; r < R; r++) {
            __m256 w = _mm256_set1_ps(e[r * np + j]);
            for (int i = 0; i < 2 * NV; i++)
                a[r][i] = _mm256_add_ps(a[r][i], _mm256_mul_ps(w, x[i]));
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 2 * NV; i++) _mm256_storeu_ps(acc + r * dp + c + i * 8, a[r][i]);
}
#else
static inline __attribute__((always_inline)) void value_tile(
    float *acc, const float *e, int64_t np, const float *vbuf, int64_t nb, int64_t dp,
    int64_t c, const int R, const int NV) {
    vf a[VROWS][VVECS];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < NV; i++) a[r][i] = vload(acc + r * dp + c + i * LANES);
    for (int64_t j = 0; j < nb; j++) {
        vf x[VVECS];
        for (int i = 0; i < NV; i++) x[i] = vload(vbuf + j * dp + c + i * LANES);
        for (int r = 0; r < R; r++) {
            vf w = vsplat(e[r * np + j]);
            for (int i = 0; i < NV; i++) a[r][i] = a[r][i] + w * x[i];
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < NV; i++) VSTORE(acc + r * dp + c + i * LANES, a[r][i]);
}
#endif

static void value_rows(float *acc, const float *e, int64_t np, const float *vbuf,
                       int64_t nb, int64_t dp, const int R) {
    int64_t c = 0;
    for (; c + VVECS * LANES <= dp; c += VVECS * LANES)
        value_tile(acc, e, np, vbuf, nb, dp, c, R, VVECS);
    for (; c < dp; c += LANES) value_tile(acc, e, np, vbuf, nb, dp, c, R, 1);
}

static void value_block(float *acc, const float *e, int64_t np, const float *vbuf,
                        int64_t nb, int64_t dp, int64_t rows) {
    int64_t r = 0;
    for (; r + VROWS <= rows; r += VROWS)
        value_rows(acc + r * dp, e + r * np, np, vbuf, nb, dp, VROWS);
    for (; r < rows; r++) value_rows(acc + r * dp, e + r * np, np, vbuf, nb, dp, 1);
}

/* fp32 -> bf16, round to nearest even (NaN: the quiet NaN), as torch's .to(bfloat16). */
static inline uint16_t round_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/* Rows [r0, r0 + t) of key/value head g of batch entry b; `work` holds the tile's scratch. */
static void attend_tile(const attn_args *p, int64_t b, int64_t g, int64_t r0, int64_t t,
                        float *work) {
    const int64_t *st = p->st;
    int64_t dp = p->padded, d = p->dim, n = p->keys, np = (n + LANES - 1) / LANES * LANES;
    int64_t group = p->heads / p->kv_heads;
    float *qf = work, *acc = qf + TILE * dp, *kbuf = acc + TILE * dp;
    float *vbuf = kbuf + LANES * dp, *s = vbuf + VKEYS * dp;
    int64_t moff[TILE], ooff[TILE];
    for (int64_t r = 0; r < t; r++) {
        int64_t head = g * group + (r0 + r) / p->rows, i = (r0 + r) % p->rows;
        load_row(p->q, p->bf16, b * st[0] + head * st[1] + i * st[2], d, dp, qf + r * dp);
        moff[r] = b * st[9] + head * st[10] + i * st[11];
        ooff[r] = ((b * p->rows + i) * p->heads + head) * d;
    }
    int64_t kbase = b * st[3] + g * st[4], vbase = b * st[6] + g * st[7];
    for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        int64_t nk = n - j0 < LANES ? n - j0 : LANES;
        for (int64_t j = 0; j < LANES; j++) {
            if (j < nk) load_row(p->k, p->bf16, kbase + (j0 + j) * st[5], d, dp, kbuf + j * dp);
            else memset(kbuf + j * dp, 0, (size_t)dp * sizeof(float));
        }
        score_block(p, qf, t, moff, kbuf, j0, nk, s, np);
    }
    float total[TILE];
    for (int64_t r = 0; r < t; r++) total[r] = softmax_row(s + r * np, np);
    memset(acc, 0, (size_t)(t * dp) * sizeof(float));
    for (int64_t j0 = 0; j0 < n; j0 += VKEYS) {
        int64_t nb = n - j0 < VKEYS ? n - j0 : VKEYS;
        for (int64_t j = 0; j < nb; j++)
            load_row(p->v, p->bf16, vbase + (j0 + j) * st[8], d, dp, vbuf + j * dp);
        value_block(acc, s + j0, np, vbuf, nb, dp, t);
    }
    for (int64_t r = 0; r < t; r++) {
        const float *a = acc + r * dp;
        if (p->bf16) {
            uint16_t *o = (uint16_t *)p->out + ooff[r];
            for (int64_t c = 0; c < d; c++) o[c] = round_bf16(a[c] / total[r]);
        } else {
            float *o = (float *)p->out + ooff[r];
            for (int64_t c = 0; c < d; c++) o[c] = a[c] / total[r];
        }
    }
}

/* Tasks are query rows numbered (batch entry, key/value head, row of its group). */
static void attend_task(void *ctx, int64_t begin, int64_t end) {
    attn_args *p = (attn_args *)ctx;
    int64_t dp = p->padded, np = (p->keys + LANES - 1) / LANES * LANES;
    size_t floats = (size_t)((2 * TILE + LANES + VKEYS) * dp + TILE * np);
    float *work = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    if (!work) {
        atomic_store(&p->failed, 1);
        return;
    }
    int64_t group_rows = p->heads / p->kv_heads * p->rows;
    for (int64_t at = begin; at < end;) {
        int64_t grp = at / group_rows, r0 = at % group_rows;
        int64_t t = group_rows - r0;
        if (t > end - at) t = end - at;
        if (t > TILE) t = TILE;
        attend_tile(p, grp / p->kv_heads, grp % p->kv_heads, r0, t, work);
        at += t;
    }
    free(work);
}

/* softmax(q k^T * scale + mask) v, its operands in one int64 array (one argument to pass
   through ctypes, not 25): call = {q, k, v, mask, out (addresses), bf16, mask kind, B, H,
   KV, Q, N, D, then 12 element strides: batch, head and row of q, of k, of v, of the
   mask}. query [B, H, Q, D], key and value [B, KV, N, D] (bf16 or fp32, last dimension
   contiguous), the mask [B, H, Q, N] (none, bool: nonzero = attend, or additive fp32 /
   bf16; last dimension contiguous, broadcast dimensions stride 0). Writes out [B, Q, H, D]
   (contiguous) in the inputs' dtype. Returns 0, 1 where scratch memory ran out, 2 for
   shapes it does not take. */
int agentspec_attention(const int64_t *call, float scale, int threads) {
    int64_t batch = call[7], heads = call[8], kv_heads = call[9], rows = call[10];
    int64_t keys = call[11], dim = call[12];
    int mask_kind = (int)call[6];
    if (kv_heads < 1 || heads % kv_heads || keys < 1 || dim < 1 || dim > MAX_DIM
        || mask_kind < MASK_NONE || mask_kind > MASK_BF16 || (mask_kind && !call[3]))
        return 2;
#define AT(i) ((const void *)(intptr_t)call[i])
    attn_args args = {AT(0), AT(1), AT(2), AT(3), (void *)(intptr_t)call[4], (int)call[5],
                      mask_kind, heads, kv_heads, rows, keys, dim,
                      (dim + LANES - 1) / LANES * LANES, call + 13, scale, 0};
#undef AT
    agentspec_parallel(attend_task, &args, batch * heads * rows, threads);
    return atomic_load(&args.failed) ? 1 : 0;
}
