/* A restricted pickle scanner: the opcode stream of a plain-data pickle -> a flat "tape".
 *
 * Only the opcodes pickle emits for dicts, lists, tuples, str, int, float, bool and None
 * (protocols 2-5) are read; every other opcode (globals, REDUCE, BUILD, persistent ids,
 * bytes, text-protocol opcodes...) makes scan() raise ValueError("unsupported ..."), and the
 * caller falls back to the restricted unpickler, which refuses or reads the file as before.
 * Nothing is executed and no Python object is built per container: each container is a node,
 * each item an edge (parent node, key, value kind, value). Strings are interned once.
 * Every read is bounds-checked; memo indices must be sequential; sizes stay under 2**31.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { K_NONE, K_FALSE, K_TRUE, K_INT, K_FLOAT, K_STR, K_LIST, K_DICT, K_TUPLE };
#define NO_KEY (-1)
#define LIMIT 0x7ffffff0

typedef struct { uint8_t kind; int64_t val; } Value;
typedef struct { char *p; Py_ssize_t n, cap, size; } Buf;

static int grow(Buf *b, Py_ssize_t more) {
    if (b->n + more <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 1024;
    while (cap < b->n + more) {
        if (cap > LIMIT / 2) return -1;
        cap *= 2;
    }
    char *p = PyMem_Realloc(b->p, (size_t)cap * b->size);
    if (!p) return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}
#define AT(b, T, i) (((T *)(b).p)[i])

typedef struct {
    Buf stack, marks, memo, nkind, nfirst, nlast, ncount, eparent, ekey, ekind, eval;
    PyObject *strings, *index, *keys;  /* list of str, {str: id}, list of (kind, val) non-str keys */
    const char *err;
} S;

static int push(S *s, uint8_t kind, int64_t val) {
    if (grow(&s->stack, 1)) return -1;
    AT(s->stack, Value, s->stack.n).kind = kind;
    AT(s->stack, Value, s->stack.n).val = val;
    s->stack.n++;
    return 0;
}

static int new_node(S *s, uint8_t kind) {
    Py_ssize_t i = s->nkind.n;
    if (i >= LIMIT || grow(&s->nkind, 1) || grow(&s->nfirst, 1) || grow(&s->nlast, 1) || grow(&s->ncount, 1))
        return -1;
    AT(s->nkind, uint8_t, i) = kind;
    AT(s->nfirst, int32_t, i) = -1;
    AT(s->nlast, int32_t, i) = -1;
    AT(s->ncount, int32_t, i) = 0;
    s->nkind.n++; s->nfirst.n++; s->nlast.n++; s->ncount.n++;
    return push(s, kind, i);
}

static int32_t key_of(S *s, Value k) {
    if (k.kind == K_STR) return (int32_t)k.val;
    if (k.kind == K_LIST || k.kind == K_DICT || k.kind == K_TUPLE) { s->err = "a container as a dict key"; return INT32_MIN; }
    PyObject *t = Py_BuildValue("(iL)", (int)k.kind, (long long)k.val);
    if (!t || PyList_Append(s->keys, t)) { Py_XDECREF(t); return INT32_MIN; }
    Py_DECREF(t);
    return (int32_t)(-2 - (PyList_GET_SIZE(s->keys) - 1));
}

static int edge(S *s, int64_t parent, int32_t key, Value v) {
    Py_ssize_t e = s->eparent.n;
    if (e >= LIMIT || grow(&s->eparent, 1) || grow(&s->ekey, 1) || grow(&s->ekind, 1) || grow(&s->eval, 1))
        return -1;
    AT(s->eparent, int32_t, e) = (int32_t)parent;
    AT(s->ekey, int32_t, e) = key;
    AT(s->ekind, uint8_t, e) = v.kind;
    AT(s->eval, int64_t, e) = v.val;
    if (AT(s->nlast, int32_t, parent) < 0) AT(s->nfirst, int32_t, parent) = (int32_t)e;
    AT(s->nlast, int32_t, parent) = (int32_t)e;
    AT(s->ncount, int32_t, parent)++;
    s->eparent.n++; s->ekey.n++; s->ekind.n++; s->eval.n++;
    return 0;
}

static int string(S *s, const char *p, Py_ssize_t n) {
    PyObject *u = PyUnicode_DecodeUTF8(p, n, "surrogatepass");
    if (!u) return -1;
    PyObject *id = PyDict_GetItemWithError(s->index, u);
    Py_ssize_t i;
    if (id) {
        i = PyLong_AsSsize_t(id);
    } else if (PyErr_Occurred()) {
        Py_DECREF(u);
        return -1;
    } else {
        i = PyList_GET_SIZE(s->strings);
        PyObject *num = PyLong_FromSsize_t(i);
        if (!num || PyDict_SetItem(s->index, u, num) || PyList_Append(s->strings, u)) {
            Py_XDECREF(num); Py_DECREF(u);
            return -1;
        }
        Py_DECREF(num);
    }
    Py_DECREF(u);
    return push(s, K_STR, i);
}

/* The buffer as bytes, freed at once: only one buffer is ever held twice. */
static PyObject *take(Buf *b) {
    PyObject *out = PyBytes_FromStringAndSize(b->p ? b->p : "", b->n * b->size);
    PyMem_Free(b->p);
    b->p = NULL;
    return out;
}

#define NEED(k) do { if (end - p < (Py_ssize_t)(k)) { s.err = "truncated"; goto fail; } } while (0)
#define TOP(k) do { if (s.stack.n - (s.marks.n ? AT(s.marks, Py_ssize_t, s.marks.n - 1) : 0) < (k)) { \
    s.err = "stack underflow"; goto fail; } } while (0)
#define OOM() do { if (!PyErr_Occurred()) PyErr_NoMemory(); goto error; } while (0)

static PyObject *scan(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE)) return NULL;
    const unsigned char *p = view.buf, *end = p + view.len;
    S s;
    memset(&s, 0, sizeof s);
    s.stack.size = sizeof(Value); s.marks.size = sizeof(Py_ssize_t); s.memo.size = sizeof(Value);
    s.nkind.size = 1; s.nfirst.size = 4; s.nlast.size = 4; s.ncount.size = 4;
    s.eparent.size = 4; s.ekey.size = 4; s.ekind.size = 1; s.eval.size = 8;
    s.strings = PyList_New(0); s.index = PyDict_New(); s.keys = PyList_New(0);
    PyObject *result = NULL;
    Value top = {0, 0};
    if (!s.strings || !s.index || !s.keys) goto error;

    const unsigned char *frame_end = NULL;  /* once framed, every opcode lies inside a frame, back to back */
    for (;;) {
        NEED(1);
        if (frame_end && (p > frame_end || (p == frame_end && *p != 0x95))) {
            s.err = "an opcode outside its frame";
            goto fail;
        }
        unsigned char op = *p++;
        switch (op) {
        case 0x80: NEED(1); if (*p > 5) { s.err = "a pickle protocol above 5"; goto fail; } p++; break;  /* PROTO */
        case 0x95: {  /* FRAME: a frame may start only where the previous one ended, and must fit the data */
            NEED(8);
            uint64_t n;
            memcpy(&n, p, 8);
            p += 8;
            if ((frame_end && p - 9 != frame_end) || n > (uint64_t)(end - p)) { s.err = "a bad frame"; goto fail; }
            frame_end = p + n;
            break;
        }
        case '.':  /* STOP */
            if (s.stack.n != 1 || s.marks.n) { s.err = "a stack not holding one object at STOP"; goto fail; }
            if (frame_end && p != frame_end) { s.err = "STOP not at the end of its frame"; goto fail; }
            top = AT(s.stack, Value, 0);
            goto done;
        case '(': if (grow(&s.marks, 1)) OOM(); AT(s.marks, Py_ssize_t, s.marks.n++) = s.stack.n; break;  /* MARK */
        case '}': if (new_node(&s, K_DICT)) OOM(); break;
        case ']': if (new_node(&s, K_LIST)) OOM(); break;
        case ')': if (new_node(&s, K_TUPLE)) OOM(); break;
        case 'N': if (push(&s, K_NONE, 0)) OOM(); break;
        case 0x88: if (push(&s, K_TRUE, 1)) OOM(); break;
        case 0x89: if (push(&s, K_FALSE, 0)) OOM(); break;
        case 'J': { NEED(4); int32_t v; memcpy(&v, p, 4); p += 4; if (push(&s, K_INT, v)) OOM(); break; }  /* BININT (LE) */
        case 'K': NEED(1); if (push(&s, K_INT, p[0])) OOM(); p += 1; break;
        case 'M': NEED(2); if (push(&s, K_INT, p[0] | (p[1] << 8))) OOM(); p += 2; break;
        case 0x8a: {  /* LONG1: little-endian two's complement, at most 8 bytes here */
            NEED(1);
            unsigned n = *p++;
            if (n > 8) { s.err = "an integer beyond 64 bits"; goto fail; }
            NEED(n);
            uint64_t u = 0;
            for (unsigned i = 0; i < n; i++) u |= (uint64_t)p[i] << (8 * i);
            if (n && n < 8 && (p[n - 1] & 0x80)) u |= ~(uint64_t)0 << (8 * n);
            p += n;
            if (push(&s, K_INT, (int64_t)u)) OOM();
            break;
        }
        case 'G': {  /* BINFLOAT: big-endian double, kept as its bits */
            NEED(8);
            uint64_t u = 0;
            for (int i = 0; i < 8; i++) u = (u << 8) | p[i];
            p += 8;
            if (push(&s, K_FLOAT, (int64_t)u)) OOM();
            break;
        }
        case 0x8c: {
            NEED(1);
            Py_ssize_t n = *p++;
            NEED(n);
            if (string(&s, (const char *)p, n)) goto error;
            p += n;
            break;
        }
        case 'X': {
            NEED(4); uint32_t n; memcpy(&n, p, 4); p += 4;
            NEED(n);
            if (string(&s, (const char *)p, n)) goto error;
            p += n;
            break;
        }
        case 0x8d: {
            NEED(8); uint64_t n; memcpy(&n, p, 8); p += 8;
            if (n > (uint64_t)(end - p)) { s.err = "truncated"; goto fail; }
            if (string(&s, (const char *)p, (Py_ssize_t)n)) goto error;
            p += n;
            break;
        }
        case 0x94: case 'q': case 'r': {  /* MEMOIZE, BINPUT, LONG_BINPUT: indices must be sequential */
            Py_ssize_t i = s.memo.n;
            if (op == 'q') { NEED(1); i = p[0]; p += 1; }
            if (op == 'r') { NEED(4); uint32_t v; memcpy(&v, p, 4); i = v; p += 4; }
            TOP(1);
            if (i > s.memo.n) { s.err = "a memo index out of sequence"; goto fail; }
            if (i == s.memo.n) { if (grow(&s.memo, 1)) OOM(); s.memo.n++; }
            AT(s.memo, Value, i) = AT(s.stack, Value, s.stack.n - 1);
            break;
        }
        case 'h': case 'j': {  /* BINGET, LONG_BINGET */
            Py_ssize_t i;
            if (op == 'h') { NEED(1); i = p[0]; p += 1; } else { NEED(4); uint32_t v; memcpy(&v, p, 4); i = v; p += 4; }
            if (i >= s.memo.n) { s.err = "a memo index never set"; goto fail; }
            Value v = AT(s.memo, Value, i);
            if (push(&s, v.kind, v.val)) OOM();
            break;
        }
        case 'a': case 's': {  /* APPEND, SETITEM */
            Py_ssize_t k = op == 'a' ? 2 : 3;
            TOP(k);
            Value *v = &AT(s.stack, Value, s.stack.n - k);
            if (v[0].kind != (op == 'a' ? K_LIST : K_DICT)) { s.err = "an item added to a non-container"; goto fail; }
            int32_t key = NO_KEY;
            if (op == 's' && (key = key_of(&s, v[1])) == INT32_MIN) { if (PyErr_Occurred()) goto error; goto fail; }
            if (edge(&s, v[0].val, key, v[k - 1])) OOM();
            s.stack.n -= k - 1;
            break;
        }
        case 'e': case 'u': case 't': {  /* APPENDS, SETITEMS, TUPLE: the items since the last MARK */
            if (!s.marks.n) { s.err = "no MARK"; goto fail; }
            Py_ssize_t m = AT(s.marks, Py_ssize_t, --s.marks.n), n = s.stack.n - m;
            if (op == 't') {
                if (new_node(&s, K_TUPLE)) OOM();
                Value t = AT(s.stack, Value, s.stack.n - 1);
                for (Py_ssize_t i = 0; i < n; i++)
                    if (edge(&s, t.val, NO_KEY, AT(s.stack, Value, m + i))) OOM();
                s.stack.n = m;
                if (push(&s, K_TUPLE, t.val)) OOM();
                break;
            }
            if (m < 1 || (op == 'u' && n % 2)) { s.err = "a malformed APPENDS/SETITEMS"; goto fail; }
            Value c = AT(s.stack, Value, m - 1);
            if (c.kind != (op == 'e' ? K_LIST : K_DICT)) { s.err = "items added to a non-container"; goto fail; }
            for (Py_ssize_t i = 0; i < n; i += (op == 'e' ? 1 : 2)) {
                int32_t key = NO_KEY;
                if (op == 'u' && (key = key_of(&s, AT(s.stack, Value, m + i))) == INT32_MIN) {
                    if (PyErr_Occurred()) goto error;
                    goto fail;
                }
                if (edge(&s, c.val, key, AT(s.stack, Value, m + i + (op == 'u')))) OOM();
            }
            s.stack.n = m;
            break;
        }
        case 0x85: case 0x86: case 0x87: {  /* TUPLE1..3 */
            Py_ssize_t n = op - 0x84;
            TOP(n);
            Py_ssize_t m = s.stack.n - n;
            if (new_node(&s, K_TUPLE)) OOM();
            Value t = AT(s.stack, Value, s.stack.n - 1);
            for (Py_ssize_t i = 0; i < n; i++)
                if (edge(&s, t.val, NO_KEY, AT(s.stack, Value, m + i))) OOM();
            s.stack.n = m;
            if (push(&s, K_TUPLE, t.val)) OOM();
            break;
        }
        default:
            s.err = "an opcode a plain-data snapshot does not use";
            goto fail;
        }
    }
done:
    {
        PyMem_Free(s.stack.p); PyMem_Free(s.memo.p);
        s.stack.p = s.memo.p = NULL;
        PyObject *parts[8] = {take(&s.nkind), take(&s.nfirst), take(&s.nlast), take(&s.ncount),
                              take(&s.eparent), take(&s.ekey), take(&s.ekind), take(&s.eval)};
        int ok = 1;
        for (int i = 0; i < 8; i++) ok &= parts[i] != NULL;
        if (ok)
            result = Py_BuildValue("(iLNNNNNNNNOO)", (int)top.kind, (long long)top.val, parts[0], parts[1],
                                   parts[2], parts[3], parts[4], parts[5], parts[6], parts[7], s.strings, s.keys);
        else
            for (int i = 0; i < 8; i++) Py_XDECREF(parts[i]);
    }
    goto cleanup;
fail:
    PyErr_Format(PyExc_ValueError, "unsupported: %s", s.err ? s.err : "?");
    goto cleanup;
error:
    if (!PyErr_Occurred()) PyErr_NoMemory();
cleanup:
    PyBuffer_Release(&view);
    Buf *all[] = {&s.stack, &s.marks, &s.memo, &s.nkind, &s.nfirst, &s.nlast, &s.ncount, &s.eparent, &s.ekey, &s.ekind,
                  &s.eval};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) PyMem_Free(all[i]->p);
    Py_XDECREF(s.strings); Py_XDECREF(s.index); Py_XDECREF(s.keys);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O, "scan(buffer) -> tape of a plain-data pickle; ValueError('unsupported: ...') otherwise"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pkscan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pkscan(void) { return PyModule_Create(&module); }
