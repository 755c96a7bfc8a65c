/* THC's CPU codec in C: host/codec/thc.py's encode and decode of float32 vectors on one core,
 * each in two passes over a slice that stay in L1/L2, without the GIL.
 *
 * Encode of a slice of d = 2^L coordinates (x, agreed scale c):
 *   pass 1, contiguous blocks of B coordinates: w = x * c * sign (the rotation diagonal from
 *     host/codec/rng.py, bit for bit), then the transform's levels inside the block;
 *   pass 2, strips of W columns across the R = d / B blocks: gathered into a small buffer, the
 *     remaining levels, then per coordinate u = y + g/2 clamped to [0, g], the table
 *     neighbours of u, the rounding draw (rng.py's stream 1) and the 4-bit packing, written
 *     straight to the wire form.
 * Decode runs the same two passes in the other order: strips of sums converted ((S - n g/2)
 * alpha, or an index's table value) and transformed, then the blocks transformed, signed and
 * written out. The transform is the unnormalized Sylvester-Hadamard H_d as radix-2/4
 * butterflies (levels commute: H_d is a Kronecker product), so it equals the reference's
 * +-1 GEMMs up to float rounding; everything else is computed exactly as the reference
 * does (same float32 operations, same integers), see tests/test_fastcodec.py.
 *
 * Control stays in Python (host/codec/fastcodec.py): layout, norms, scales, keys and every
 * check of the arguments' meaning; this file checks buffer sizes only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GOLDEN 0x9E3779B9u
#define MUL1 0x7FEB352Du
#define MUL2 0x846CA68Bu
#define KEY2 0x85EBCA6Bu

#define V 8              /* floats per vector */
#define W 16             /* strip width (columns) of the strided pass: one cache line */
#define ONE_PASS_MAX (1u << 13) /* slices up to this length run in one buffer */
#define MAX_ROWS_BITS 9  /* two-pass slices: at most 2^9 blocks, so a strip stays in L1/L2 */
#define MIN_BLOCK_BITS 12
#define PF_STRIPS 4      /* strided passes prefetch the lines of the strip this far ahead */

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif
#define INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef uint8_t vb32 __attribute__((vector_size(32)));

#if defined(__clang__)
#define SHUF(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#define SHUF2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(v, ...) __builtin_shuffle(v, (vi){__VA_ARGS__})
#define SHUF2(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

static const vu LANE = {0, 1, 2, 3, 4, 5, 6, 7};

INLINE vf ldf(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
INLINE void stf(float *p, vf v) { memcpy(p, &v, sizeof v); }
INLINE vf splat(float a) { return (vf){a, a, a, a, a, a, a, a}; }

/* ---- host/codec/rng.py's generator ---- */

INLINE uint32_t mix32(uint32_t x) {
    x ^= x >> 16; x *= MUL1; x ^= x >> 15; x *= MUL2; x ^= x >> 16;
    return x;
}
INLINE vu mix32v(vu x) {
    x ^= x >> 16; x *= MUL1; x ^= x >> 15; x *= MUL2; x ^= x >> 16;
    return x;
}
typedef struct { uint32_t k0, k1; } rkey_t;
/* rng.absorb of the slice word into the 64-bit prefix (g << 32 | h): the slice's key. */
INLINE rkey_t slice_key(uint64_t prefix, uint32_t slice) {
    uint32_t h = mix32((((uint32_t)prefix) ^ slice) + GOLDEN);
    uint32_t g = mix32((uint32_t)(prefix >> 32) ^ h);
    return (rkey_t){mix32((h ^ g) + KEY2), g};
}
INLINE uint32_t block1(uint32_t j, rkey_t k) { return mix32(mix32(j ^ k.k0) ^ k.k1); }
INLINE vu blockv(vu j, rkey_t k) { return mix32v(mix32v(j ^ k.k0) ^ k.k1); }

/* v times the signs of coordinates 32 q + sh .. + 7 whose sign word is `word`: a sign flip,
 * exactly the reference's multiplication by +-1. */
INLINE vf signed8(vf v, uint32_t word, uint32_t sh) {
    vu w = (vu){0} + word;
    vu flip = ((w >> (LANE + sh)) & 1u) << 31;
    return (vf)((vu)v ^ flip);
}
INLINE float signed1(float v, uint32_t word, uint32_t bit) {
    return ((word >> bit) & 1u) ? -v : v;
}

/* ---- the transform ---- */

/* The three levels inside a vector: lane i takes v[i ^ s] + (+-v[i]), - where bit s of i is
 * set; (-b) + a rounds as a - b, so these are the butterflies (a + b, a - b). */
INLINE vf fwht8(vf v) {
    const vu m1 = {0, 1u << 31, 0, 1u << 31, 0, 1u << 31, 0, 1u << 31};
    const vu m2 = {0, 0, 1u << 31, 1u << 31, 0, 0, 1u << 31, 1u << 31};
    const vu m4 = {0, 0, 0, 0, 1u << 31, 1u << 31, 1u << 31, 1u << 31};
    v = (vf)((vu)v ^ m1) + SHUF(v, 1, 0, 3, 2, 5, 4, 7, 6);
    v = (vf)((vu)v ^ m2) + SHUF(v, 2, 3, 0, 1, 6, 7, 4, 5);
    v = (vf)((vu)v ^ m4) + SHUF(v, 4, 5, 6, 7, 0, 1, 2, 3);
    return v;
}

#define BF(a, b)          \
    {                     \
        vf t_ = (a);      \
        (a) = t_ + (b);   \
        (b) = t_ - (b);   \
    }

/* Levels 1, 2, 4 (in units of vectors) across 2, 4 or 8 vectors held in registers. */
INLINE void bfly(vf *x, int r) {
    for (int i = 0; i < (1 << r); i += 2) BF(x[i], x[i + 1])
    if (r < 2) return;
    for (int i = 0; i < (1 << r); i += 4) {
        BF(x[i], x[i + 2])
        BF(x[i + 1], x[i + 3])
    }
    if (r < 3) return;
    for (int i = 0; i < 4; i++) BF(x[i], x[i + 4])
}

/* One pass of r = 1..3 levels, strides h .. h 2^(r-1), over the n floats at a: in place, or,
 * with out, the results times the signs (words[j]: sign word of coordinates 32 j ..) into
 * out instead (decode's last pass). */
INLINE void pass(float *a, size_t n, size_t h, int r, float *out, const uint32_t *words) {
    for (size_t base = 0; base < n; base += h << r)
        for (size_t k = 0; k < h; k += V) {
            float *p = a + base + k;
            vf x[8];
            for (int i = 0; i < (1 << r); i++) x[i] = ldf(p + i * h);
            bfly(x, r);
            for (int i = 0; i < (1 << r); i++) {
                if (out) {
                    size_t at = base + k + i * h;
                    stf(out + at, signed8(x[i], words[at >> 5], (uint32_t)(at & 31)));
                } else {
                    stf(p + i * h, x[i]);
                }
            }
        }
}

/* The levels of strides lo, 2 lo, .., hi (lo >= V) of the n floats at a, three a pass; the
 * last pass writes signed into out when out is given. */
INLINE void levels_to(float *a, size_t n, size_t lo, size_t hi, float *out,
                      const uint32_t *words) {
    for (size_t h = lo; h <= hi;) {
        int r = 4 * h <= hi ? 3 : 2 * h <= hi ? 2 : 1;
        int last = (h << r) > hi && out;
        if (r == 3) {
            if (last) pass(a, n, h, 3, out, words); else pass(a, n, h, 3, NULL, NULL);
        } else if (r == 2) {
            if (last) pass(a, n, h, 2, out, words); else pass(a, n, h, 2, NULL, NULL);
        } else {
            if (last) pass(a, n, h, 1, out, words); else pass(a, n, h, 1, NULL, NULL);
        }
        h <<= r;
    }
}

INLINE void levels(float *a, size_t n, size_t lo, size_t hi) { levels_to(a, n, lo, hi, NULL, NULL); }

/* Levels 1 .. 32 of the 64 floats in x: inside each vector, then across them. */
INLINE void first64(vf *x) {
    for (int i = 0; i < V; i++) x[i] = fwht8(x[i]);
    bfly(x, 3);
}

/* The whole transform of n (a power of two >= 64) contiguous floats; with out, the last
 * pass writes the results signed into out (see pass). */
INLINE void fwht_block_to(float *a, size_t n, float *out, const uint32_t *words) {
    for (size_t k = 0; k < n; k += 64) {
        vf x[8];
        for (int i = 0; i < V; i++) x[i] = ldf(a + k + i * V);
        first64(x);
        if (out && n == 64) {
            for (int i = 0; i < V; i++)
                stf(out + k + i * V, signed8(x[i], words[(k + i * V) >> 5], (i * V) & 31));
        } else {
            for (int i = 0; i < V; i++) stf(a + k + i * V, x[i]);
        }
    }
    if (n > 64) levels_to(a, n, 64, n / 2, out, words);
}

/* The whole transform of n (a power of two >= V) contiguous floats. */
INLINE void fwht_block(float *a, size_t n) {
    if (n >= 64) {
        fwht_block_to(a, n, NULL, NULL);
        return;
    }
    for (size_t k = 0; k < n; k += V) stf(a + k, fwht8(ldf(a + k)));
    if (n > V) levels(a, n, V, n / 2);
}

static void fwht_small(float *a, size_t n) {
    for (size_t h = 1; h < n; h *= 2)
        for (size_t base = 0; base < n; base += 2 * h)
            for (size_t k = base; k < base + h; k++) {
                float x0 = a[k], x1 = a[k + h];
                a[k] = x0 + x1;
                a[k + h] = x0 - x1;
            }
}

/* ---- the stochastic rounding onto the table ---- */

typedef struct {
    int levels, g;          /* table entries, largest value */
    float ghalf, gf;
    float t[256];           /* T[j] */
    float width[256];       /* T[j + 1] - T[j] */
    vf tlo, thi;            /* T[0..15], for the vector lookup */
    vf inner[14];           /* T[1..14] broadcast, +inf past levels - 2 */
    vi seg[4];              /* g < 32, by floor(u) = 0..31: j | T[j] << 8 | width << 16 */
    vf wscaled_lo, wscaled_hi; /* widths times 2^-24, for draws compared as integers */
    vf ghalf_v, gf_v;       /* g / 2 and g broadcast */
    rkey_t ukey;
} round_t;

/* j with T[j] <= u < T[j + 1] (the last interval closed): the count of T[1..levels-2] <= u.
 * The reference looks j up by floor(u) (quantize.segments); for integer tables of g <= 2^24
 * (float32 holds their values exactly; compiled.py encodes larger ones on the reference)
 * and u in [0, g] that is the same j. */
INLINE uint8_t round1(const round_t *rt, float y, uint32_t i) {
    float u = y + rt->ghalf;
    u = u >= 0.0f ? u : 0.0f; /* NaN -> 0: the caller refuses the slice anyway */
    u = u <= rt->gf ? u : rt->gf;
    int j = 0;
    for (int m = 1; m <= rt->levels - 2; m++) j += u >= rt->t[m];
    float q = (u - rt->t[j]) / rt->width[j];
    float r = (float)(block1(i, rt->ukey) >> 8) * 0x1p-24f;
    return (uint8_t)(j + (r < q));
}

INLINE vf lut16(vf lo, vf hi, vi j) {
#if defined(__clang__)
    vf out;
    for (int l = 0; l < V; l++) out[l] = j[l] < V ? lo[j[l] & 7] : hi[j[l] & 7];
    return out;
#else
    return __builtin_shuffle(lo, hi, j);
#endif
}

INLINE vi lut32i(const vi *t, vi k) {
#if defined(__clang__)
    vi out;
    for (int l = 0; l < V; l++) out[l] = t[(k[l] >> 3) & 3][k[l] & 7];
    return out;
#else
    vi m8 = (k & 8) != 0, m16 = (k & 16) != 0;
    vi p0 = __builtin_shuffle(t[0], k), p1 = __builtin_shuffle(t[1], k);
    vi p2 = __builtin_shuffle(t[2], k), p3 = __builtin_shuffle(t[3], k);
    vi lo = (p0 & ~m8) | (p1 & m8), hi = (p2 & ~m8) | (p3 & m8);
    return (lo & ~m16) | (hi & m16);
#endif
}

/* Indices of the 8 coordinates i with rotated values y (tables of <= 16). The
 * draw r = (block >> 8) 2^-24 is compared as the integer block >> 8 against
 * (u - T[j]) / (width 2^-24) = 2^24 (u - T[j]) / width exactly: scaling by a power of two
 * commutes with rounding. */
INLINE vi round8(const round_t *rt, vf y, vu i) {
    vf u = y + rt->ghalf_v;
    vi keep = u >= splat(0.0f);
    u = (vf)((vi)u & keep);
    vi below = u <= rt->gf_v;
    u = (vf)(((vi)u & below) | ((vi)rt->gf_v & ~below));
    vi j;
    vf base, width;
    if (rt->g < 32) {
        vi e = lut32i(rt->seg, __builtin_convertvector(u, vi));
        j = e & 0xFF;
        base = __builtin_convertvector((e >> 8) & 0xFF, vf);
        width = __builtin_convertvector(e >> 16, vf) * splat(0x1p-24f);
    } else {
        j = (vi){0};
        for (int m = 0; m < 14; m++) j -= u >= rt->inner[m];
        base = lut16(rt->tlo, rt->thi, j);
        width = lut16(rt->wscaled_lo, rt->wscaled_hi, j);
    }
    vf q = (u - base) / width;
    vu b = blockv(i, rt->ukey) >> 8;
    return j - (__builtin_convertvector((vi)b, vf) < q);
}

/* The low bytes of the 8 lanes of x to out[0..7] (a byte shuffle: GCC scalarizes
 * __builtin_convertvector from int32 to uint8). */
INLINE void narrow8(vi x, uint8_t *out) {
#if defined(__clang__)
    vb32 b = __builtin_shufflevector((vb32)x, (vb32)x, 0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12,
                                     16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12,
                                     16, 20, 24, 28);
#else
    vb32 b = __builtin_shuffle((vb32)x, (vb32){0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20,
                                               24, 28, 0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12,
                                               16, 20, 24, 28});
#endif
    memcpy(out, &b, 8);
}

/* Writes the indices of coordinates i0 .. i0 + 15 (y: their rotated values). Packed, the
 * even and odd coordinates go through the rounding as two vectors, so that each lane pair
 * makes one byte (the even coordinate in the high nibble). */
INLINE void emit16(const round_t *rt, const float *y, uint32_t i0, uint8_t *out, int packed) {
    if (packed) {
        vf y0 = ldf(y), y1 = ldf(y + V);
        vf even = SHUF2(y0, y1, 0, 2, 4, 6, 8, 10, 12, 14);
        vf odd = SHUF2(y0, y1, 1, 3, 5, 7, 9, 11, 13, 15);
        vu i = (vu){0} + i0 + 2 * LANE;
        narrow8(round8(rt, even, i) << 4 | round8(rt, odd, i + 1), out + i0 / 2);
        return;
    }
    for (uint32_t h = 0; h < 2 * V; h += V) {
        vi idx;
        if (rt->levels <= 16) {
            idx = round8(rt, ldf(y + h), (vu){0} + i0 + h + LANE);
        } else {
            for (int l = 0; l < V; l++) idx[l] = round1(rt, y[h + l], i0 + h + l);
        }
        narrow8(idx, out + i0 + h);
    }
}

/* y - y: 0 for a finite y, NaN for an infinite or NaN one (exact in IEEE arithmetic, which
 * the build keeps: no fast-math). A sum of these is 0 or NaN; a sum of the values themselves
 * could overflow where the max norm is far below the slice's own. */
INLINE vf finite0(vf y) {
    return y - y;
}

/* emit16, returning 0 per lane where the 16 values are finite, else NaN. An overflow of the
 * transform stays in the coordinates it reaches, not always the first. */
INLINE vf emit16_sum(const round_t *rt, const float *y, uint32_t i0, uint8_t *out, int packed) {
    emit16(rt, y, i0, out, packed);
    return finite0(ldf(y)) + finite0(ldf(y + V));
}

/* ---- encode ---- */

typedef struct {
    size_t b, rows;  /* block length and number of blocks (1 in one-pass slices) */
} shape_t;

static shape_t shape_of(size_t d) {
    if (d <= ONE_PASS_MAX) return (shape_t){d, 1};
    int bits = 0;
    while (((size_t)1 << bits) < d) bits++;
    int bb = bits - MAX_ROWS_BITS > MIN_BLOCK_BITS ? bits - MAX_ROWS_BITS : MIN_BLOCK_BITS;
    if (bb > bits - 3) bb = bits - 3; /* at least 8 blocks: the strided pass starts radix-8 */
    return (shape_t){(size_t)1 << bb, d >> bb};
}

/* The slice, a strip, and the sign words of a block. */
static size_t scratch_floats(size_t d) {
    shape_t s = shape_of(d);
    return s.rows == 1 ? d + d / 32 + 1 : d + s.rows * W + s.b / 32;
}

/* dst[k] = x[i0 + k] * c * sign(i0 + k) for k < n (a multiple of 32), zero past len. */
INLINE void load_signed(float *dst, const float *x, size_t i0, size_t n, size_t len, float c,
                        rkey_t sk) {
    for (size_t k = 0; k < n; k += 32) {
        uint32_t word = block1((uint32_t)((i0 + k) >> 5), sk);
        for (uint32_t q = 0; q < 32; q += V) {
            size_t i = i0 + k + q;
            vf v;
            if (i + V <= len) {
                v = ldf(x + i);
            } else {
                float tmp[V] = {0};
                for (size_t l = 0; i + l < len && l < V; l++) tmp[l] = x[i + l];
                v = ldf(tmp);
            }
            stf(dst + k + q, signed8(v * splat(c), word, q));
        }
    }
}

/* The transform of x[i0 + k] * c * sign(i0 + k), k < n (a power of two >= 64), zero past
 * len, into dst: the load, scale and sign fused into the first pass. */
INLINE void load_block(float *dst, const float *x, size_t i0, size_t n, size_t len, float c,
                       rkey_t sk) {
    for (size_t k = 0; k < n; k += 64) {
        uint32_t words[2] = {block1((uint32_t)((i0 + k) >> 5), sk),
                             block1((uint32_t)((i0 + k) >> 5) + 1, sk)};
        vf v[8];
        if (i0 + k + 64 <= len) {
            for (int q = 0; q < 8; q++) v[q] = ldf(x + i0 + k + q * V);
        } else {
            float tmp[64] = {0};
            for (size_t l = 0; i0 + k + l < len && l < 64; l++) tmp[l] = x[i0 + k + l];
            for (int q = 0; q < 8; q++) v[q] = ldf(tmp + q * V);
        }
        for (int q = 0; q < 8; q++)
            v[q] = signed8(v[q] * splat(c), words[q >> 2], (uint32_t)(q & 3) * V);
        first64(v);
        for (int q = 0; q < 8; q++) stf(dst + k + q * V, v[q]);
    }
    if (n > 64) levels(dst, n, 64, n / 2);
}

/* 0 when every lane of v (emit16_sum's) is 0, else NaN. */
INLINE float nonfinite(vf v) {
    float s = 0.0f;
    for (int l = 0; l < V; l++) s += v[l];
    return s;
}

/* One slice: x (len valid coordinates, zero-padded to d), indices to out (the slice's own
 * part of the output). Returns the first rotated coordinate, NaN where ``check`` and any
 * rotated coordinate is not finite (the caller refuses the slice). */
INLINE float encode_slice(const float *x, size_t len, size_t d, float c, rkey_t sk,
                          const round_t *rt, uint8_t *out, int packed, float *scratch,
                          int check) {
    if (d < 32) {
        float t[32];
        for (uint32_t i = 0; i < d; i++)
            t[i] = signed1((i < len ? x[i] : 0.0f) * c, block1(i >> 5, sk), i & 31);
        fwht_small(t, d);
        float nan = 0.0f;
        for (uint32_t i = 0; i < d; i++) nan += t[i] - t[i];
        for (uint32_t i = 0; i < d; i++) {
            uint8_t v = round1(rt, t[i], i);
            if (!packed) out[i] = v;
            else if (i & 1) out[i / 2] |= v;
            else out[i / 2] = (uint8_t)(v << 4);
        }
        return t[0] + nan;
    }
    shape_t s = shape_of(d);
    if (s.rows == 1) {
        if (d >= 64) {
            load_block(scratch, x, 0, d, len, c, sk);
        } else {
            load_signed(scratch, x, 0, d, len, c, sk);
            fwht_block(scratch, d);
        }
        vf nan = splat(0.0f);
        if (check)
            for (uint32_t i = 0; i < d; i += 2 * V)
                nan += emit16_sum(rt, scratch + i, i, out, packed);
        else
            for (uint32_t i = 0; i < d; i += 2 * V) emit16(rt, scratch + i, i, out, packed);
        return scratch[0] + nonfinite(nan);
    }
    size_t b = s.b, rows = s.rows;
    float *strip = scratch + d, first = 0.0f;
    vf nan = splat(0.0f);
    for (size_t r = 0; r < rows; r++) load_block(scratch + r * b, x, r * b, b, len, c, sk);
    for (size_t c0 = 0; c0 < b; c0 += W) {
        /* gather the strip, its first three levels on the way */
        if (c0 + PF_STRIPS * W < b)
            for (size_t r = 0; r < rows; r++) __builtin_prefetch(scratch + r * b + c0 + PF_STRIPS * W);
        for (size_t r8 = 0; r8 < rows; r8 += 8)
            for (size_t w = 0; w < W; w += V) {
                vf v[8];
                for (int i = 0; i < 8; i++) v[i] = ldf(scratch + (r8 + i) * b + c0 + w);
                bfly(v, 3);
                for (int i = 0; i < 8; i++) stf(strip + (r8 + i) * W + w, v[i]);
            }
        if (rows > 8) levels(strip, rows * W, 8 * W, rows * W / 2);
        if (c0 == 0) first = strip[0];
        if (check)
            for (size_t r = 0; r < rows; r++)
                for (uint32_t w = 0; w < W; w += 2 * V)
                    nan += emit16_sum(rt, strip + r * W + w, (uint32_t)(r * b + c0 + w), out,
                                      packed);
        else
            for (size_t r = 0; r < rows; r++)
                for (uint32_t w = 0; w < W; w += 2 * V)
                    emit16(rt, strip + r * W + w, (uint32_t)(r * b + c0 + w), out, packed);
    }
    return first + nonfinite(nan);
}

typedef struct {
    size_t numel, ss, full, tail, tail_padded, n_slices;
} layout_t;

static layout_t layout_of(size_t numel, size_t ss) {
    layout_t l = {numel, ss, numel / ss, numel % ss, 0, 0};
    if (l.tail) {
        l.tail_padded = 1;
        while (l.tail_padded < l.tail) l.tail_padded *= 2;
    }
    l.n_slices = l.full + (l.tail ? 1 : 0);
    return l;
}

CLONES static void encode_all(const float *x, layout_t l, const float *coef,
                              uint64_t sign_prefix, uint64_t uni_prefix, round_t *rt,
                              uint8_t *out, int packed, float *first, float *scratch,
                              int check) {
    for (size_t s = 0; s < l.n_slices; s++) {
        int full = s < l.full;
        size_t start = s * l.ss, d = full ? l.ss : l.tail_padded;
        rt->ukey = slice_key(uni_prefix, (uint32_t)s);
        first[s] = encode_slice(x + start, full ? l.ss : l.tail, d, coef[s],
                                slice_key(sign_prefix, (uint32_t)s), rt,
                                out + (packed ? start / 2 : start), packed, scratch, check);
    }
}

/* ---- decode ---- */

enum { S_U8, S_I8, S_U16, S_I16, S_U32, S_I32, S_U64, S_I64, S_INDEX, N_KINDS };

typedef struct {
    const void *src;
    int kind, bytes;
    float centre;
    const float *table; /* S_INDEX: value of each index (256 entries) */
    int small_table;    /* S_INDEX with every entry past the 16th zero: */
    vf tlo, thi;        /* its first 16 entries, for the vector lookup */
    vi vlo, vhi;        /* the least and largest sums converted so far, per lane and */
    int64_t lo, hi;     /* overall (S_INDEX: untracked): decode refuses impossible sums */
} sums_t;

typedef uint8_t vb8 __attribute__((vector_size(8)));
typedef int8_t vsb8 __attribute__((vector_size(8)));
typedef uint16_t vh8 __attribute__((vector_size(16)));
typedef int16_t vsh8 __attribute__((vector_size(16)));

INLINE void seen(sums_t *sm, int64_t v) {
    if (v < sm->lo) sm->lo = v;
    if (v > sm->hi) sm->hi = v;
}

/* dst[k] = (float(S[i0 + k]) - centre) * alpha for k < n, as the reference computes it
 * (int64 and uint32 sums convert through the scalar loop: float(int) rounds the same). */
INLINE void convert(float *dst, sums_t *sm, size_t i0, size_t n, float alpha) {
    const float centre = sm->centre;
    const vf c = splat(centre), a = splat(alpha);
    size_t k = 0;
#define CONVERT_V(VT, T)                                                          \
    {                                                                             \
        const T *p = (const T *)sm->src + i0;                                     \
        vi lo = sm->vlo, hi = sm->vhi; /* in registers through the loop */        \
        for (; k + V <= n; k += V) {                                              \
            VT raw;                                                               \
            memcpy(&raw, p + k, sizeof raw);                                      \
            vi iv = __builtin_convertvector(raw, vi);                             \
            vi lt = iv < lo, gt = iv > hi;                                        \
            lo = (iv & lt) | (lo & ~lt);                                          \
            hi = (iv & gt) | (hi & ~gt);                                          \
            stf(dst + k, (__builtin_convertvector(iv, vf) - c) * a);              \
        }                                                                         \
        sm->vlo = lo;                                                             \
        sm->vhi = hi;                                                             \
        for (; k < n; k++) {                                                      \
            seen(sm, (int64_t)p[k]);                                              \
            dst[k] = ((float)p[k] - centre) * alpha;                              \
        }                                                                         \
    }                                                                             \
    break;
#define CONVERT(T)                                                              \
    {                                                                           \
        const T *p = (const T *)sm->src + i0;                                   \
        for (; k < n; k++) {                                                    \
            seen(sm, (int64_t)p[k]); /* a uint64 past int64's range: negative */ \
            dst[k] = ((float)p[k] - centre) * alpha;                            \
        }                                                                       \
    }                                                                           \
    break;
    switch (sm->kind) {
        case S_U8: CONVERT_V(vb8, uint8_t)
        case S_I8: CONVERT_V(vsb8, int8_t)
        case S_U16: CONVERT_V(vh8, uint16_t)
        case S_I16: CONVERT_V(vsh8, int16_t)
        case S_I32: CONVERT_V(vi, int32_t)
        case S_U32: CONVERT(uint32_t)
        case S_U64: CONVERT(uint64_t)
        case S_I64: CONVERT(int64_t)
        default: {
            const uint8_t *p = (const uint8_t *)sm->src + i0;
            if (sm->small_table) {
                for (; k + V <= n; k += V) {
                    vb8 raw;
                    memcpy(&raw, p + k, sizeof raw);
                    vi j = __builtin_convertvector(raw, vi);
                    /* entries past the 16th are zero: the shuffle alone would wrap j */
                    vf f = (vf)((vi)lut16(sm->tlo, sm->thi, j) & (j < 16));
                    stf(dst + k, (f - c) * a);
                }
            }
            for (; k < n; k++) dst[k] = (sm->table[p[k]] - centre) * alpha;
        }
    }
#undef CONVERT
#undef CONVERT_V
}

/* The sign words of coordinates i0 .. i0 + n - 1 (n a multiple of 32). */
INLINE void sign_words(uint32_t *words, size_t i0, size_t n, rkey_t sk) {
    for (size_t j = 0; j < n / 32; j++) words[j] = block1((uint32_t)(i0 >> 5) + (uint32_t)j, sk);
}

/* out[k] = t[k] * sign(i0 + k) for i0 + k < len (n a multiple of 32). */
INLINE void store_signed(float *out, const float *t, size_t i0, size_t n, size_t len,
                         rkey_t sk) {
    for (size_t k = 0; k < n && i0 + k < len; k += 32) {
        uint32_t word = block1((uint32_t)((i0 + k) >> 5), sk);
        for (uint32_t q = 0; q < 32; q += V) {
            size_t i = i0 + k + q;
            vf v = signed8(ldf(t + k + q), word, q);
            if (i + V <= len) {
                stf(out + k + q, v);
            } else {
                for (size_t l = 0; i + l < len && l < V; l++) out[k + q + l] = v[l];
            }
        }
    }
}

/* One slice: sums at offset start of the padded vector, len outputs written to out. */
INLINE void decode_slice(sums_t *sm, size_t start, size_t len, size_t d, float alpha,
                         rkey_t sk, float *out, float *scratch) {
    if (d < 32) {
        float t[32];
        convert(t, sm, start, d, alpha);
        fwht_small(t, d);
        for (uint32_t i = 0; i < len; i++) out[i] = signed1(t[i], block1(i >> 5, sk), i & 31);
        return;
    }
    shape_t s = shape_of(d);
    if (s.rows == 1) {
        convert(scratch, sm, start, d, alpha);
        if (d >= 64 && len == d) {
            uint32_t *words = (uint32_t *)(scratch + d);
            sign_words(words, 0, d, sk);
            fwht_block_to(scratch, d, out, words);
            return;
        }
        fwht_block(scratch, d);
        store_signed(out, scratch, 0, d, len, sk);
        return;
    }
    size_t b = s.b, rows = s.rows;
    float *strip = scratch + d;
    uint32_t *words = (uint32_t *)(strip + rows * W);
    for (size_t c0 = 0; c0 < b; c0 += W) {
        for (size_t r = 0; r < rows; r++) {
            if (c0 + PF_STRIPS * W < b) {
                size_t ahead = start + r * b + c0 + PF_STRIPS * W;
                __builtin_prefetch((const char *)sm->src + ahead * sm->bytes);
                __builtin_prefetch(scratch + r * b + c0 + PF_STRIPS * W, 1);
            }
            convert(strip + r * W, sm, start + r * b + c0, W, alpha);
        }
        levels(strip, rows * W, W, rows * W / 2);
        for (size_t r = 0; r < rows; r++) memcpy(scratch + r * b + c0, strip + r * W, W * 4);
    }
    for (size_t r = 0; r < rows && r * b < len; r++) {
        float *row = scratch + r * b;
        if (r * b + b <= len) {
            sign_words(words, r * b, b, sk);
            fwht_block_to(row, b, out + r * b, words);
        } else {
            fwht_block(row, b);
            store_signed(out + r * b, row, r * b, b, len, sk);
        }
    }
}

CLONES static void decode_all(sums_t *sm, layout_t l, const float *alpha,
                              uint64_t sign_prefix, float *out, float *scratch) {
    for (size_t s = 0; s < l.n_slices; s++) {
        int full = s < l.full;
        size_t start = s * l.ss;
        decode_slice(sm, start, full ? l.ss : l.tail, full ? l.ss : l.tail_padded, alpha[s],
                     slice_key(sign_prefix, (uint32_t)s), out + start, scratch);
    }
}

/* ---- norms ---- */

typedef double vd __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

/* Per slice, the sum of squares in double: each square is exact, so only the sum's order
 * differs from numpy's einsum (the float32 norms agree but for ties of 1e-16). */
CLONES static void sumsq_all(const float *x, layout_t l, double *out) {
    for (size_t s = 0; s < l.n_slices; s++) {
        const float *p = x + s * l.ss;
        size_t len = s < l.full ? l.ss : l.tail, k = 0;
        vd a0 = {0}, a1 = {0};
        for (; k + V <= len; k += V) {
            vf4 lo, hi;
            memcpy(&lo, p + k, sizeof lo);
            memcpy(&hi, p + k + 4, sizeof hi);
            vd dlo = __builtin_convertvector(lo, vd), dhi = __builtin_convertvector(hi, vd);
            a0 += dlo * dlo;
            a1 += dhi * dhi;
        }
        double acc = 0.0;
        for (int l4 = 0; l4 < 4; l4++) acc += a0[l4] + a1[l4];
        for (; k < len; k++) acc += (double)p[k] * (double)p[k];
        out[s] = acc;
    }
}

/* ---- Python bindings ---- */

static float *scratch_for(layout_t l) {
    size_t need = 0;
    if (l.full) need = scratch_floats(l.ss);
    if (l.tail && scratch_floats(l.tail_padded) > need) need = scratch_floats(l.tail_padded);
    size_t bytes = (need * sizeof(float) + 63) / 64 * 64;
    return (float *)aligned_alloc(64, bytes ? bytes : 64);
}

static int check_layout(Py_ssize_t numel, Py_ssize_t ss, layout_t *l) {
    /* numel bounded so that every buffer size below (at most 16 bytes per element, padding
     * included) is computed without overflow */
    /* ss at most 2^32: a coordinate's index within its slice is a uint32_t */
    if (numel < 0 || numel > PY_SSIZE_T_MAX / 16 || ss < 1 || (ss & (ss - 1)) ||
        (size_t)ss > ((size_t)1 << 32)) {
        PyErr_Format(PyExc_ValueError, "bad layout: numel %zd, slice size %zd", numel, ss);
        return -1;
    }
    *l = layout_of((size_t)numel, (size_t)ss);
    if (l->n_slices > 0xFFFFFFFFu) {
        PyErr_SetString(PyExc_ValueError, "more than 2^32 slices");
        return -1;
    }
    return 0;
}

/* A buffer of at least `bytes`, aligned to its elements' size (`align`): the loops read
 * and write elements through typed pointers. */
static int need(Py_buffer *b, Py_ssize_t bytes, const char *what, size_t align) {
    if (b->len < bytes) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %zd", what, b->len, bytes);
        return -1;
    }
    if ((uintptr_t)b->buf % align) {
        PyErr_Format(PyExc_ValueError, "%s is not aligned to %zu bytes", what, align);
        return -1;
    }
    return 0;
}

static int fill_table(round_t *rt, Py_buffer *table) {
    if (need(table, 0, "table", 4)) return -1;
    Py_ssize_t n = table->len / (Py_ssize_t)sizeof(int32_t);
    const int32_t *t = (const int32_t *)table->buf;
    if (n < 2 || n > 256 || t[0] != 0) {
        PyErr_SetString(PyExc_ValueError, "the table needs 2..256 int32 entries from 0");
        return -1;
    }
    memset(rt, 0, sizeof *rt);
    for (Py_ssize_t j = 1; j < n; j++)
        if (t[j] <= t[j - 1]) {
            PyErr_SetString(PyExc_ValueError, "the table must increase strictly");
            return -1;
        }
    rt->levels = (int)n;
    rt->g = t[n - 1];
    rt->gf = (float)rt->g;
    rt->ghalf = (float)(rt->g / 2.0);
    rt->ghalf_v = splat(rt->ghalf);
    rt->gf_v = splat(rt->gf);
    for (Py_ssize_t j = 0; j < n; j++) {
        rt->t[j] = (float)t[j];
        rt->width[j] = j + 1 < n ? (float)(t[j + 1] - t[j]) : 1.0f;
    }
    for (int m = 0; m < 14; m++)
        rt->inner[m] = splat(m + 1 <= rt->levels - 2 ? rt->t[m + 1] : __builtin_inff());
    for (int k = 0, j = 0; rt->g < 32 && k < 32; k++) { /* read only where g < 32 */
        while (j + 1 <= rt->levels - 2 && rt->t[j + 1] <= (float)k) j++;
        rt->seg[k / V][k % V] = j | (int)rt->t[j] << 8 | (int)rt->width[j] << 16;
    }
    for (int l = 0; l < V; l++) {
        rt->wscaled_lo[l] = rt->width[l] * 0x1p-24f;
        rt->wscaled_hi[l] = rt->width[l + V] * 0x1p-24f;
        rt->tlo[l] = rt->t[l];
        rt->thi[l] = rt->t[l + V];
    }
    return 0;
}

PyDoc_STRVAR(encode_doc,
"encode(x, numel, slice_size, coef, sign_prefix, uniform_prefix, table, out, packed, first,\n"
"       check)\n"
"x: float32 buffer (numel); coef: float32 per slice; table: int32 entries; out: uint8 buffer\n"
"(padded length, halved when packed); first: float32 per slice, receives each slice's first\n"
"rotated coordinate, NaN where check and any rotated coordinate is not finite.");

static PyObject *py_encode(PyObject *self, PyObject *args) {
    Py_buffer x, coef, table, out, first;
    Py_ssize_t numel, ss;
    unsigned long long sign_prefix, uni_prefix;
    int packed, check;
    if (!PyArg_ParseTuple(args, "y*nny*KKy*w*pw*p", &x, &numel, &ss, &coef, &sign_prefix,
                          &uni_prefix, &table, &out, &packed, &first, &check))
        return NULL;
    PyObject *ret = NULL;
    layout_t l;
    round_t rt;
    float *scratch = NULL;
    if (check_layout(numel, ss, &l) || fill_table(&rt, &table)) goto done;
    size_t padded = l.full * l.ss + l.tail_padded;
    if (packed && (rt.levels != 16 || (l.n_slices > 1 && (l.ss & 1)))) {
        PyErr_SetString(PyExc_ValueError, "packing needs 4-bit indices and even slices");
        goto done;
    }
    if (need(&x, numel * 4, "x", 4) || need(&coef, (Py_ssize_t)l.n_slices * 4, "coef", 4) ||
        need(&out, (Py_ssize_t)(packed ? (padded + 1) / 2 : padded), "out", 1) ||
        need(&first, (Py_ssize_t)l.n_slices * 4, "first", 4))
        goto done;
    if (!(scratch = scratch_for(l))) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    encode_all((const float *)x.buf, l, (const float *)coef.buf, (uint64_t)sign_prefix,
               (uint64_t)uni_prefix, &rt, (uint8_t *)out.buf, packed, (float *)first.buf,
               scratch, check);
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done:
    free(scratch);
    PyBuffer_Release(&x);
    PyBuffer_Release(&coef);
    PyBuffer_Release(&table);
    PyBuffer_Release(&out);
    PyBuffer_Release(&first);
    return ret;
}

PyDoc_STRVAR(decode_doc,
"decode(sums, kind, numel, slice_size, alpha, centre, sign_prefix, table, out)\n"
"sums: integer buffer of the padded length, kind one of KINDS ('index': uint8 indices mapped\n"
"through table, float32 of 256 entries; else table is ignored); alpha: float32 per slice;\n"
"out: float32 buffer (numel). Returns (least, largest) of the sums converted (None for\n"
"'index', or no sums); a uint64 sum past int64's range counts as negative.");

static const char *KIND_NAMES[N_KINDS] = {"u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8",
                                          "index"};
static const int KIND_BYTES[N_KINDS] = {1, 1, 2, 2, 4, 4, 8, 8, 1};

static PyObject *py_decode(PyObject *self, PyObject *args) {
    Py_buffer sums, alpha, table, out;
    const char *kind_name;
    Py_ssize_t numel, ss;
    double centre;
    unsigned long long sign_prefix;
    if (!PyArg_ParseTuple(args, "y*snny*dKy*w*", &sums, &kind_name, &numel, &ss, &alpha,
                          &centre, &sign_prefix, &table, &out))
        return NULL;
    PyObject *ret = NULL;
    layout_t l;
    float *scratch = NULL;
    int kind = 0;
    while (kind < N_KINDS && strcmp(KIND_NAMES[kind], kind_name)) kind++;
    if (kind == N_KINDS) {
        PyErr_Format(PyExc_ValueError, "unknown sums kind %s", kind_name);
        goto done;
    }
    if (check_layout(numel, ss, &l)) goto done;
    size_t padded = l.full * l.ss + l.tail_padded;
    if (need(&sums, (Py_ssize_t)padded * KIND_BYTES[kind], "sums", (size_t)KIND_BYTES[kind]) ||
        need(&alpha, (Py_ssize_t)l.n_slices * 4, "alpha", 4) ||
        (kind == S_INDEX && need(&table, 256 * 4, "table", 4)) || need(&out, numel * 4, "out", 4))
        goto done;
    if (!(scratch = scratch_for(l))) {
        PyErr_NoMemory();
        goto done;
    }
    sums_t sm = {sums.buf, kind, KIND_BYTES[kind], (float)centre, (const float *)table.buf, 0,
                 {0}, {0}, {0}, {0}, INT64_MAX, INT64_MIN};
    sm.vlo += INT32_MAX;
    sm.vhi += INT32_MIN;
    if (kind == S_INDEX) {
        sm.small_table = 1;
        for (int j = 16; j < 256; j++) sm.small_table &= sm.table[j] == 0.0f;
        for (int l = 0; l < V; l++) {
            sm.tlo[l] = sm.table[l];
            sm.thi[l] = sm.table[l + V];
        }
    }
    Py_BEGIN_ALLOW_THREADS
    decode_all(&sm, l, (const float *)alpha.buf, (uint64_t)sign_prefix, (float *)out.buf,
               scratch);
    for (int k = 0; k < V; k++) {
        if (sm.vlo[k] <= sm.vhi[k]) {
            seen(&sm, sm.vlo[k]);
            seen(&sm, sm.vhi[k]);
        }
    }
    Py_END_ALLOW_THREADS
    ret = sm.lo <= sm.hi ? Py_BuildValue("LL", (long long)sm.lo, (long long)sm.hi)
                         : Py_NewRef(Py_None);
done:
    free(scratch);
    PyBuffer_Release(&sums);
    PyBuffer_Release(&alpha);
    PyBuffer_Release(&table);
    PyBuffer_Release(&out);
    return ret;
}

PyDoc_STRVAR(sumsq_doc,
"sumsq(x, numel, slice_size, out)\n"
"x: float32 buffer (numel); out: float64 per slice, receives each slice's sum of squares.");

static PyObject *py_sumsq(PyObject *self, PyObject *args) {
    Py_buffer x, out;
    Py_ssize_t numel, ss;
    if (!PyArg_ParseTuple(args, "y*nnw*", &x, &numel, &ss, &out)) return NULL;
    PyObject *ret = NULL;
    layout_t l;
    if (check_layout(numel, ss, &l) || need(&x, numel * 4, "x", 4) ||
        need(&out, (Py_ssize_t)l.n_slices * 8, "out", 8))
        goto done;
    Py_BEGIN_ALLOW_THREADS
    sumsq_all((const float *)x.buf, l, (double *)out.buf);
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return ret;
}

static PyMethodDef methods[] = {
    {"sumsq", py_sumsq, METH_VARARGS, sumsq_doc},
    {"encode", py_encode, METH_VARARGS, encode_doc},
    {"decode", py_decode, METH_VARARGS, decode_doc},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastcodec",
    "THC's CPU codec: fused encode and decode of float32 vectors (see host/codec/fastcodec.py).",
    -1, methods};

#ifndef SOURCE_SHA256
#define SOURCE_SHA256 "" /* setup.py defines both: thc.built compares the file's hash with it */
#define SOURCE_FILES ""
#endif

PyMODINIT_FUNC PyInit__fastcodec(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *kinds = PyTuple_New(N_KINDS);
    if (!kinds) return NULL;
    for (int k = 0; k < N_KINDS; k++) PyTuple_SET_ITEM(kinds, k, PyUnicode_FromString(KIND_NAMES[k]));
    if (PyModule_AddObject(m, "KINDS", kinds) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_SHA256", SOURCE_SHA256) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_FILES", SOURCE_FILES) < 0)
        return NULL;
    return m;
}
