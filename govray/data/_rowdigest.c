/* Row hash version 2's digests, one call for a whole table of rows (govray.data.rowcode).

   sha256_rows(start, offsets, data) -> bytes: the SHA-256 digest of ``start`` followed by row r's
   bytes ``data[offsets[r]:offsets[r + 1]]``, for every row, concatenated (32 bytes a row).
   ``start`` (the table's header) is a multiple of 64 bytes: its state is computed once and each
   row continues from it. Equal to hashlib's sha256 byte for byte (tests/test_rowhash_v2.py); the
   Python loop over hashlib in rowcode.py is the definition this replaces and the fallback when
   this module was not built.

   The compression function uses the x86 SHA extensions where the CPU has them (checked at run
   time with cpuid), else portable C. The GIL is released while rows are hashed. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t INITIAL[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

typedef void (*compress_fn)(uint32_t state[8], const uint8_t *blocks, size_t count);

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static uint32_t load_be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

static void store_be32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static void compress_portable(uint32_t state[8], const uint8_t *blocks, size_t count) {
    uint32_t w[64];
    for (size_t b = 0; b < count; b++, blocks += 64) {
        for (int t = 0; t < 16; t++) w[t] = load_be32(blocks + 4 * t);
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = ROTR(w[t - 15], 7) ^ ROTR(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = ROTR(w[t - 2], 17) ^ ROTR(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = state[0], b_ = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) + K[t] + w[t];
            uint32_t t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b_) ^ (a & c) ^ (b_ & c));
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b_;
            b_ = a;
            a = t1 + t2;
        }
        state[0] += a;
        state[1] += b_;
        state[2] += c;
        state[3] += d;
        state[4] += e;
        state[5] += f;
        state[6] += g;
        state[7] += h;
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>

#define SHA_TARGET __attribute__((target("sha,sse4.1,ssse3")))

/* Four rounds per step, the message schedule kept in four registers (Intel's SHA extensions
   reference layout: the state as ABEF and CDGH). */
SHA_TARGET static void compress_shani(uint32_t state[8], const uint8_t *blocks, size_t count) {
    const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_loadu_si128((const __m128i *)&state[0]);
    __m128i state1 = _mm_loadu_si128((const __m128i *)&state[4]);
    tmp = _mm_shuffle_epi32(tmp, 0xB1);            /* CDAB */
    state1 = _mm_shuffle_epi32(state1, 0x1B);      /* EFGH */
    __m128i state0 = _mm_alignr_epi8(tmp, state1, 8); /* ABEF */
    state1 = _mm_blend_epi16(state1, tmp, 0xF0);   /* CDGH */
    for (size_t b = 0; b < count; b++, blocks += 64) {
        const __m128i abef = state0, cdgh = state1;
        __m128i msg[4];
        for (int i = 0; i < 16; i++) {
            if (i < 4) {
                msg[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(blocks + 16 * i)), swap);
            } else {
                /* W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16], four at a time */
                __m128i m0 = msg[i & 3], m1 = msg[(i + 1) & 3], m2 = msg[(i + 2) & 3], m3 = msg[(i + 3) & 3];
                __m128i partial = _mm_add_epi32(_mm_sha256msg1_epu32(m0, m1), _mm_alignr_epi8(m3, m2, 4));
                msg[i & 3] = _mm_sha256msg2_epu32(partial, m3);
            }
            __m128i words = _mm_add_epi32(msg[i & 3], _mm_loadu_si128((const __m128i *)&K[4 * i]));
            state1 = _mm_sha256rnds2_epu32(state1, state0, words);
            words = _mm_shuffle_epi32(words, 0x0E);
            state0 = _mm_sha256rnds2_epu32(state0, state1, words);
        }
        state0 = _mm_add_epi32(state0, abef);
        state1 = _mm_add_epi32(state1, cdgh);
    }
    tmp = _mm_shuffle_epi32(state0, 0x1B);          /* FEBA */
    state1 = _mm_shuffle_epi32(state1, 0xB1);       /* DCHG */
    state0 = _mm_blend_epi16(tmp, state1, 0xF0);    /* DCBA */
    state1 = _mm_alignr_epi8(state1, tmp, 8);       /* HGFE */
    _mm_storeu_si128((__m128i *)&state[0], state0);
    _mm_storeu_si128((__m128i *)&state[4], state1);
}

static int cpu_has_shani(void) {
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
    int sse41 = (ecx >> 19) & 1, ssse3 = (ecx >> 9) & 1;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 0;
    return sse41 && ssse3 && ((ebx >> 29) & 1);
}
#else
static int cpu_has_shani(void) { return 0; }
#endif

static compress_fn chosen(int native) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (native && cpu_has_shani()) return compress_shani;
#endif
    (void)native;
    return compress_portable;
}

/* One row: continue from ``start_state`` (after ``start_length`` bytes), hash ``length`` bytes. */
static void digest_row(compress_fn compress, const uint32_t start_state[8], uint64_t start_length,
                       const uint8_t *row, size_t length, uint8_t out[32]) {
    uint32_t state[8];
    memcpy(state, start_state, sizeof state);
    size_t whole = length / 64;
    if (whole) compress(state, row, whole);
    uint8_t tail[128];
    size_t rest = length - whole * 64;
    memcpy(tail, row + whole * 64, rest);
    tail[rest] = 0x80;
    size_t blocks = rest + 9 <= 64 ? 1 : 2;
    memset(tail + rest + 1, 0, blocks * 64 - rest - 1 - 8);
    uint64_t bits = (start_length + (uint64_t)length) * 8;
    for (int i = 0; i < 8; i++) tail[blocks * 64 - 1 - i] = (uint8_t)(bits >> (8 * i));
    compress(state, tail, blocks);
    for (int i = 0; i < 8; i++) store_be32(out + 4 * i, state[i]);
}

static PyObject *sha256_rows(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *keywords[] = {"start", "offsets", "data", "native", NULL};
    Py_buffer start, offsets, data;
    int native = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*y*y*|p", keywords, &start, &offsets, &data, &native))
        return NULL;
    PyObject *result = NULL;
    if (start.len % 64 != 0) {
        PyErr_SetString(PyExc_ValueError, "start must be a whole number of 64-byte blocks");
        goto done;
    }
    if (offsets.len % 8 != 0 || offsets.len < 8) {
        PyErr_SetString(PyExc_ValueError, "offsets must be int64, one more than the rows");
        goto done;
    }
    Py_ssize_t count = offsets.len / 8 - 1;
    if (count > PY_SSIZE_T_MAX / 32) {
        PyErr_NoMemory();
        goto done;
    }
    /* Native int64 (the caller's contract: numpy int64 or Arrow's offsets), read with memcpy
       (no alignment assumed) and checked again row by row while the GIL is released: another
       thread may write to a writable buffer meanwhile, and no row may then be read out of bounds. */
    const uint8_t *bounds = (const uint8_t *)offsets.buf;
    int64_t first;
    memcpy(&first, bounds, 8);
    if (first < 0 || first > data.len) goto bad_offsets;
    result = PyBytes_FromStringAndSize(NULL, count * 32);
    if (result == NULL) goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    const uint8_t *bytes = (const uint8_t *)data.buf;
    compress_fn compress = chosen(native);
    uint32_t start_state[8];
    memcpy(start_state, INITIAL, sizeof start_state);
    Py_ssize_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    if (start.len) compress(start_state, (const uint8_t *)start.buf, (size_t)start.len / 64);
    int64_t begin = first, end;
    for (Py_ssize_t r = 0; r < count; r++, begin = end) {
        memcpy(&end, bounds + 8 * (r + 1), 8);
        if (end < begin || end > data.len) {
            bad = r;
            break;
        }
        digest_row(compress, start_state, (uint64_t)start.len, bytes + begin, (size_t)(end - begin), out + 32 * r);
    }
    Py_END_ALLOW_THREADS
    if (bad < 0) goto done;
    Py_CLEAR(result);
bad_offsets:
    PyErr_SetString(PyExc_ValueError, "offsets must rise from 0 or more and end within data");
done:
    PyBuffer_Release(&start);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&data);
    return result;
}

static PyObject *uses_sha_extensions(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(chosen(1) != compress_portable);
}

static PyMethodDef methods[] = {
    {"sha256_rows", (PyCFunction)(void (*)(void))sha256_rows, METH_VARARGS | METH_KEYWORDS,
     "sha256_rows(start, offsets, data, native=True) -> bytes\n\n"
     "The SHA-256 digests (32 bytes each, concatenated) of start + data[offsets[r]:offsets[r + 1]]\n"
     "for every row r. start is a multiple of 64 bytes; offsets are native int64, one more than\n"
     "the rows.\n"
     "native=False uses the portable compression function even where the CPU has SHA extensions."},
    {"uses_sha_extensions", uses_sha_extensions, METH_NOARGS,
     "Whether this CPU's SHA extensions compute the digests (else portable C)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_rowdigest", "Row hash version 2's digests, a table at a time.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rowdigest(void) { return PyModule_Create(&module); }
