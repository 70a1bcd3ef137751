/* The int8 activation digits of w8a8 and w8a16 in one pass each: quantization of rows into
   digits and recombination of the exact integer sums. Each formula is the torch operators'
   of agentspec/targets/kernels/w8a8.py, IEEE operation by IEEE operation in fp32; built at
   install as agentspec.targets.kernels._fused_digits (pyproject.toml) with -ffp-contract=off
   and no fast-math, so vectorizing changes no value; loaded by fused_digits.py (ctypes). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_native.h"

static inline float from_bf16(uint16_t h) {
    uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f;
}


/* Row r of x as fp32 (bf16 widened into scratch). */
static const float *row_f32(const void *x, int bf16, int64_t r, int64_t k, float *scratch) {
    if (!bf16) return (const float *)x + r * k;
    const uint16_t *h = (const uint16_t *)x + r * k;
    for (int64_t i = 0; i < k; i++) scratch[i] = from_bf16(h[i]);
    return scratch;
}

/* max |v[i]| (NaN if any is NaN, as torch's amax). A maximum is exact in any order, so
   it is kept in 16 lanes the compiler vectorizes: one running maximum is a chain of
   dependent compares, slower than the digits' own loops over the row. */
static float row_peak(const float *v, int64_t k) {
    float lane[16] = {0.0f};
    int nan = 0;
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        for (int j = 0; j < 16; j++) {
            float a = fabsf(v[i + j]);
            nan |= a != a;
            lane[j] = a > lane[j] ? a : lane[j];
        }
    }
    float peak = 0.0f;
    for (; i < k; i++) {
        float a = fabsf(v[i]);
        nan |= a != a;
        peak = a > peak ? a : peak;
    }
    for (int j = 0; j < 16; j++) peak = lane[j] > peak ? lane[j] : peak;
    return nan ? NAN : peak;
}

/* quantize_rows: q [digits*m, k] int8 (high digits' rows first), u [m] fp32. */
void agentspec_quantize(const void *x, int bf16, int64_t m, int64_t k, int digits,
                        int8_t *q, float *u, float *scratch) {
    for (int64_t r = 0; r < m; r++) {
        const float *v = row_f32(x, bf16, r, k, scratch);
        float peak = row_peak(v, k);
        if (peak < 1e-30f) peak = 1e-30f;
        int8_t *hi = q + r * k;
        if (digits == 1) {
            float a = peak / 127.0f;
            u[r] = a;
            for (int64_t i = 0; i < k; i++) hi[i] = (int8_t)nearbyintf(v[i] / a);
        } else {
            float unit = peak / 32258.0f;
            int8_t *lo = q + (m + r) * k;
            u[r] = unit;
            for (int64_t i = 0; i < k; i++) {
                float n = nearbyintf(v[i] / unit);
                float h = nearbyintf(n / 254.0f);
                hi[i] = (int8_t)h;
                lo[i] = (int8_t)(n - 254.0f * h);
            }
        }
    }
}

/* The outputs [m, n] from the exact sums acc [digits*m, n]:
   ((254 * high + low) * s[j]) * u[r] + bias[j], each operation rounded on its own. */
void agentspec_combine(const int32_t *acc, int64_t m, int64_t n, int digits, const float *s,
                       const float *u, const float *bias, void *out, int bf16) {
    for (int64_t r = 0; r < m; r++) {
        const int32_t *hi = acc + r * n;
        const int32_t *lo = acc + (m + r) * n;
        float ur = u[r];
        float *of = (float *)out + r * n;
        uint16_t *oh = (uint16_t *)out + r * n;
        int two = digits == 2;
        for (int64_t j = 0; j < n; j++) {
            float y = agentspec_recombine(hi[j], two ? lo[j] : 0, two, s[j], ur,
                                          bias ? bias + j : NULL);
            if (bf16) oh[j] = agentspec_to_bf16(y); else of[j] = y;
        }
    }
}
