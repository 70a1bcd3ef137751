/* int8 x int8 products summed in int32 for few rows: the one-row decode step and short
   verifies of w8a8 / w8a16 (each activation row one or two int8 digits).

   Why: a decode step multiplies every weight once by one or two rows; that is a
   matrix-vector product bound by memory, and a GEMM library's int8 path packs or reorders
   its operands per call. Here each weight row is read once, straight from the layer's
   buffer, and dotted with every activation row while it is in L1.

   Same bits as torch._int_mm: an int32 sum of int8 products has one value whatever order
   adds it (no term or partial sum overflows: |a|, |w| <= 127, so a pair of products is at
   most 32,258 and k is far below 2^31 / 16,129), so which path, vector width or thread
   computes a column never changes an output.

   Vector paths, chosen when the extension is compiled for the installing CPU: AVX-512 VNNI
   (vpdpbusd on 256-bit lanes), AVX-VNNI, AVX2 (vpmaddubsw + vpmaddwd), else plain C.
   vpmaddubsw multiplies unsigned by signed bytes, so the activation's sign moves onto the
   weight first (|a| * (w * sign a), both within 127: its int16 pair sums cannot
   saturate). */
#include <stdint.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "_native.h"

typedef struct {
    const int8_t *a; /* [m, k] */
    const int8_t *w; /* [n, k] */
    int32_t *out;    /* [m, n] */
    int64_t m, k, n;
} mm_args;

#if defined(__AVX2__)
static inline int32_t hsum256(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* acc += sum of |a| * (w * sign a) over 32 bytes, in int32 lanes. */
static inline __m256i dot32(__m256i acc, __m256i a, __m256i w) {
    __m256i ua = _mm256_sign_epi8(a, a);
    __m256i sw = _mm256_sign_epi8(w, a);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, ua, sw);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, ua, sw);
#else
    __m256i pairs = _mm256_maddubs_epi16(ua, sw); /* [16] int16, no saturation */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
#endif

/* Four weight rows against one activation row: four sums. */
static void dot4(const int8_t *a, const int8_t *w0, int64_t k, int32_t *out) {
    int64_t i = 0;
    int32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#if defined(__AVX2__)
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0;
    for (; i + 32 <= k; i += 32) {
        __m256i va = _mm256_loadu_si256((const __m256i *)(a + i));
        c0 = dot32(c0, va, _mm256_loadu_si256((const __m256i *)(w0 + i)));
        c1 = dot32(c1, va, _mm256_loadu_si256((const __m256i *)(w0 + k + i)));
        c2 = dot32(c2, va, _mm256_loadu_si256((const __m256i *)(w0 + 2 * k + i)));
        c3 = dot32(c3, va, _mm256_loadu_si256((const __m256i *)(w0 + 3 * k + i)));
    }
    s0 = hsum256(c0);
    s1 = hsum256(c1);
    s2 = hsum256(c2);
    s3 = hsum256(c3);
#endif
    for (; i < k; i++) {
        int32_t x = a[i];
        s0 += x * w0[i];
        s1 += x * w0[k + i];
        s2 += x * w0[2 * k + i];
        s3 += x * w0[3 * k + i];
    }
    out[0] = s0;
    out[1] = s1;
    out[2] = s2;
    out[3] = s3;
}

static int32_t dot1(const int8_t *a, const int8_t *w, int64_t k) {
    int64_t i = 0;
    int32_t s = 0;
#if defined(__AVX2__)
    __m256i c = _mm256_setzero_si256();
    for (; i + 32 <= k; i += 32)
        c = dot32(c, _mm256_loadu_si256((const __m256i *)(a + i)),
                  _mm256_loadu_si256((const __m256i *)(w + i)));
    s = hsum256(c);
#endif
    for (; i < k; i++) s += (int32_t)a[i] * w[i];
    return s;
}

/* Tasks are blocks of 4 output columns: columns [4 * begin, 4 * end). */
static void mm_task(void *ctx, int64_t begin, int64_t end) {
    const mm_args *p = (const mm_args *)ctx;
    int64_t j0 = 4 * begin, j1 = 4 * end < p->n ? 4 * end : p->n;
    int32_t sums[4];
    for (int64_t j = j0; j < j1; j += 4) {
        const int8_t *w = p->w + j * p->k;
        if (j + 4 <= j1) {
            for (int64_t r = 0; r < p->m; r++) {
                dot4(p->a + r * p->k, w, p->k, sums);
                int32_t *o = p->out + r * p->n + j;
                o[0] = sums[0];
                o[1] = sums[1];
                o[2] = sums[2];
                o[3] = sums[3];
            }
        } else {
            for (int64_t c = j; c < j1; c++)
                for (int64_t r = 0; r < p->m; r++)
                    p->out[r * p->n + c] = dot1(p->a + r * p->k, p->w + c * p->k, p->k);
        }
    }
}

/* out [m, n] = a [m, k] @ w [n, k]^T in int32, over `threads` threads. */
void agentspec_int8_mm(const int8_t *a, const int8_t *w, int32_t *out, int64_t m, int64_t k,
                       int64_t n, int threads) {
    mm_args args = {a, w, out, m, k, n};
    agentspec_parallel(mm_task, &args, (n + 3) / 4, threads);
}

/* Which vector path this build took (reported by the Python side). */
const char *agentspec_int8_mm_path(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512vnni";
#elif defined(__AVXVNNI__)
    return "avxvnni";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "c";
#endif
}
