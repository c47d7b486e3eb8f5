/* Schedule version 2's keyed permutations, an index array at a time (govray.data.permutation).

   walk(values, out, keys, half, n, inverse) fills ``out`` (writable, native int64, as long as
   ``values``) with the image of each of ``values`` under the cycle-walked balanced Feistel network
   of ``KeyedPermutation`` (its inverse where ``inverse``): ROUNDS rounds on two ``half``-bit halves,
   each round function a splitmix64 finalizer of one half xored with the round's key, keeping its
   top ``half`` bits; outputs outside [0, n) walk the cycle on until they land inside. Equal to the
   numpy code in permutation.py value for value (tests/test_schedule_v2.py): that code is the
   definition this replaces and the fallback where this module was not built. Here each value walks
   its own cycle to the end in one loop, where numpy re-runs every round over the shrinking set of
   values still outside (a dozen calls for the last few of an array). The GIL is released. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ROUNDS 6

static inline uint64_t mix(uint64_t half_value, uint64_t key, unsigned drop) {
    uint64_t mixed = half_value ^ key;
    mixed = (mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9ULL;
    mixed = (mixed ^ (mixed >> 27)) * 0x94D049BB133111EBULL;
    return (mixed ^ (mixed >> 31)) >> drop;
}

static inline uint64_t encrypt(uint64_t value, const uint64_t *keys, unsigned half, uint64_t mask) {
    uint64_t left = value >> half, right = value & mask;
    for (int round = 0; round < ROUNDS; round++) {
        uint64_t next = left ^ mix(right, keys[round], 64 - half);
        left = right;
        right = next;
    }
    return (left << half) | right;
}

static inline uint64_t decrypt(uint64_t value, const uint64_t *keys, unsigned half, uint64_t mask) {
    uint64_t left = value >> half, right = value & mask;
    for (int round = ROUNDS - 1; round >= 0; round--) {
        uint64_t previous = right ^ mix(left, keys[round], 64 - half);
        right = left;
        left = previous;
    }
    return (left << half) | right;
}

static PyObject *walk(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer values, out;
    PyObject *key_tuple;
    unsigned int half;
    unsigned long long n;
    int inverse;
    if (!PyArg_ParseTuple(args, "y*w*O!IKp", &values, &out, &PyTuple_Type, &key_tuple, &half, &n, &inverse))
        return NULL;
    PyObject *result = NULL;
    uint64_t keys[ROUNDS];
    if (PyTuple_GET_SIZE(key_tuple) != ROUNDS) {
        PyErr_Format(PyExc_ValueError, "keys must be %d round keys", ROUNDS);
        goto done;
    }
    for (int round = 0; round < ROUNDS; round++) {
        keys[round] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(key_tuple, round));
        if (PyErr_Occurred()) goto done;
    }
    if (half < 1 || half > 31 || n < 1 || n > (1ULL << (2 * half))) {
        PyErr_SetString(PyExc_ValueError, "half must be 1..31 and n must be 1..2**(2 * half)");
        goto done;
    }
    if (values.len % 8 != 0 || out.len != values.len) {
        PyErr_SetString(PyExc_ValueError, "values and out must be int64 arrays of one length");
        goto done;
    }
    Py_ssize_t count = values.len / 8;
    const uint8_t *source = (const uint8_t *)values.buf;
    uint8_t *target = (uint8_t *)out.buf;
    uint64_t mask = (1ULL << half) - 1;
    Py_ssize_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t index = 0; index < count; index++) {
        int64_t start;
        memcpy(&start, source + 8 * index, 8); /* no alignment assumed */
        if (start < 0 || (uint64_t)start >= n) {
            bad = index;
            break;
        }
        uint64_t value = (uint64_t)start;
        do { /* a cycle through [0, n) comes back inside: at most 4**half - n more steps */
            value = inverse ? decrypt(value, keys, half, mask) : encrypt(value, keys, half, mask);
        } while (value >= n);
        int64_t image = (int64_t)value;
        memcpy(target + 8 * index, &image, 8);
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "value %zd lies outside [0, %llu)", bad, n);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS,
     "walk(values, out, keys, half, n, inverse) -> None\n\n"
     "Fill out (writable native int64, as long as values) with the cycle-walked Feistel image of\n"
     "each of values (native int64, each in [0, n)) under the 6 round keys on two half-bit halves;\n"
     "its preimage where inverse."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_feistel", "Schedule version 2's keyed permutations, an array at a time.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__feistel(void) { return PyModule_Create(&module); }
