/* A restricted pickle scanner: a plain-data snapshot pickle -> columns, read in chunks.
 *
 * Only the opcodes pickle emits for dicts, lists, tuples, str, int, float, bool and None
 * (protocols 2-5) are read; every other opcode (globals, REDUCE, BUILD, persistent ids,
 * bytes, text-protocol opcodes...) makes scan() raise ValueError("unsupported ..."), and the
 * caller falls back to the restricted unpickler, which refuses or reads the file as before.
 * Nothing is executed. Strings are interned once.
 *
 * The trace entries (root["device_traces"][d][i]) and their frames are recognised while
 * reading, from where they stand on the stack, and go straight into per-entry columns, an
 * interned frame table and an interned stack table: no node or edge is kept for them. Their
 * special kinds below may then only be used where a snapshot uses them (an entry appended once
 * to its device's list, a frame to a frames list, a frames list set as an entry's frames);
 * any other use is "unsupported". Everything else (segments, metadata) becomes a small tape:
 * one node per container, one edge per item, which stream.py turns into Python objects.
 * Every read is bounds-checked; memo indices must be sequential; sizes stay under 2**28.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

enum { K_NONE, K_FALSE, K_TRUE, K_INT, K_FLOAT, K_STR, K_LIST, K_DICT, K_TUPLE,
       /* special kinds, never in the tape */
       K_ENTRY, K_FRAME_OPEN, K_FRAME, K_FLIST, K_STACK, K_OLIST, K_DLIST };
enum { F_NONE, F_ACTION, F_ADDR, F_SIZE, F_STREAM, F_TIME, F_FRAMES, F_FWD, F_UM, F_CC, F_CAT, F_MOD, F_DFREE,
       F_DT, F_FILENAME, F_LINE, F_NAME };
static const char *FIELD_NAMES[] = {"", "action", "addr", "size", "stream", "time_us", "frames", "forward_frames",
                                    "user_metadata", "compile_context", "category", "module", "device_free",
                                    "device_traces", "filename", "line", "name"};
#define N_FIELDS 17
#define NO_KEY (-1)
#define LIMIT 0x0ffffff0 /* ids fit the memo's 28 bits */
#define CHUNK (1 << 22)

typedef struct { uint8_t kind; int64_t val; } Value;
typedef struct { char *p; Py_ssize_t n, cap, size; } Buf;

static int grow(Buf *b, Py_ssize_t more) {
    if (b->n + more <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 1024;
    while (cap < b->n + more) {
        if (cap > PY_SSIZE_T_MAX / 4 / b->size) return -1;
        cap *= 2;
    }
    char *p = PyMem_RawRealloc(b->p, (size_t)cap * b->size);
    if (!p) return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}
#define AT(b, T, i) (((T *)(b).p)[i])
#define APPEND(b, T, v) (grow(&(b), 1) ? -1 : (AT(b, T, (b).n++) = (v), 0))

/* -- the entries' columns -----------------------------------------------------------------------------
 * An entry is read into a Row of the pending rows (those not yet appended to their device list: the
 * current APPENDS batch), and goes into the columns when it is appended (in a window: when it is kept).
 * Each column is a Col: while all its rows hold one value (most often stream, forward frames, the texts)
 * it keeps that value and their count only (`lazy`), and is filled when another value comes; it is
 * returned as one value then (see take_block). Entries' columns of 1 (action codes, see action_code),
 * 4 or 8 bytes a row. */
typedef struct { int64_t addr, size, stream, time; int32_t action, frames, fwd, um, cc, cat, mod; } Row;
enum { C_ACTION, C_ADDR, C_SIZE, C_STREAM, C_TIME, C_FRAMES, C_FWD, C_UM, C_CC, C_CAT, C_MOD, N_COLS };
static const uint8_t COL_SIZE[N_COLS] = {1, 8, 8, 8, 8, 4, 4, 4, 4, 4, 4};
typedef struct { Buf b; int lazy; int64_t v; } Col;

static inline void col_store(Col *c, Py_ssize_t i, int64_t v) {
    switch (c->b.size) {
    case 1: ((uint8_t *)c->b.p)[i] = (uint8_t)v; break;
    case 4: ((int32_t *)c->b.p)[i] = (int32_t)v; break;
    default: ((int64_t *)c->b.p)[i] = v;
    }
}

static int col_fill(Col *c) {  /* a lazy column's rows written out */
    Py_ssize_t n = c->b.n;
    c->b.n = 0;
    if (grow(&c->b, n)) { c->b.n = n; return -1; }
    c->b.n = n;
    c->lazy = 0;
    if (c->b.size == 1) memset(c->b.p, (int)(uint8_t)c->v, (size_t)n);
    else for (Py_ssize_t i = 0; i < n; i++) col_store(c, i, c->v);
    return 0;
}

static inline int col_append(Col *c, int64_t v) {
    if (c->lazy) {
        if (!c->b.n || v == c->v) { c->v = v; c->b.n++; return 0; }
        if (col_fill(c)) return -1;
    }
    if (c->b.n >= c->b.cap && grow(&c->b, 1)) return -1;
    col_store(c, c->b.n++, v);
    return 0;
}

static int col_widen(Col *c, Py_ssize_t size) {  /* 1-byte rows to `size` bytes, keeping their values */
    if (!c->lazy && c->b.cap) {
        char *p = PyMem_RawMalloc((size_t)c->b.cap * (size_t)size);
        if (!p) return -1;
        Col w = {{p, c->b.n, c->b.cap, size}, 0, 0};
        for (Py_ssize_t i = 0; i < c->b.n; i++) col_store(&w, i, ((uint8_t *)c->b.p)[i]);
        PyMem_RawFree(c->b.p);
        c->b.p = p;
    }
    c->b.size = size;
    return 0;
}

/* A block of memory the scanner made, handed to Python as it is (a writable buffer of bytes, freed with
 * its last user): the columns are not copied, nor held twice. */
typedef struct { PyObject_HEAD char *p; Py_ssize_t len; } Block;
static char block_empty[8];
static int block_getbuffer(PyObject *o, Py_buffer *view, int flags) {
    Block *b = (Block *)o;
    return PyBuffer_FillInfo(view, o, b->p ? b->p : block_empty, b->len, 0, flags);
}
static void block_dealloc(PyObject *o) {
    PyMem_RawFree(((Block *)o)->p);
    Py_TYPE(o)->tp_free(o);
}
static PyBufferProcs block_buffer = {block_getbuffer, NULL};
static PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tracekit.io._pkscan.Block",
    .tp_basicsize = sizeof(Block),
    .tp_dealloc = block_dealloc,
    .tp_as_buffer = &block_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "memory the scanner made (a column), as a buffer of bytes",
};

/* The buffer as a Block (trimmed to its rows), taken from b. */
static PyObject *take_block(Buf *b) {
    Block *out = PyObject_New(Block, &BlockType);
    if (!out) return NULL;
    size_t len = (size_t)b->n * (size_t)b->size;
    char *p = b->p;
    if (p && len && (Py_ssize_t)len < b->cap * b->size) {
        char *q = PyMem_RawRealloc(p, len);
        if (q) p = q;
    }
    if (!len) { PyMem_RawFree(p); p = NULL; }
    out->p = p;
    out->len = (Py_ssize_t)len;
    b->p = NULL;
    b->n = b->cap = 0;
    return (PyObject *)out;
}

/* A column as a Block: its rows, or its one value when lazy (and not empty). */
static PyObject *take_col(Col *c) {
    if (c->lazy && c->b.n) {
        PyMem_RawFree(c->b.p);
        c->b.p = NULL;
        c->b.cap = 0;
        if (grow(&c->b, 1)) { PyErr_NoMemory(); return NULL; }
        c->b.n = 1;
        col_store(c, 0, c->v);
    }
    return take_block(&c->b);
}

/* -- the pickle memo, compact ------------------------------------------------------------------------
 * Every memoized value (a 4-bit kind, a 28-bit id) may be referred back to by a later BINGET, so the
 * memo lives as long as the file is read: about 2.7 slots per trace entry in PyTorch's own pickles (the
 * entry dict, its per-entry strings such as compile_context, its frames list), 4 bytes each as a plain
 * array, the largest thing a windowed read of a long file keeps. Here the slots are kept in blocks of
 * MEMO_BLOCK: the newest block as it is, every full one encoded, each slot as a varint of its kind and
 * its place among the last values of its kind in its block (an entry slot as its kind
 * alone: a trace entry is never referred back to, see BINGET; see memo_code), about a byte a slot; a slot changed
 * after its block was encoded (a frame or frames list finished late, a BINPUT to an old index) goes to
 * a small table of changes, looked at first. 1024 slots a block: a frames list is finished tens of slots
 * after it is memoized, which at 64 a block sent most lists to the table of changes (10M entries: 0.5 s and
 * 30 MiB more); decoding a slot reads at most a block, and the cache of decoded slots takes most reads. */
#define MEMO_BLOCK 1024
typedef struct {
    Py_ssize_t n;                 /* slots so far; slots [n - n % MEMO_BLOCK, n) are in tail */
    uint32_t tail[MEMO_BLOCK];
    Buf arena, boff;              /* encoded blocks back to back; int64 offset of each block */
    Buf pkey, pval, ptable;       /* changed slots: index, value; open-addressing table of their rows + 1 */
    int64_t *ckey;                /* a cache of decoded slots (the keys, actions and frames met again and */
    uint32_t *cval;               /* again), MEMO_CACHE of them by index, direct-mapped; ckey -1: empty */
} Memo;
#define MEMO_CACHE (1 << 16)  /* 768 KiB: 8192 slots missed so often on a 10M-entry file that its reads took 1 s longer */


typedef struct { int32_t fname, name; int64_t line; uint8_t have; int32_t fid; Py_ssize_t memo; } PFrame;
typedef struct { Py_ssize_t start, len, memo; int32_t stack; } PList;  /* stack: -2 while open */
typedef struct {
    Py_ssize_t first, count; int appended;
    /* a window (scan(..., window)): every entry is folded here, only those inside it are kept */
    int64_t pos, lo, cum, cum_lo, rcum, rcum_lo, lone, tmin, tmax, rec_start, rec_runs, rec_tstart, rec_tn;
    int32_t rec_last;
    Py_ssize_t fz_start, fz_n, fz_sorted;  /* its addresses moved out of the address table (see am_compact) */
    int lo_found, started;
    double sizesum;
} DList;

typedef struct {
    /* input */
    PyObject *read;
    char *buf;
    Py_ssize_t buf_cap, base;  /* base: file offset of buf[0] */
    int eof;
    /* machine */
    Buf stack, marks;
    Memo memo;
    /* tape of everything else */
    Buf nkind, nfirst, nlast, ncount, eparent, ekey, ekind, eval;
    int json;
    Buf sc_table, sc_off, sc_len, sc_sid, sc_hash, arena;  /* JSON: raw string (with its quotes) -> id */
    PyObject *strings, *index, *keys, *escaped;  /* escaped: JSON string with escapes -> its id */
    Buf field_of, present;  /* per string id: field code; seen as an entry key */
    /* entries */
    Col col[N_COLS];  /* the appended (in a window: kept) entries' columns, nrows each */
    Py_ssize_t nrows;
    Buf pend;  /* the pending entries: Row of entry pend_base + i (an entry's id: its row, see new_entry) */
    Py_ssize_t pend_base;
    Buf act_code, act_sid;  /* action string id -> its code (1, 2, ...; 0: none yet) and back (code - 1) */
    Buf df_row, df_kind, df_val;
    int64_t no_time;
    Buf dlists, order;  /* DList per device list; device lists in root order */
    Py_ssize_t appended;  /* the row of the next entry to append to its list */
    /* a window: keep device positions [w_first, w_hi) from the first entry timed >= w_thr (if w_has_thr) */
    int windowed, w_has_thr;
    int64_t w_first, w_hi, w_thr, max_size, max_time;
    Buf w_ranges;  /* per device list (in the order they are made): its own [first, hi), else the above */
    /* record: also keep each device's runs of one user_metadata (their first position, rec_pos, and the
     * string, rec_um) and the time of every entry whose user_metadata is not our recorder's mark (does
     * not start with "tracekit:iter="; rec_t): what finds the iterations our recorder marked, in memory
     * that grows with the runs, not the entries (see tracekit.analysis.phases.marked_iterations) */
    int w_record;
    Buf rec_um, rec_t, rec_pos, ours;  /* ours: per string id, 1 when it starts with "tracekit:iter=" */
    Py_ssize_t last_dl;
    Buf role;  /* per string id: 1 alloc, 2 free_completed, 3 segment grows, 4 segment shrinks, else 0 */
    Buf am_key, am_dev, am_state, am_table;  /* (device, address) of every alloc/free: 1 last was alloc */
    Buf fz;  /* addresses freed in the trace, moved out of that table: per device list a segment */
    Py_ssize_t am_compact_at, am_min;  /* am_min: AM_COMPACT, or $TRACEKIT_SCAN_COMPACT_ROWS (for tests) */
    /* per device list, the stacks (frames, forward frames) and strings (user_metadata, compile_context,
     * category, module) its entries use, each once, in order of first use: so the window's Trace numbers
     * them as a read of the whole file does (the set above holds them under device -1 - list) */
    Buf fu_dl, fu_col, fu_id;
    int64_t fu_last[6];
    Py_ssize_t fu_last_dl;
    int olist_made, dt_set;
    int64_t root;
    /* frames and stacks */
    Buf pframes, plists, pfids;
    Py_ssize_t open_frames, open_lists;
    Buf f_name, f_file, f_line, f_table;  /* interned frames; open-addressing table of ids + 1 */
    Buf s_off, s_fids, s_hash, s_table;   /* interned stacks */
    Buf node_mark;  /* per tape node used as a frame (frame id + 1) or frames list (stack id + 2, 1: empty) */
    const char *err;
} S;

static int refuse(S *s, const char *why) { s->err = why; return -1; }

static int push(S *s, uint8_t kind, int64_t val) {
    if (grow(&s->stack, 1)) return -1;
    AT(s->stack, Value, s->stack.n).kind = kind;
    AT(s->stack, Value, s->stack.n).val = val;
    s->stack.n++;
    return 0;
}

static Py_ssize_t top_mark(S *s) { return s->marks.n ? AT(s->marks, Py_ssize_t, s->marks.n - 1) : -1; }
static Value *at(S *s, Py_ssize_t i) { return &AT(s->stack, Value, i); }

/* -- the tape ---------------------------------------------------------------------------------- */

static int new_node(S *s, uint8_t kind) {
    Py_ssize_t i = s->nkind.n;
    if (i >= LIMIT) return refuse(s, "too many containers");
    if (APPEND(s->nkind, uint8_t, kind) || APPEND(s->nfirst, int32_t, -1) || APPEND(s->nlast, int32_t, -1) ||
        APPEND(s->ncount, int32_t, 0))
        return -1;
    return push(s, kind, i);
}

static int32_t key_of(S *s, Value k) {
    if (k.kind == K_STR) return (int32_t)k.val;
    if (k.kind >= K_LIST) { s->err = "a container as a dict key"; return INT32_MIN; }
    PyObject *t = Py_BuildValue("(iL)", (int)k.kind, (long long)k.val);
    if (!t || PyList_Append(s->keys, t)) { Py_XDECREF(t); return INT32_MIN; }
    Py_DECREF(t);
    return (int32_t)(-2 - (PyList_GET_SIZE(s->keys) - 1));
}

static int edge(S *s, int64_t parent, int32_t key, Value v) {
    Py_ssize_t e = s->eparent.n;
    if (v.kind > K_TUPLE) return refuse(s, "a trace entry, frame or frames list used elsewhere");
    if (e >= 0x7ffffff0) return refuse(s, "too many items");
    if (parent < s->node_mark.n && AT(s->node_mark, int32_t, parent)) return refuse(s, "a frame changed after use");
    if (APPEND(s->eparent, int32_t, (int32_t)parent) || APPEND(s->ekey, int32_t, key) ||
        APPEND(s->ekind, uint8_t, v.kind) || APPEND(s->eval, int64_t, v.val))
        return -1;
    if (AT(s->nlast, int32_t, parent) < 0) AT(s->nfirst, int32_t, parent) = (int32_t)e;
    AT(s->nlast, int32_t, parent) = (int32_t)e;
    AT(s->ncount, int32_t, parent)++;
    return 0;
}

/* The id of a str (a new reference is taken when it is new), or -1. */
static Py_ssize_t intern_str(S *s, PyObject *u) {
    PyObject *id = PyDict_GetItemWithError(s->index, u);
    if (id) return PyLong_AsSsize_t(id);
    if (PyErr_Occurred()) return -1;
    Py_ssize_t i = PyList_GET_SIZE(s->strings);
    if (i >= LIMIT) return refuse(s, "too many strings");
    PyObject *num = PyLong_FromSsize_t(i);
    if (!num || PyDict_SetItem(s->index, u, num) || PyList_Append(s->strings, u)) {
        Py_XDECREF(num);
        return -1;
    }
    Py_DECREF(num);
    uint8_t f = F_NONE;
    for (int k = 1; k < N_FIELDS; k++)
        if (PyUnicode_CompareWithASCIIString(u, FIELD_NAMES[k]) == 0) f = (uint8_t)k;
    static const char *ROLES[] = {"alloc", "free_completed", "segment_alloc", "segment_map", "segment_free",
                                  "segment_unmap"};
    static const uint8_t ROLE_OF[] = {1, 2, 3, 3, 4, 4};  /* tracekit.model's actions that move the curves */
    uint8_t r = 0;
    for (int k = 0; k < 6; k++)
        if (PyUnicode_CompareWithASCIIString(u, ROLES[k]) == 0) r = ROLE_OF[k];
    uint8_t ours = 0;
    if (PyUnicode_GET_LENGTH(u) >= 14) {
        PyObject *head = PyUnicode_Substring(u, 0, 14);
        if (!head) return -1;
        ours = PyUnicode_CompareWithASCIIString(head, "tracekit:iter=") == 0;
        Py_DECREF(head);
    }
    if (APPEND(s->field_of, uint8_t, f) || APPEND(s->present, uint8_t, 0) || APPEND(s->role, uint8_t, r) ||
        APPEND(s->ours, uint8_t, ours) || APPEND(s->act_code, int32_t, 0))
        return -1;
    return i;
}

/* Push the string of UTF-8 bytes p[0:n] (strictly decoded for JSON, as json.loads' caller does). */
static int string(S *s, const char *p, Py_ssize_t n) {
    PyObject *u = PyUnicode_DecodeUTF8(p, n, s->json ? "strict" : "surrogatepass");
    if (!u) return -1;
    Py_ssize_t i = intern_str(s, u);
    Py_DECREF(u);
    return i < 0 ? -1 : push(s, K_STR, i);
}

static int field(S *s, Value k) { return k.kind == K_STR ? AT(s->field_of, uint8_t, k.val) : F_NONE; }

/* -- frames and stacks --------------------------------------------------------------------------- */

static uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Make a table of ids + 1 (0 = empty) twice as big and put every id back by `hash(id)`. */
static int rehash(S *s, Buf *table, Py_ssize_t n, uint64_t (*hash)(S *, int32_t)) {
    Py_ssize_t cap = table->n ? table->n * 2 : 1024;
    int32_t *t = PyMem_RawCalloc((size_t)cap, sizeof(int32_t));
    if (!t) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = hash(s, (int32_t)i) & (cap - 1);
        while (t[h]) h = (h + 1) & (cap - 1);
        t[h] = (int32_t)i + 1;
    }
    PyMem_RawFree(table->p);
    table->p = (char *)t;
    table->n = table->cap = cap;
    return 0;
}

static void memo_free(Memo *m) {
    PyMem_RawFree(m->arena.p); PyMem_RawFree(m->boff.p);
    PyMem_RawFree(m->pkey.p); PyMem_RawFree(m->pval.p); PyMem_RawFree(m->ptable.p);
    PyMem_RawFree(m->ckey); PyMem_RawFree(m->cval);
    memset(m, 0, sizeof *m);
}

static void memo_init(Memo *m) {
    memset(m, 0, sizeof *m);
    m->arena.size = 1; m->boff.size = 8; m->pkey.size = 8; m->pval.size = 4; m->ptable.size = 4;
}

/* A slot's value against the last MEMO_MRU distinct values of its kind in its block (most recent
 * first, updated here): their position when it is one of them, else MEMO_MRU + the zigzag difference
 * from the most recent (so the entry, 'N/A', metadata and frames-list slots of each entry take a byte). */
#define MEMO_MRU 4
static void memo_front(uint32_t *mru, int k, uint32_t val) {
    for (; k > 0; k--) mru[k] = mru[k - 1];
    mru[0] = val;
}
static uint64_t memo_code(uint32_t *mru, uint32_t val) {
    for (int k = 0; k < MEMO_MRU; k++)
        if (mru[k] == val) { memo_front(mru, k, val); return (uint64_t)k; }
    int64_t d = (int64_t)val - (int64_t)mru[0];
    memo_front(mru, MEMO_MRU - 1, val);
    return MEMO_MRU + (((uint64_t)d << 1) ^ (uint64_t)(d >> 63));
}
static uint32_t memo_value(uint32_t *mru, uint64_t code) {
    if (code < MEMO_MRU) {
        uint32_t val = mru[code];
        memo_front(mru, (int)code, val);
        return val;
    }
    uint64_t z = code - MEMO_MRU;
    uint32_t val = (uint32_t)((int64_t)mru[0] + ((int64_t)(z >> 1) ^ -(int64_t)(z & 1)));
    memo_front(mru, MEMO_MRU - 1, val);
    return val;
}

static int memo_encode_tail(Memo *m) {  /* the tail is full: encode it as the next block */
    if (grow(&m->arena, MEMO_BLOCK * 6) || APPEND(m->boff, int64_t, (int64_t)m->arena.n)) return -1;
    uint32_t mru[16][MEMO_MRU] = {{0}};
    unsigned char *o = (unsigned char *)m->arena.p + m->arena.n;
    for (int j = 0; j < MEMO_BLOCK; j++) {
        uint32_t v = m->tail[j], kind = v >> 28, val = kind == K_ENTRY ? 0 : v & 0x0fffffff;
        uint64_t code = memo_code(mru[kind], val);
        uint64_t u = (code << 4) | kind;
        while (u >= 0x80) { *o++ = (unsigned char)(u | 0x80); u >>= 7; }
        *o++ = (unsigned char)u;
    }
    m->arena.n = (char *)o - m->arena.p;
    return 0;
}

static uint64_t memo_hash(int64_t i) { return mix((uint64_t)i); }

/* The row + 1 of slot i in the table of changes, or 0; *h: where it is or would go. */
static int32_t memo_find(Memo *m, int64_t i, uint64_t *h) {
    if (!m->ptable.n) return 0;
    Py_ssize_t mask = m->ptable.n - 1;
    int32_t *t = (int32_t *)m->ptable.p;
    for (*h = memo_hash(i) & mask; t[*h]; *h = (*h + 1) & mask)
        if (AT(m->pkey, int64_t, t[*h] - 1) == i) return t[*h];
    return 0;
}

static uint32_t memo_get(Memo *m, Py_ssize_t i) {
    Py_ssize_t b = i / MEMO_BLOCK, r = i % MEMO_BLOCK;
    if (b >= m->boff.n) return m->tail[r];
    Py_ssize_t c = i & (MEMO_CACHE - 1);
    if (m->ckey && m->ckey[c] == i) return m->cval[c];
    uint64_t h;
    int32_t row = m->pkey.n ? memo_find(m, i, &h) : 0;
    if (row) return AT(m->pval, uint32_t, row - 1);
    if (!m->ckey) {
        m->ckey = PyMem_RawMalloc(MEMO_CACHE * sizeof(int64_t));
        m->cval = PyMem_RawMalloc(MEMO_CACHE * sizeof(uint32_t));
        if (m->ckey) memset(m->ckey, 0xff, MEMO_CACHE * sizeof(int64_t));
        if (!m->ckey || !m->cval) { PyMem_RawFree(m->ckey); PyMem_RawFree(m->cval); m->ckey = NULL; m->cval = NULL; }
    }
    const unsigned char *p = (const unsigned char *)m->arena.p + AT(m->boff, int64_t, b);
    uint32_t mru[16][MEMO_MRU] = {{0}};
    for (Py_ssize_t j = 0;; j++) {
        uint64_t u = 0;
        int shift = 0;
        do { u |= (uint64_t)(*p & 0x7f) << shift; shift += 7; } while (*p++ & 0x80);
        uint32_t kind = (uint32_t)(u & 15);
        uint32_t val = memo_value(mru[kind], u >> 4);
        if (j == r) {
            if (m->ckey) { m->ckey[c] = i; m->cval[c] = (kind << 28) | val; }
            return (kind << 28) | val;
        }
    }
}

static uint64_t memo_phash(S *s, int32_t row) { return memo_hash(AT(s->memo.pkey, int64_t, row)); }

/* Set slot i (i < n: change it; i == n: a new slot). */
static int memo_put(S *s, Memo *m, Py_ssize_t i, uint32_t v) {
    Py_ssize_t b = i / MEMO_BLOCK;
    if (i == m->n) {
        m->tail[i % MEMO_BLOCK] = v;
        m->n++;
        return m->n % MEMO_BLOCK ? 0 : memo_encode_tail(m);
    }
    if (b >= m->boff.n) { m->tail[i % MEMO_BLOCK] = v; return 0; }
    if (m->ckey && m->ckey[i & (MEMO_CACHE - 1)] == i) m->cval[i & (MEMO_CACHE - 1)] = v;
    uint64_t h = 0;
    int32_t row = memo_find(m, i, &h);
    if (row) { AT(m->pval, uint32_t, row - 1) = v; return 0; }
    if ((m->pkey.n + 1) * 2 > m->ptable.n) {
        if (rehash(s, &m->ptable, m->pkey.n, memo_phash)) return -1;
        memo_find(m, i, &h);
    }
    if (m->pkey.n >= 0x7ffffff0) return refuse(s, "too many memo changes");
    if (APPEND(m->pkey, int64_t, (int64_t)i) || APPEND(m->pval, uint32_t, v)) return -1;
    AT(m->ptable, int32_t, h) = (int32_t)m->pkey.n;
    return 0;
}

static uint64_t frame_hash3(int32_t fname, int32_t name, int64_t line) {
    return mix((uint64_t)fname * 0x100000001B3ull ^ mix((uint64_t)name) ^ mix((uint64_t)line + 7));
}
static uint64_t frame_hash(S *s, int32_t i) {
    return frame_hash3(AT(s->f_file, int32_t, i), AT(s->f_name, int32_t, i), AT(s->f_line, int64_t, i));
}

static int32_t intern_frame(S *s, PFrame *f) {
    if (f->have != 7) { s->err = "a frame without filename, line and name"; return -1; }
    if ((s->f_line.n + 1) * 2 > s->f_table.n && rehash(s, &s->f_table, s->f_line.n, frame_hash)) return -2;
    Py_ssize_t mask = s->f_table.n - 1;
    uint64_t h = frame_hash3(f->fname, f->name, f->line) & mask;
    int32_t *t = (int32_t *)s->f_table.p;
    for (; t[h]; h = (h + 1) & mask) {
        int32_t i = t[h] - 1;
        if (AT(s->f_file, int32_t, i) == f->fname && AT(s->f_name, int32_t, i) == f->name &&
            AT(s->f_line, int64_t, i) == f->line)
            return i;
    }
    int32_t i = (int32_t)s->f_line.n;
    if (i >= LIMIT) { s->err = "too many frames"; return -1; }
    if (APPEND(s->f_file, int32_t, f->fname) || APPEND(s->f_name, int32_t, f->name) ||
        APPEND(s->f_line, int64_t, f->line))
        return -2;
    t[h] = i + 1;
    return i;
}

static uint64_t seq_hash(const int32_t *f, Py_ssize_t n) {
    uint64_t h = mix((uint64_t)n);
    for (Py_ssize_t i = 0; i < n; i++) h = mix(h ^ (uint64_t)f[i]) * 0x100000001B3ull;
    return h;
}
static uint64_t stack_hash(S *s, int32_t i) { return AT(s->s_hash, uint64_t, i); }

/* The stack id of a sequence of frame ids (>= 0), -1 for an empty one, -2 on no memory. */
static int32_t intern_stack(S *s, const int32_t *f, Py_ssize_t n) {
    if (!n) return -1;
    Py_ssize_t ns = s->s_hash.n;
    if ((ns + 1) * 2 > s->s_table.n && rehash(s, &s->s_table, ns, stack_hash)) return -2;
    uint64_t hv = seq_hash(f, n);
    Py_ssize_t mask = s->s_table.n - 1;
    uint64_t h = hv & mask;
    int32_t *t = (int32_t *)s->s_table.p;
    for (; t[h]; h = (h + 1) & mask) {
        int32_t i = t[h] - 1;
        Py_ssize_t a = AT(s->s_off, int64_t, i), b = AT(s->s_off, int64_t, i + 1);
        if (AT(s->s_hash, uint64_t, i) == hv && b - a == n &&
            !memcmp(&AT(s->s_fids, int32_t, a), f, (size_t)n * sizeof(int32_t)))
            return i;
    }
    if (ns >= LIMIT) { s->err = "too many stacks"; return -3; }
    if (!s->s_off.n && APPEND(s->s_off, int64_t, 0)) return -2;
    if (grow(&s->s_fids, n)) return -2;
    memcpy(&AT(s->s_fids, int32_t, s->s_fids.n), f, (size_t)n * sizeof(int32_t));
    s->s_fids.n += n;
    if (APPEND(s->s_off, int64_t, (int64_t)s->s_fids.n) || APPEND(s->s_hash, uint64_t, hv)) return -2;
    t[h] = (int32_t)ns + 1;
    return (int32_t)ns;
}

/* Set the memo entry `i` (when there is one) to a finished frame or stack. */
static int memo_set(S *s, Py_ssize_t i, uint8_t kind, int64_t val) {
    return i >= 0 ? memo_put(s, &s->memo, i, ((uint32_t)kind << 28) | (uint32_t)val) : 0;
}

static int set_frame_fields(S *s, PFrame *f, Value k, Value v);

/* The mark of a tape node (0: not used as a frame or frames list yet). */
static int32_t *mark_of(S *s, int64_t node) {
    if (s->node_mark.n <= node) {
        Py_ssize_t n = s->node_mark.n;
        if (grow(&s->node_mark, s->nkind.n - n)) return NULL;
        memset(&AT(s->node_mark, int32_t, n), 0, (size_t)(s->nkind.n - n) * sizeof(int32_t));
        s->node_mark.n = s->nkind.n;
    }
    return &AT(s->node_mark, int32_t, node);
}

/* The edges [*a, *b) of a tape node, or -1 when they are not contiguous. */
static int node_edges(S *s, int64_t node, Py_ssize_t *a, Py_ssize_t *b) {
    int32_t first = AT(s->nfirst, int32_t, node), last = AT(s->nlast, int32_t, node), n = AT(s->ncount, int32_t, node);
    if (!n) { *a = *b = 0; return 0; }
    if (last - first + 1 != n) return refuse(s, "a frame or frames list built in pieces");
    *a = first; *b = (Py_ssize_t)last + 1;
    return 0;
}

/* The frame id of a frame dict of the tape (one met earlier, e.g. in the segments), -1 / -2 as below. */
static int32_t node_frame(S *s, int64_t node) {
    int32_t *m = mark_of(s, node);
    if (!m) return -2;
    if (*m) return *m - 1;
    Py_ssize_t a, b;
    if (node_edges(s, node, &a, &b)) return -1;
    PFrame f = {0, 0, 0, 0, -1, -1};
    for (Py_ssize_t e = a; e < b; e++) {
        int32_t k = AT(s->ekey, int32_t, e);
        Value key = {k >= 0 ? K_STR : K_INT, k}, v = {AT(s->ekind, uint8_t, e), AT(s->eval, int64_t, e)};
        if (set_frame_fields(s, &f, key, v)) return -1;
    }
    int32_t id = intern_frame(s, &f);
    if (id >= 0) *mark_of(s, node) = id + 1;
    return id;
}

/* The frame id of a frame value (finishing an open one), or -1 (refused) / -2 (no memory). */
static int32_t frame_of(S *s, Value v) {
    if (v.kind == K_FRAME) return (int32_t)v.val;
    if (v.kind == K_DICT) return node_frame(s, v.val);
    if (v.kind != K_FRAME_OPEN) { s->err = "a frames list holding something else than frames"; return -1; }
    PFrame *f = &AT(s->pframes, PFrame, v.val);
    if (f->fid >= 0) return f->fid;
    int32_t id = intern_frame(s, f);
    if (id < 0) return id;
    f->fid = id;
    if (memo_set(s, f->memo, K_FRAME, id)) return -2;
    if (--s->open_frames == 0) s->pframes.n = 0;
    return id;
}

/* The stack id + 1 (0: empty) of a frames list of the tape, -1 / -2 as below. */
static int64_t node_stack(S *s, int64_t node) {
    int32_t *m = mark_of(s, node);
    if (!m) return -2;
    if (*m) return *m - 1;
    Py_ssize_t a, b, start = s->pfids.n;
    if (node_edges(s, node, &a, &b)) return -1;
    for (Py_ssize_t e = a; e < b; e++) {
        Value v = {AT(s->ekind, uint8_t, e), AT(s->eval, int64_t, e)};
        if (v.kind != K_DICT) return refuse(s, "a frames list holding something else than frames");
        int32_t id = node_frame(s, v.val);
        if (id < 0) { s->pfids.n = start; return id; }
        if (APPEND(s->pfids, int32_t, id)) return -2;
    }
    int32_t id = intern_stack(s, &AT(s->pfids, int32_t, start), s->pfids.n - start);
    s->pfids.n = start;
    if (id <= -2) return id == -2 ? -2 : -1;
    *mark_of(s, node) = id + 2;
    return id + 1;
}

/* The stack id + 1 of a frames value (0: none or empty), or -1 (refused) / -2 (no memory). */
static int64_t stack_of(S *s, Value v) {
    if (v.kind == K_NONE) return 0;
    if (v.kind == K_STACK) return v.val;
    if (v.kind == K_LIST) return node_stack(s, v.val);
    if (v.kind != K_FLIST) { s->err = "an entry's frames that are not a list of frames"; return -1; }
    PList *l = &AT(s->plists, PList, v.val);
    if (l->stack == -2) {
        int32_t id = intern_stack(s, &AT(s->pfids, int32_t, l->start), l->len);
        if (id <= -2) return id == -2 ? -2 : -1;
        l->stack = id;
        if (memo_set(s, l->memo, K_STACK, id + 1)) return -2;
        if (--s->open_lists == 0) s->plists.n = s->pfids.n = 0;
    }
    return l->stack + 1;
}

/* -- entries ------------------------------------------------------------------------------------- */

/* A new entry: a pending Row. Its id (its row while pending) is pend_base + its place among the pending
 * rows; pend_base is the rows in the columns when the last batch was all appended (so, in a window, the
 * ids start again from the kept rows, as the rows of a whole read go on from the appended ones). */
static int new_entry(S *s) {
    Py_ssize_t row = s->pend_base + s->pend.n;
    if (row >= LIMIT) return refuse(s, "too many entries");
    Row r = {0, 0, 0, s->no_time, -1, 0, 0, -1, -1, -1, -1};
    if (APPEND(s->pend, Row, r)) return -1;
    return push(s, K_ENTRY, row);
}

/* The code of an action string id (1, 2, ... in order of first use): one byte a row while there are
 * fewer than 256 distinct actions, four from the 256th on. */
static int64_t action_code(S *s, int32_t sid) {
    int32_t *code = &AT(s->act_code, int32_t, sid);
    if (!*code) {
        if (APPEND(s->act_sid, int32_t, sid)) return -1;
        *code = (int32_t)s->act_sid.n;
        if (*code == 256 && col_widen(&s->col[C_ACTION], 4)) return -1;
    }
    return *code;
}

/* A pending entry into the columns, at row nrows. */
static int commit(S *s, const Row *r) {
    if (r->action < 0) return refuse(s, "an entry without an action");
    int64_t code = action_code(s, r->action);
    if (code < 0) return -1;
    Col *c = s->col;
    if (col_append(&c[C_ACTION], code) || col_append(&c[C_ADDR], r->addr) || col_append(&c[C_SIZE], r->size) ||
        col_append(&c[C_STREAM], r->stream) || col_append(&c[C_TIME], r->time) ||
        col_append(&c[C_FRAMES], r->frames) || col_append(&c[C_FWD], r->fwd) || col_append(&c[C_UM], r->um) ||
        col_append(&c[C_CC], r->cc) || col_append(&c[C_CAT], r->cat) || col_append(&c[C_MOD], r->mod))
        return -1;
    s->nrows++;
    return 0;
}

static int set_entry(S *s, Py_ssize_t row, Value k, Value v) {
    if (k.kind != K_STR) return refuse(s, "an entry key that is not a string");
    AT(s->present, uint8_t, k.val) |= 1;
    int f = field(s, k);
    if (v.kind > K_TUPLE && !((f == F_FRAMES || f == F_FWD) && (v.kind == K_FLIST || v.kind == K_STACK)))
        return refuse(s, "a trace entry, frame or frames list used elsewhere");
    Row *r = &AT(s->pend, Row, row - s->pend_base);
    switch (f) {
    case F_ACTION:
        if (v.kind != K_STR) return refuse(s, "an action that is not a string");
        r->action = (int32_t)v.val;
        AT(s->present, uint8_t, v.val) |= 2;  /* an action's name (its unknown ones are listed) */
        break;
    case F_ADDR: case F_SIZE: case F_STREAM: case F_TIME:
        if (v.kind != K_INT) return refuse(s, "an entry's number of an unusual type");
        if (f == F_ADDR && v.val < 0) return refuse(s, "a negative address");
        *(f == F_ADDR ? &r->addr : f == F_SIZE ? &r->size : f == F_STREAM ? &r->stream : &r->time) = v.val;
        break;
    case F_FRAMES: case F_FWD: {
        int64_t id = stack_of(s, v);
        if (id < 0) return -1;
        r = &AT(s->pend, Row, row - s->pend_base);  /* (not moved: no pending row is added meanwhile) */
        *(f == F_FRAMES ? &r->frames : &r->fwd) = (int32_t)id;
        break;
    }
    case F_UM: case F_CC: case F_CAT: case F_MOD:
        if (v.kind != K_STR) return refuse(s, "an entry's text of an unusual type");
        *(f == F_UM ? &r->um : f == F_CC ? &r->cc : f == F_CAT ? &r->cat : &r->mod) = (int32_t)v.val;
        break;
    case F_DFREE:
        if (APPEND(s->df_row, int32_t, (int32_t)row) || APPEND(s->df_kind, uint8_t, v.kind) ||
            APPEND(s->df_val, int64_t, v.val))
            return -1;
        break;
    }
    return 0;
}

static int set_frame_fields(S *s, PFrame *f, Value k, Value v) {
    if (k.kind != K_STR) return refuse(s, "a frame key that is not a string");
    if (v.kind > K_TUPLE) return refuse(s, "a trace entry, frame or frames list used elsewhere");
    switch (field(s, k)) {
    case F_FILENAME: case F_NAME:
        if (v.kind != K_STR) return refuse(s, "a frame's text of an unusual type");
        if (field(s, k) == F_FILENAME) { f->fname = (int32_t)v.val; f->have |= 1; }
        else { f->name = (int32_t)v.val; f->have |= 4; }
        break;
    case F_LINE:
        if (v.kind != K_INT) return refuse(s, "a frame's line of an unusual type");
        f->line = v.val;
        f->have |= 2;
        break;
    }
    return 0;
}

/* SETITEM(S): `k`, `v` into the container `c` at stack position `pos`. */
static int set_item(S *s, Value c, Py_ssize_t pos, Value k, Value v) {
    if (c.kind == K_ENTRY) {
        if (c.val < s->appended || c.val >= s->pend_base + s->pend.n)
            return refuse(s, "a trace entry changed after use");
        return set_entry(s, c.val, k, v);
    }
    if (c.kind == K_FRAME_OPEN) {
        if (AT(s->pframes, PFrame, c.val).fid >= 0) return refuse(s, "a frame changed after use");
        return set_frame_fields(s, &AT(s->pframes, PFrame, c.val), k, v);
    }
    if (c.kind != K_DICT) return refuse(s, "an item set in a non-dict");
    if (pos == 0 && field(s, k) == F_DT) {
        if (s->dt_set) return refuse(s, "'device_traces' set twice");
        s->dt_set = 1;
        s->root = c.val;
        if (v.kind == K_OLIST) return 0;
    }
    int32_t key = key_of(s, k);
    if (key == INT32_MIN) return -1;
    return edge(s, c.val, key, v);
}

/* -- a window: fold every entry, keep those inside ---------------------------------------------------- */

static uint64_t am_hash3(int32_t dev, uint64_t addr) { return mix(addr ^ ((uint64_t)dev << 56)); }
static uint64_t am_hash(S *s, int32_t i) { return am_hash3(AT(s->am_dev, int32_t, i), AT(s->am_key, uint64_t, i)); }

/* The state slot of (device, address), added (state 0) when new; NULL on no memory. */
static uint8_t *am_slot(S *s, int32_t dev, uint64_t addr) {
    Py_ssize_t n = s->am_key.n;
    if ((n + 1) * 2 > s->am_table.n && rehash(s, &s->am_table, n, am_hash)) return NULL;
    Py_ssize_t mask = s->am_table.n - 1;
    int32_t *t = (int32_t *)s->am_table.p;
    uint64_t h = am_hash3(dev, addr) & mask;
    for (; t[h]; h = (h + 1) & mask) {
        int32_t i = t[h] - 1;
        if (AT(s->am_key, uint64_t, i) == addr && AT(s->am_dev, int32_t, i) == dev) return &AT(s->am_state, uint8_t, i);
    }
    if (n >= LIMIT) { s->err = "too many addresses"; return NULL; }
    if (APPEND(s->am_key, uint64_t, addr) || APPEND(s->am_dev, int32_t, dev) || APPEND(s->am_state, uint8_t, 0))
        return NULL;
    t[h] = (int32_t)n + 1;
    return &AT(s->am_state, uint8_t, n);
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The address table holds every address the trace allocates or frees (for its state, and for the
 * addresses the trace touches), so it grows with the file when addresses are not reused. When it holds
 * AM_COMPACT rows, or twice what it held after the last compaction, the addresses of device list `dl`
 * whose last action was a free (state 2: only "touched" matters now; a free there again counts as
 * lone, as an absent address does) move to the list `fz` (8 bytes each, sorted and deduplicated when
 * its segment doubles), and the table is rebuilt with the rest. */
#define AM_COMPACT (1 << 20)
static int am_compact(S *s, Py_ssize_t dl) {
    DList *d = &AT(s->dlists, DList, dl);
    Py_ssize_t w = 0, n = s->am_key.n;
    if (!d->fz_n) d->fz_start = s->fz.n;
    if (d->fz_start + d->fz_n != s->fz.n) return refuse(s, "a device trace's entries interleaved");
    for (Py_ssize_t i = 0; i < n; i++) {
        if (AT(s->am_dev, int32_t, i) == (int32_t)dl && AT(s->am_state, uint8_t, i) == 2) {
            if (APPEND(s->fz, uint64_t, AT(s->am_key, uint64_t, i))) return -1;
            d->fz_n++;
            continue;
        }
        AT(s->am_key, uint64_t, w) = AT(s->am_key, uint64_t, i);
        AT(s->am_dev, int32_t, w) = AT(s->am_dev, int32_t, i);
        AT(s->am_state, uint8_t, w) = AT(s->am_state, uint8_t, i);
        w++;
    }
    s->am_key.n = s->am_dev.n = s->am_state.n = w;
    Py_ssize_t cap = 1024;
    while (cap < 2 * (w + 1)) cap *= 2;
    s->am_table.n = cap / 2;  /* rehash makes a table twice this size */
    if (rehash(s, &s->am_table, w, am_hash)) return -1;
    s->am_compact_at = 2 * w > s->am_min ? 2 * w : s->am_min;
    if (d->fz_n > 2 * d->fz_sorted + s->am_min) {  /* addresses freed again since: once each */
        uint64_t *z = &AT(s->fz, uint64_t, d->fz_start);
        qsort(z, (size_t)d->fz_n, sizeof *z, cmp_u64);
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < d->fz_n; i++)
            if (!k || z[i] != z[k - 1]) z[k++] = z[i];
        d->fz_n = d->fz_sorted = k;
        s->fz.n = d->fz_start + k;
    }
    return 0;
}

/* The addresses device list `dl` allocates or frees (duplicates possible), as a bytearray of uint64. */
static PyObject *am_touched(S *s, Py_ssize_t dl) {
    DList *d = &AT(s->dlists, DList, dl);
    Py_ssize_t n = d->fz_n;
    for (Py_ssize_t i = 0; i < s->am_key.n; i++) n += AT(s->am_dev, int32_t, i) == (int32_t)dl;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, n * 8);
    if (!out) return NULL;
    uint64_t *o = (uint64_t *)PyByteArray_AS_STRING(out);
    if (d->fz_n) memcpy(o, &AT(s->fz, uint64_t, d->fz_start), (size_t)d->fz_n * 8);
    o += d->fz_n;
    for (Py_ssize_t i = 0; i < s->am_key.n; i++)
        if (AT(s->am_dev, int32_t, i) == (int32_t)dl) *o++ = AT(s->am_key, uint64_t, i);
    return out;
}

/* Entry `row` (its pending Row r) is appended to device list `dl` (at its next position): fold it, then
 * keep it (into the columns) or drop it. */
static int window_entry(S *s, DList *d, Py_ssize_t dl, Py_ssize_t row, const Row *r) {
    if (d->pos && s->last_dl != dl) return refuse(s, "a device trace's entries interleaved");
    s->last_dl = dl;
    int64_t pos = d->pos++;
    int32_t a = r->action;
    if (a < 0) return refuse(s, "an entry without an action");
    int64_t size = r->size, t = r->time;
    uint64_t addr = (uint64_t)r->addr;
    if (size < 0 || size > s->max_size) return refuse(s, "an entry's size out of range");
    d->sizesum += (double)size;
    if (d->sizesum >= 4611686018427387904.0) return refuse(s, "sizes adding up beyond 2**62");
    if (t != s->no_time) {
        if (t >= s->max_time || t <= -s->max_time) return refuse(s, "a time out of range");
        if (d->tmin == s->no_time || t < d->tmin) d->tmin = t;
        if (d->tmax == s->no_time || t > d->tmax) d->tmax = t;
        if (t >= s->w_thr) d->started = 1;
    }
    if (!s->w_has_thr) d->started = 1;
    int64_t first = s->w_first, hi = s->w_hi;
    if (dl < s->w_ranges.n / 2) {
        first = AT(s->w_ranges, int64_t, 2 * dl);
        hi = AT(s->w_ranges, int64_t, 2 * dl + 1);
    }
    if (s->w_record) {
        int32_t um = r->um;
        if (!pos) { d->rec_start = s->rec_pos.n; d->rec_tstart = s->rec_t.n; }
        if (!pos || um != d->rec_last) {
            if (APPEND(s->rec_pos, int64_t, pos) || APPEND(s->rec_um, int32_t, um)) return -1;
            d->rec_last = um;
            d->rec_runs++;
        }
        if (um < 0 || !AT(s->ours, uint8_t, um)) {
            if (APPEND(s->rec_t, int64_t, t)) return -1;
            d->rec_tn++;
        }
    }
    if (!d->lo_found && d->started && pos >= first) {
        d->lo_found = 1; d->lo = pos; d->cum_lo = d->cum; d->rcum_lo = d->rcum;
    }
    uint8_t role = AT(s->role, uint8_t, a);
    if (role == 1 || role == 2) {
        if (s->am_key.n >= s->am_compact_at && am_compact(s, dl)) return -1;
        uint8_t *st = am_slot(s, (int32_t)dl, addr);
        if (!st) return -1;
        d->cum += role == 1 ? size : -size;
        if (role == 2 && *st != 1) d->lone += size;  /* freed, not allocated in the trace: live before it */
        *st = role == 1 ? 1 : 2;
    } else if (role == 3 || role == 4) {
        d->rcum += role == 3 ? size : -size;
    }
    if (s->fu_last_dl != dl) {
        s->fu_last_dl = dl;
        for (int i = 0; i < 6; i++) s->fu_last[i] = INT64_MIN;
    }
    int32_t used[6] = {r->frames, r->fwd, r->um, r->cc, r->cat, r->mod};
    for (int i = 0; i < 6; i++) {
        if (used[i] == s->fu_last[i] || (i < 2 && !used[i])) continue;
        s->fu_last[i] = used[i];
        uint8_t *st = am_slot(s, (int32_t)(-1 - dl), ((uint64_t)i << 32) | (uint32_t)used[i]);
        if (!st) return -1;
        if (*st) continue;
        *st = 1;
        if (APPEND(s->fu_dl, int32_t, (int32_t)dl) || APPEND(s->fu_col, uint8_t, (uint8_t)i) ||
            APPEND(s->fu_id, int32_t, used[i]))
            return -1;
    }
    Py_ssize_t w = s->nrows;
    if (d->lo_found && pos < hi) {  /* kept: into the columns, at row w */
        if (!d->count) d->first = w;
        if (commit(s, r)) return -1;
        if (row != w)
            for (Py_ssize_t i = s->df_row.n - 1; i >= 0 && AT(s->df_row, int32_t, i) >= row; i--)
                if (AT(s->df_row, int32_t, i) == row) AT(s->df_row, int32_t, i) = (int32_t)w;
        d->count++;
    } else {
        for (Py_ssize_t i = s->df_row.n - 1; i >= 0 && AT(s->df_row, int32_t, i) >= row; i--)
            if (AT(s->df_row, int32_t, i) == row) AT(s->df_row, int32_t, i) = -1;
    }
    return 0;
}

/* The fold of each device list (see DList), in root order, and the addresses met: (device, address) pairs. */
static PyObject *window_result(S *s) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < s->order.n; i++) {
        int32_t dl = AT(s->order, int32_t, i);
        DList *d = &AT(s->dlists, DList, dl);
        int64_t lo = d->lo_found ? d->lo : d->pos;
        int64_t cum_lo = d->lo_found ? d->cum_lo : d->cum, rcum_lo = d->lo_found ? d->rcum_lo : d->rcum;
        PyObject *t = Py_BuildValue("{sLsLsLsLsisLsLsnsLsLsLsLsLsL}", "rec_start", (long long)d->rec_start,
                                    "rec_runs", (long long)d->rec_runs, "rec_tstart", (long long)d->rec_tstart,
                                    "rec_tn", (long long)d->rec_tn, "dl", (int)dl, "n", (long long)d->pos, "lo", (long long)lo,
                                    "kept", d->count, "cum_lo", (long long)cum_lo, "rcum_lo", (long long)rcum_lo,
                                    "rcum", (long long)d->rcum, "lone", (long long)d->lone,
                                    "tmin", (long long)d->tmin, "tmax", (long long)d->tmax);
        PyObject *touched = t ? am_touched(s, dl) : NULL;
        int bad = !touched || PyDict_SetItemString(t, "touched", touched);
        Py_XDECREF(touched);
        if (bad || PyList_Append(out, t)) { Py_XDECREF(t); Py_DECREF(out); return NULL; }
        Py_DECREF(t);
        if (i == s->order.n - 1) { PyMem_RawFree(s->fz.p); s->fz.p = NULL; s->fz.n = s->fz.cap = 0; }
    }
    return out;
}

/* APPEND(S): `v` into the list `c`. */
static int append_item(S *s, Value c, Value v) {
    if (c.kind == K_LIST) return edge(s, c.val, NO_KEY, v);
    if (c.kind == K_DLIST) {
        DList *d = &AT(s->dlists, DList, c.val);
        if (v.kind != K_ENTRY) return refuse(s, "a device trace holding a non-entry");
        if (v.val != s->appended) return refuse(s, "entries out of order or listed twice");
        if (d->appended) return refuse(s, "a device trace changed after use");
        if (v.val >= s->pend_base + s->pend.n) return refuse(s, "a trace entry listed twice");
        const Row *r = &AT(s->pend, Row, v.val - s->pend_base);
        if (s->windowed) {
            if (window_entry(s, d, c.val, v.val, r)) return -1;
        } else {
            if (!d->count) d->first = s->nrows;
            else if (d->first + d->count != s->nrows) return refuse(s, "a device trace's entries interleaved");
            if (commit(s, r)) return -1;
            d->count++;
        }
        if (++s->appended == s->pend_base + s->pend.n) {  /* no entry is pending: the next ids go on from the rows */
            s->pend.n = 0;
            s->pend_base = s->appended = s->nrows;
        }
        return 0;
    }
    if (c.kind == K_OLIST) {
        if (v.kind != K_DLIST) return refuse(s, "'device_traces' holding a non-list");
        DList *d = &AT(s->dlists, DList, v.val);
        if (d->appended) return refuse(s, "a device trace listed twice");
        d->appended = 1;
        return APPEND(s->order, int32_t, (int32_t)v.val);
    }
    if (c.kind == K_FLIST) {
        PList *l = &AT(s->plists, PList, c.val);
        if (l->stack != -2 || c.val != s->plists.n - 1) return refuse(s, "a frames list changed out of order");
        int32_t id = frame_of(s, v);
        if (id < 0) return id == -1 ? -1 : -1;
        if (APPEND(s->pfids, int32_t, id)) return -1;
        l->len++;
        return 0;
    }
    return refuse(s, "an item added to a non-list");
}

/* -- where a new container stands: the context of the snapshot's layout -------------------------------- */

/* The stack position of the list of kind `a` or `b` that will receive an item pushed now at stack
 * position n by APPEND (the list just below it) or APPENDS (the list below the last MARK), or -1. */
static Py_ssize_t list_parent(S *s, Py_ssize_t n, int a, int b) {
    Py_ssize_t m = top_mark(s);
    if (n >= 1 && m <= n - 1 && (at(s, n - 1)->kind == a || at(s, n - 1)->kind == b)) return n - 1;
    if (m >= 1 && (at(s, m - 1)->kind == a || at(s, m - 1)->kind == b)) return m - 1;
    return -1;
}

/* The stack position of the dict that will receive an item pushed now at position n as the value of the
 * key at n - 1 (SETITEMS after a MARK, or SETITEM), or -1. */
static Py_ssize_t dict_parent(S *s, Py_ssize_t n) {
    Py_ssize_t m = top_mark(s);
    if (n < 2 || at(s, n - 1)->kind != K_STR) return -1;
    if (m >= 1 && (n - m) % 2 == 1) return m - 1;
    if (m <= n - 2) return n - 2;
    return -1;
}

static int new_dict(S *s) {
    Py_ssize_t n = s->stack.n, p = list_parent(s, n, K_DLIST, K_FLIST);
    if (p >= 0 && at(s, p)->kind == K_DLIST) return new_entry(s);
    if (p >= 0 && at(s, p)->kind == K_FLIST) {
        if (s->pframes.n >= LIMIT) return refuse(s, "too many open frames");
        PFrame f = {0, 0, 0, 0, -1, -1};
        if (APPEND(s->pframes, PFrame, f)) return -1;
        s->open_frames++;
        return push(s, K_FRAME_OPEN, s->pframes.n - 1);
    }
    return new_node(s, K_DICT);
}

static int new_list(S *s) {
    Py_ssize_t n = s->stack.n, d = dict_parent(s, n);
    int f = d >= 0 ? field(s, *at(s, n - 1)) : F_NONE;
    if (d == 0 && f == F_DT && at(s, 0)->kind == K_DICT && !s->olist_made) {
        s->olist_made = 1;
        return push(s, K_OLIST, 0);
    }
    if (d >= 0 && (f == F_FRAMES || f == F_FWD) && at(s, d)->kind == K_ENTRY) {
        if (s->plists.n >= LIMIT) return refuse(s, "too many open frames lists");
        PList l = {s->pfids.n, 0, -1, -2};
        if (APPEND(s->plists, PList, l)) return -1;
        s->open_lists++;
        return push(s, K_FLIST, s->plists.n - 1);
    }
    if (list_parent(s, n, K_OLIST, K_OLIST) >= 0) {
        if (s->dlists.n >= LIMIT) return refuse(s, "too many device traces");
        DList dl = {0};
        dl.tmin = dl.tmax = s->no_time;
        if (APPEND(s->dlists, DList, dl)) return -1;
        return push(s, K_DLIST, s->dlists.n - 1);
    }
    return new_node(s, K_LIST);
}

/* -- input ----------------------------------------------------------------------------------------- */

/* Make at least `k` bytes available at *p (moving the rest of the buffer to its start); 1 if the data
 * ends first, -1 on an error. */
static int refill(S *s, const unsigned char **p, const unsigned char **end, Py_ssize_t k) {
    Py_ssize_t have = *end - *p, off = *p - (const unsigned char *)s->buf;
    if (have) memmove(s->buf, *p, (size_t)have);
    s->base += off;
    while (have < k && !s->eof) {
        Py_ssize_t want = k - have > CHUNK ? k - have : CHUNK;
        if (have + want > s->buf_cap) {
            char *b = PyMem_RawRealloc(s->buf, (size_t)(have + want));
            if (!b) { PyErr_NoMemory(); return -1; }
            s->buf = b;
            s->buf_cap = have + want;
        }
        PyObject *chunk = PyObject_CallFunction(s->read, "n", want);
        if (!chunk) return -1;
        if (!PyBytes_Check(chunk)) { Py_DECREF(chunk); PyErr_SetString(PyExc_TypeError, "read() must return bytes"); return -1; }
        Py_ssize_t got = PyBytes_GET_SIZE(chunk);
        if (got > want) got = want;
        memcpy(s->buf + have, PyBytes_AS_STRING(chunk), (size_t)got);
        Py_DECREF(chunk);
        if (!got) s->eof = 1;
        have += got;
        if (PyErr_CheckSignals()) return -1;  /* Ctrl-C stops a long read */
    }
    *p = (const unsigned char *)s->buf;
    *end = *p + have;
    return have < k;
}

/* The buffer as a bytearray (writable, for numpy), freed at once: only one buffer is ever held twice. */
static PyObject *take(Buf *b) {
    PyObject *out = PyByteArray_FromStringAndSize(b->p ? b->p : "", b->n * b->size);
    PyMem_RawFree(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
    return out;
}

#define NEED(k) do { if (end - p < (Py_ssize_t)(k)) { int r_ = refill(&s, &p, &end, (Py_ssize_t)(k)); \
    if (r_ < 0) { goto error; } \
    if (r_) { s.err = "truncated"; goto fail; } } } while (0)
#define OFF(q) (s.base + ((const char *)(q) - s.buf))
#define TOP(k) do { if (s.stack.n - (s.marks.n ? AT(s.marks, Py_ssize_t, s.marks.n - 1) : 0) < (k)) { \
    s.err = "stack underflow"; goto fail; } } while (0)
#define TRY(x) do { if ((x) < 0) goto fail_or_error; } while (0)

static void release(S *s) {
    Buf *all[] = {&s->stack, &s->marks, &s->nkind, &s->nfirst, &s->nlast, &s->ncount, &s->eparent,
                  &s->ekey, &s->ekind, &s->eval, &s->field_of, &s->present, &s->pend, &s->act_code, &s->act_sid,
                  &s->df_row,
                  &s->df_kind, &s->df_val, &s->dlists, &s->order, &s->pframes, &s->plists, &s->pfids, &s->f_name,
                  &s->f_file, &s->f_line, &s->f_table, &s->s_off, &s->s_fids, &s->s_hash, &s->s_table,
                  &s->node_mark, &s->sc_table, &s->sc_off, &s->sc_len, &s->sc_sid, &s->sc_hash, &s->arena,
                  &s->role, &s->fz, &s->am_key, &s->am_dev, &s->am_state, &s->am_table, &s->fu_dl, &s->fu_col,
                  &s->fu_id, &s->w_ranges, &s->rec_um, &s->rec_t, &s->rec_pos, &s->ours};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) { PyMem_RawFree(all[i]->p); all[i]->p = NULL; }
    for (int i = 0; i < N_COLS; i++) { PyMem_RawFree(s->col[i].b.p); s->col[i].b.p = NULL; }
    PyMem_RawFree(s->buf);
    s->buf = NULL;
    memo_free(&s->memo);
    Py_CLEAR(s->strings); Py_CLEAR(s->index); Py_CLEAR(s->keys); Py_CLEAR(s->escaped);
}

static int setup(S *s, PyObject *args) {
    memset(s, 0, sizeof *s);
    long long no_time;
    PyObject *window = Py_None;
    if (!PyArg_ParseTuple(args, "OL|O", &s->read, &no_time, &window)) return -1;
    s->no_time = no_time;
    s->role.size = 1; s->am_key.size = 8; s->am_dev.size = 4; s->am_state.size = 1; s->am_table.size = 4;
    s->fz.size = 8;
    const char *rows = getenv("TRACEKIT_SCAN_COMPACT_ROWS");
    s->am_min = rows && atol(rows) > 0 ? (Py_ssize_t)atol(rows) : AM_COMPACT;
    s->am_compact_at = s->am_min;
    s->fu_dl.size = s->fu_id.size = 4; s->fu_col.size = 1; s->fu_last_dl = -1;
    s->w_ranges.size = 8; s->rec_um.size = 4; s->rec_t.size = 8; s->rec_pos.size = 8; s->ours.size = 1;
    if (window != Py_None) {  /* (first, hi, threshold or None, max size, max time[, ranges, record]) */
        PyObject *thr;
        long long first, hi, max_size, max_time;
        Py_buffer ranges = {0};
        int record = 0;
        if (!PyArg_ParseTuple(window, "LLOLL|y*p", &first, &hi, &thr, &max_size, &max_time, &ranges, &record))
            return -1;
        s->w_record = record;
        if (ranges.buf) {  /* int64 pairs */
            Py_ssize_t n = ranges.len / 8;
            int bad = grow(&s->w_ranges, n);
            if (!bad) memcpy(s->w_ranges.p, ranges.buf, (size_t)n * 8);
            s->w_ranges.n = bad ? 0 : n;
            PyBuffer_Release(&ranges);
            if (bad) return -1;
        }
        s->windowed = 1;
        s->w_first = first; s->w_hi = hi; s->max_size = max_size; s->max_time = max_time;
        s->w_has_thr = thr != Py_None;
        s->w_thr = s->w_has_thr ? PyLong_AsLongLong(thr) : 0;
        if (s->w_thr == -1 && PyErr_Occurred()) return -1;
    }
    s->root = -1;
    s->stack.size = sizeof(Value); s->marks.size = sizeof(Py_ssize_t); memo_init(&s->memo);
    s->nkind.size = 1; s->nfirst.size = 4; s->nlast.size = 4; s->ncount.size = 4;
    s->eparent.size = 4; s->ekey.size = 4; s->ekind.size = 1; s->eval.size = 8;
    s->field_of.size = s->present.size = 1;
    for (int i = 0; i < N_COLS; i++) { s->col[i].b.size = COL_SIZE[i]; s->col[i].lazy = 1; }
    s->pend.size = sizeof(Row); s->act_code.size = s->act_sid.size = 4;
    s->df_row.size = 4; s->df_kind.size = 1; s->df_val.size = 8;
    s->dlists.size = sizeof(DList); s->order.size = 4;
    s->pframes.size = sizeof(PFrame); s->plists.size = sizeof(PList); s->pfids.size = 4;
    s->f_name.size = s->f_file.size = s->f_table.size = 4; s->f_line.size = 8;
    s->s_off.size = 8; s->s_fids.size = 4; s->s_hash.size = 8; s->s_table.size = 4; s->node_mark.size = 4;
    s->sc_table.size = s->sc_len.size = s->sc_sid.size = 4; s->sc_off.size = s->sc_hash.size = 8; s->arena.size = 1;
    s->strings = PyList_New(0); s->index = PyDict_New(); s->keys = PyList_New(0); s->escaped = PyDict_New();
    if (!s->strings || !s->index || !s->keys || !s->escaped) return -1;
    return 0;
}

/* APPENDS or SETITEMS: the items since the last MARK into the container below it. */
static int batch(S *s, int dict) {
    if (!s->marks.n) return refuse(s, "no MARK");
    Py_ssize_t m = AT(s->marks, Py_ssize_t, --s->marks.n), n = s->stack.n - m;
    if (m < 1 || (dict && n % 2)) return refuse(s, "a malformed APPENDS/SETITEMS");
    Value c = AT(s->stack, Value, m - 1);
    for (Py_ssize_t i = 0; i < n; i += (dict ? 2 : 1)) {
        Value *v = &AT(s->stack, Value, m + i);
        if ((dict ? set_item(s, c, m - 1, v[0], v[1]) : append_item(s, c, v[0])) < 0) return -1;
    }
    s->stack.n = m;
    return 0;
}

/* The result: checks that the entries, frames and lists were all used as a snapshot uses them, then the
 * columns and the tape (NULL with an exception, or with s->err set). */
static PyObject *finish(S *s, Value top) {
    if (top.kind != K_DICT) return refuse(s, "the top level is not a dict"), NULL;
    if (s->olist_made && !(s->dt_set && s->root == top.val))
        return refuse(s, "device traces outside the top level"), NULL;
    if (s->appended != s->pend_base + s->pend.n) return refuse(s, "a trace entry outside its device trace"), NULL;
    if (s->open_frames || s->open_lists) return refuse(s, "a frame or frames list left unused"), NULL;
    for (Py_ssize_t i = 0; i < s->dlists.n; i++)
        if (AT(s->dlists, DList, i).count && !AT(s->dlists, DList, i).appended)
            return refuse(s, "a device trace outside 'device_traces'"), NULL;
    PyObject *devices = s->olist_made ? PyList_New(0) : Py_NewRef(Py_None);
    if (!devices) return NULL;
    for (Py_ssize_t i = 0; i < s->order.n; i++) {
        DList *d = &AT(s->dlists, DList, AT(s->order, int32_t, i));
        PyObject *t = Py_BuildValue("(nn)", d->first, d->count);
        if (!t || PyList_Append(devices, t)) { Py_XDECREF(t); Py_DECREF(devices); return NULL; }
        Py_DECREF(t);
    }
    PyMem_RawFree(s->stack.p); PyMem_RawFree(s->buf);
    s->stack.p = s->buf = NULL;
    memo_free(&s->memo);
    PyMem_RawFree(s->pend.p);
    s->pend.p = NULL;
    Buf *outs[] = {&s->nkind, &s->nfirst, &s->nlast, &s->ncount, &s->eparent, &s->ekey, &s->ekind, &s->eval,
                   NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,  /* the columns */
                   &s->df_row, &s->df_kind, &s->df_val, &s->present, &s->f_file, &s->f_line,
                   &s->f_name, &s->s_off, &s->s_fids};
    enum { NO = sizeof outs / sizeof *outs };
    PyObject *folds = s->windowed ? window_result(s) : Py_NewRef(Py_None);
    if (!folds) { Py_DECREF(devices); return NULL; }
    PyObject *tuple = PyTuple_New(NO + 17);
    if (!tuple) { Py_DECREF(folds); Py_DECREF(devices); return NULL; }
    PyTuple_SET_ITEM(tuple, NO + 5, folds);
    PyTuple_SET_ITEM(tuple, NO + 6, take(&s->am_dev));
    PyTuple_SET_ITEM(tuple, NO + 7, take(&s->am_key));
    PyTuple_SET_ITEM(tuple, NO + 8, take(&s->fu_dl));
    PyTuple_SET_ITEM(tuple, NO + 9, take(&s->fu_col));
    PyTuple_SET_ITEM(tuple, NO + 10, take(&s->fu_id));
    PyTuple_SET_ITEM(tuple, NO + 11, take(&s->rec_um));
    PyTuple_SET_ITEM(tuple, NO + 12, take(&s->rec_t));
    PyTuple_SET_ITEM(tuple, NO + 13, take(&s->rec_pos));
    PyTuple_SET_ITEM(tuple, NO + 14, PyLong_FromSsize_t(s->nrows));
    PyTuple_SET_ITEM(tuple, NO + 15, take(&s->act_sid));
    PyTuple_SET_ITEM(tuple, NO + 16, PyLong_FromSsize_t(s->col[C_ACTION].b.size));
    PyTuple_SET_ITEM(tuple, 0, PyLong_FromLong(top.kind));
    PyTuple_SET_ITEM(tuple, 1, PyLong_FromLongLong(top.val));
    PyTuple_SET_ITEM(tuple, 2, Py_NewRef(s->strings));
    PyTuple_SET_ITEM(tuple, 3, Py_NewRef(s->keys));
    PyTuple_SET_ITEM(tuple, 4, devices);
    int ok = 1;
    for (int i = NO + 6; i < NO + 17; i++) ok &= PyTuple_GET_ITEM(tuple, i) != NULL;
    for (int i = 0; i < NO; i++) {
        PyObject *b = outs[i] ? take(outs[i]) : take_col(&s->col[i - 8]);
        ok &= b != NULL;
        PyTuple_SET_ITEM(tuple, 5 + i, b ? b : Py_NewRef(Py_None));
    }
    if (!ok) { Py_DECREF(tuple); return NULL; }
    return tuple;
}

/* The error of a failed scan: ValueError("unsupported: ...") for a refusal, else the exception raised. */
static PyObject *failed(S *s) {
    if (!PyErr_Occurred()) {
        if (s->err) PyErr_Format(PyExc_ValueError, "unsupported: %s", s->err);
        else PyErr_NoMemory();
    }
    release(s);
    return NULL;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    S s;
    if (setup(&s, args)) return failed(&s);
    Value top = {0, 0};
    const unsigned char *p = NULL, *end = NULL;

    int64_t frame_end = -1;  /* once framed, every opcode lies inside a frame, back to back */
    for (;;) {
        NEED(1);
        if (frame_end >= 0 && (OFF(p) > frame_end || (OFF(p) == frame_end && *p != 0x95))) {
            s.err = "an opcode outside its frame";
            goto fail;
        }
        unsigned char op = *p++;
        switch (op) {
        case 0x80: NEED(1); if (*p > 5) { s.err = "a pickle protocol above 5"; goto fail; } p++; break;  /* PROTO */
        case 0x95: {  /* FRAME: a frame may start only where the previous one ended */
            NEED(8);
            uint64_t n;
            memcpy(&n, p, 8);
            p += 8;
            if ((frame_end >= 0 && OFF(p) - 9 != frame_end) || n > ((uint64_t)1 << 62)) { s.err = "a bad frame"; goto fail; }
            frame_end = OFF(p) + (int64_t)n;
            break;
        }
        case '.':  /* STOP */
            if (s.stack.n != 1 || s.marks.n) { s.err = "a stack not holding one object at STOP"; goto fail; }
            if (frame_end >= 0 && OFF(p) != frame_end) { s.err = "STOP not at the end of its frame"; goto fail; }
            top = AT(s.stack, Value, 0);
            goto done;
        case '(': if (APPEND(s.marks, Py_ssize_t, s.stack.n)) goto error; break;  /* MARK */
        case '}': TRY(new_dict(&s)); break;
        case ']': TRY(new_list(&s)); break;
        case ')': TRY(new_node(&s, K_TUPLE)); break;
        case 'N': TRY(push(&s, K_NONE, 0)); break;
        case 0x88: TRY(push(&s, K_TRUE, 1)); break;
        case 0x89: TRY(push(&s, K_FALSE, 0)); break;
        case 'J': { NEED(4); int32_t v; memcpy(&v, p, 4); p += 4; TRY(push(&s, K_INT, v)); break; }  /* BININT (LE) */
        case 'K': NEED(1); TRY(push(&s, K_INT, p[0])); p += 1; break;
        case 'M': NEED(2); TRY(push(&s, K_INT, p[0] | (p[1] << 8))); p += 2; break;
        case 0x8a: {  /* LONG1: little-endian two's complement, at most 8 bytes here */
            NEED(1);
            unsigned n = *p++;
            if (n > 8) { s.err = "an integer beyond 64 bits"; goto fail; }
            NEED(n);
            uint64_t u = 0;
            for (unsigned i = 0; i < n; i++) u |= (uint64_t)p[i] << (8 * i);
            if (n && n < 8 && (p[n - 1] & 0x80)) u |= ~(uint64_t)0 << (8 * n);
            p += n;
            TRY(push(&s, K_INT, (int64_t)u));
            break;
        }
        case 'G': {  /* BINFLOAT: big-endian double, kept as its bits */
            NEED(8);
            uint64_t u = 0;
            for (int i = 0; i < 8; i++) u = (u << 8) | p[i];
            p += 8;
            TRY(push(&s, K_FLOAT, (int64_t)u));
            break;
        }
        case 0x8c: case 'X': case 0x8d: {  /* SHORT_BINUNICODE, BINUNICODE, BINUNICODE8 */
            uint64_t n;
            if (op == 0x8c) { NEED(1); n = *p++; }
            else if (op == 'X') { NEED(4); uint32_t v; memcpy(&v, p, 4); p += 4; n = v; }
            else { NEED(8); memcpy(&n, p, 8); p += 8; }
            if (n > ((uint64_t)1 << 40)) { s.err = "truncated"; goto fail; }
            NEED(n);
            TRY(string(&s, (const char *)p, (Py_ssize_t)n));
            p += n;
            break;
        }
        case 0x94: case 'q': case 'r': {  /* MEMOIZE, BINPUT, LONG_BINPUT: indices must be sequential */
            Py_ssize_t i = s.memo.n;
            if (op == 'q') { NEED(1); i = p[0]; p += 1; }
            if (op == 'r') { NEED(4); uint32_t v; memcpy(&v, p, 4); i = v; p += 4; }
            TOP(1);
            if (i > s.memo.n) { s.err = "a memo index out of sequence"; goto fail; }
            Value v = AT(s.stack, Value, s.stack.n - 1);
            if (v.kind == K_INT || v.kind == K_FLOAT) { s.err = "a memoized number"; goto fail; }
            if (v.val < 0 || v.val >= LIMIT) { s.err = "an id out of range"; goto fail; }
            if (v.kind == K_FRAME_OPEN || v.kind == K_FLIST) {  /* remembered, to be set to the finished value */
                Py_ssize_t *m = v.kind == K_FRAME_OPEN ? &AT(s.pframes, PFrame, v.val).memo
                                                       : &AT(s.plists, PList, v.val).memo;
                if (*m >= 0 || i < s.memo.n) { s.err = "a frame or frames list memoized twice"; goto fail; }
                *m = i;
            }
            TRY(memo_set(&s, i, v.kind, v.val));
            break;
        }
        case 'h': case 'j': {  /* BINGET, LONG_BINGET */
            Py_ssize_t i;
            if (op == 'h') { NEED(1); i = p[0]; p += 1; } else { NEED(4); uint32_t v; memcpy(&v, p, 4); i = v; p += 4; }
            if (i >= s.memo.n) { s.err = "a memo index never set"; goto fail; }
            uint32_t m = memo_get(&s.memo, i);
            /* never in a snapshot, and the memo keeps no entry's row: the Python reader reads such a file */
            if ((m >> 28) == K_ENTRY) { s.err = "a trace entry used twice"; goto fail; }
            TRY(push(&s, (uint8_t)(m >> 28), m & 0x0fffffff));
            break;
        }
        case 'a': case 's': {  /* APPEND, SETITEM */
            Py_ssize_t k = op == 'a' ? 2 : 3;
            TOP(k);
            Py_ssize_t c = s.stack.n - k;
            Value *v = &AT(s.stack, Value, c);
            TRY(op == 'a' ? append_item(&s, v[0], v[1]) : set_item(&s, v[0], c, v[1], v[2]));
            s.stack.n -= k - 1;
            break;
        }
        case 'e': case 'u': TRY(batch(&s, op == 'u')); break;  /* APPENDS, SETITEMS */
        case 't': {  /* TUPLE: the items since the last MARK */
            if (!s.marks.n) { s.err = "no MARK"; goto fail; }
            Py_ssize_t m = AT(s.marks, Py_ssize_t, --s.marks.n), n = s.stack.n - m;
            TRY(new_node(&s, K_TUPLE));
            Value t = AT(s.stack, Value, s.stack.n - 1);
            for (Py_ssize_t i = 0; i < n; i++) TRY(edge(&s, t.val, NO_KEY, AT(s.stack, Value, m + i)));
            s.stack.n = m;
            TRY(push(&s, K_TUPLE, t.val));
            break;
        }
        case 0x85: case 0x86: case 0x87: {  /* TUPLE1..3 */
            Py_ssize_t n = op - 0x84;
            TOP(n);
            Py_ssize_t m = s.stack.n - n;
            TRY(new_node(&s, K_TUPLE));
            Value t = AT(s.stack, Value, s.stack.n - 1);
            for (Py_ssize_t i = 0; i < n; i++) TRY(edge(&s, t.val, NO_KEY, AT(s.stack, Value, m + i)));
            s.stack.n = m;
            TRY(push(&s, K_TUPLE, t.val));
            break;
        }
        default:
            s.err = "an opcode a plain-data snapshot does not use";
            goto fail;
        }
    }
done:
    {
        PyObject *result = finish(&s, top);
        if (!result) return failed(&s);
        release(&s);
        return result;
    }
fail_or_error:
fail:
error:
    return failed(&s);
}

/* -- JSON ------------------------------------------------------------------------------------------ */

/* The same machine driven by JSON's tokens: '{' and '[' make a container and a MARK, a closing bracket
 * is SETITEMS or APPENDS (every 1024 items too, as pickle batches them). Anything json.loads would
 * not read the same (NaN, numbers beyond 64 bits, invalid UTF-8, deep nesting) is refused. */

/* A cache of the ids of short raw strings, so each distinct one is decoded once (JSON has no memo). */
static uint64_t raw_hash(const char *p, Py_ssize_t n) {
    uint64_t h = 0xcbf29ce484222325ull ^ (uint64_t)n;
    for (Py_ssize_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 0x100000001B3ull;
    return mix(h);
}
static uint64_t cached_hash(S *s, int32_t i) { return AT(s->sc_hash, uint64_t, i); }

static int32_t *cache_slot(S *s, const char *p, Py_ssize_t n, uint64_t h) {
    Py_ssize_t mask = s->sc_table.n - 1;
    int32_t *t = (int32_t *)s->sc_table.p;
    for (uint64_t k = h & mask;; k = (k + 1) & mask) {
        int32_t i = t[k] - 1;
        if (i < 0 || (AT(s->sc_hash, uint64_t, i) == h && AT(s->sc_len, int32_t, i) == n &&
                      !memcmp(&AT(s->arena, char, AT(s->sc_off, int64_t, i)), p, (size_t)n)))
            return &t[k];
    }
}

static int cache_put(S *s, const char *p, Py_ssize_t n, uint64_t h, Py_ssize_t sid) {
    if (n > 512 || s->sc_hash.n >= 1 << 20) return 0;  /* only short strings, and not without bound */
    Py_ssize_t i = s->sc_hash.n;
    if ((i + 1) * 2 > s->sc_table.n && rehash(s, &s->sc_table, i, cached_hash)) return -1;
    int32_t *slot = cache_slot(s, p, n, h);
    if (grow(&s->arena, n)) return -1;
    memcpy(&AT(s->arena, char, s->arena.n), p, (size_t)n);
    if (APPEND(s->sc_off, int64_t, s->arena.n) || APPEND(s->sc_len, int32_t, (int32_t)n) ||
        APPEND(s->sc_sid, int32_t, (int32_t)sid) || APPEND(s->sc_hash, uint64_t, h))
        return -1;
    s->arena.n += n;
    *slot = (int32_t)i + 1;
    return 0;
}

static PyObject *scanstring;  /* json.decoder.scanstring: strings with escapes, exactly as json.loads */

static int json_escaped(S *s, const char *p, Py_ssize_t n) {  /* p[0:n]: the string with its quotes */
    PyObject *raw = PyBytes_FromStringAndSize(p, n);
    if (!raw) return -1;
    PyObject *id = PyDict_GetItemWithError(s->escaped, raw);
    if (id) { Py_DECREF(raw); return push(s, K_STR, PyLong_AsSsize_t(id)); }
    if (PyErr_Occurred()) { Py_DECREF(raw); return -1; }
    PyObject *u = PyUnicode_DecodeUTF8(p, n, "strict"), *r = NULL;
    if (u) r = PyObject_CallFunction(scanstring, "On", u, (Py_ssize_t)1);
    Py_XDECREF(u);
    if (!r) { Py_DECREF(raw); return -1; }
    Py_ssize_t i = intern_str(s, PyTuple_GET_ITEM(r, 0));
    Py_DECREF(r);
    PyObject *num = i >= 0 ? PyLong_FromSsize_t(i) : NULL;
    int bad = !num || PyDict_SetItem(s->escaped, raw, num);
    Py_XDECREF(num);
    Py_DECREF(raw);
    return bad ? -1 : push(s, K_STR, i);
}

enum { J_VALUE, J_VALUE_OR_CLOSE, J_KEY, J_KEY_OR_CLOSE, J_COLON, J_AFTER, J_END };
#define MAX_NESTING 10000

static PyObject *scan_json(PyObject *self, PyObject *args) {
    S s;
    if (setup(&s, args)) return failed(&s);
    s.json = 1;
    if (!scanstring) {
        PyObject *m = PyImport_ImportModule("json.decoder");
        scanstring = m ? PyObject_GetAttrString(m, "scanstring") : NULL;
        Py_XDECREF(m);
        if (!scanstring) return failed(&s);
    }
    const unsigned char *p = NULL, *end = NULL;
    Buf ctx = {NULL, 0, 0, 1};
    int state = J_VALUE, r;
    r = refill(&s, &p, &end, 3);
    if (r < 0) goto error;
    if (end - p >= 3 && !memcmp(p, "\xef\xbb\xbf", 3)) p += 3;  /* a byte-order mark */
    for (;;) {
        r = 0;
        for (;;) {  /* whitespace */
            if (p == end && (r = refill(&s, &p, &end, 1))) break;
            if (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++; else break;
        }
        if (r < 0) goto error;
        if (r) { if (state == J_END) break; s.err = "truncated"; goto fail; }
        unsigned char c = *p;
        if (state == J_END) { s.err = "data after the JSON value"; goto fail; }
        if (state == J_COLON) {
            if (c != ':') { s.err = "a malformed object"; goto fail; }
            p++; state = J_VALUE; continue;
        }
        int close = 0;
        if (state == J_AFTER) {
            uint8_t top = AT(ctx, uint8_t, ctx.n - 1);
            if (c == ',') { p++; state = top == '{' ? J_KEY : J_VALUE; continue; }
            if (c != (top == '{' ? '}' : ']')) { s.err = "a malformed container"; goto fail; }
            close = 1;
        }
        if ((state == J_KEY_OR_CLOSE && c == '}') || (state == J_VALUE_OR_CLOSE && c == ']')) close = 1;
        if (close) {
            p++;
            if (batch(&s, c == '}') < 0) goto fail_or_error;
            ctx.n--;
        } else if ((state == J_KEY || state == J_KEY_OR_CLOSE) && c != '"') {
            s.err = "an object key that is not a string"; goto fail;
        } else if (c == '{' || c == '[') {
            p++;
            if (ctx.n >= MAX_NESTING) { s.err = "nested too deeply"; goto fail; }
            if ((c == '{' ? new_dict(&s) : new_list(&s)) < 0) goto fail_or_error;
            if (APPEND(s.marks, Py_ssize_t, s.stack.n) || APPEND(ctx, uint8_t, c)) goto error;
            state = c == '{' ? J_KEY_OR_CLOSE : J_VALUE_OR_CLOSE;
            continue;
        } else if (c == '"') {
            Py_ssize_t i = 1;
            int esc = 0;
            for (;;) {
                if (p + i >= end) {
                    r = refill(&s, &p, &end, i + 1);
                    if (r < 0) goto error;
                    if (r) { s.err = "truncated"; goto fail; }
                }
                unsigned char d = p[i];
                if (d == '"') break;
                if (d < 0x20) { s.err = "a control character in a string"; goto fail; }
                if (d == '\\') { esc = 1; i++; }
                i++;
            }
            uint64_t h = raw_hash((const char *)p, i + 1);
            int32_t *hit = s.sc_table.n ? cache_slot(&s, (const char *)p, i + 1, h) : NULL;
            if (hit && *hit) {
                if (push(&s, K_STR, AT(s.sc_sid, int32_t, *hit - 1)) < 0) goto error;
            } else {
                if ((esc ? json_escaped(&s, (const char *)p, i + 1) : string(&s, (const char *)p + 1, i - 1)) < 0)
                    goto fail_or_error;
                if (cache_put(&s, (const char *)p, i + 1, h, AT(s.stack, Value, s.stack.n - 1).val) < 0) goto error;
            }
            p += i + 1;
            if (state == J_KEY || state == J_KEY_OR_CLOSE) { state = J_COLON; continue; }
        } else if (c == 't' || c == 'f' || c == 'n') {
            const char *word = c == 't' ? "true" : c == 'f' ? "false" : "null";
            Py_ssize_t k = (Py_ssize_t)strlen(word);
            if ((r = end - p < k ? refill(&s, &p, &end, k) : 0) < 0) goto error;
            if (r || memcmp(p, word, (size_t)k)) { s.err = "an unknown literal"; goto fail; }
            p += k;
            if (push(&s, c == 't' ? K_TRUE : c == 'f' ? K_FALSE : K_NONE, c == 't') < 0) goto error;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            if ((r = end - p < 64 ? refill(&s, &p, &end, 64) : 0) < 0) goto error;
            Py_ssize_t i = c == '-', avail = end - p;
            uint64_t u = 0;
            int digits = 0, flt = 0, big = 0;
            while (i < avail && p[i] >= '0' && p[i] <= '9') {
                if (u > (UINT64_MAX - 9) / 10) big = 1;
                u = u * 10 + (p[i] - '0');
                i++; digits++;
            }
            if (!digits || (digits > 1 && p[c == '-'] == '0')) { s.err = "a malformed number"; goto fail; }
            if (i < avail && p[i] == '.') {
                flt = 1; i++;
                Py_ssize_t d0 = i;
                while (i < avail && p[i] >= '0' && p[i] <= '9') i++;
                if (i == d0) { s.err = "a malformed number"; goto fail; }
            }
            if (i < avail && (p[i] == 'e' || p[i] == 'E')) {
                flt = 1; i++;
                if (i < avail && (p[i] == '+' || p[i] == '-')) i++;
                Py_ssize_t d0 = i;
                while (i < avail && p[i] >= '0' && p[i] <= '9') i++;
                if (i == d0) { s.err = "a malformed number"; goto fail; }
            }
            if (i >= 63) { s.err = "a number too long"; goto fail; }
            if (flt) {
                char tmp[64];
                memcpy(tmp, p, (size_t)i);
                tmp[i] = 0;
                double v = PyOS_string_to_double(tmp, NULL, NULL);
                if (v == -1.0 && PyErr_Occurred()) goto error;
                int64_t bits;
                memcpy(&bits, &v, 8);
                if (push(&s, K_FLOAT, bits) < 0) goto error;
            } else {
                if (big || u > (c == '-' ? (uint64_t)1 << 63 : (uint64_t)INT64_MAX)) {
                    s.err = "an integer beyond 64 bits"; goto fail;
                }
                if (push(&s, K_INT, c == '-' ? (int64_t)(0 - u) : (int64_t)u) < 0) goto error;
            }
            p += i;
        } else {
            s.err = "a token a plain-data snapshot does not use"; goto fail;
        }
        /* a value is complete */
        if (!ctx.n) { state = J_END; continue; }
        state = J_AFTER;
        Py_ssize_t since = s.stack.n - top_mark(&s);
        if (since >= 1024 && (AT(ctx, uint8_t, ctx.n - 1) == '[' || since % 2 == 0)) {  /* a batch, as pickle's */
            if (batch(&s, AT(ctx, uint8_t, ctx.n - 1) == '{') < 0) goto fail_or_error;
            if (APPEND(s.marks, Py_ssize_t, s.stack.n)) goto error;
        }
    }
    PyMem_RawFree(ctx.p);
    if (s.stack.n != 1) { s.err = "no value"; return failed(&s); }
    {
        PyObject *result = finish(&s, AT(s.stack, Value, 0));
        if (!result) return failed(&s);
        release(&s);
        return result;
    }
fail_or_error:
fail:
error:
    PyMem_RawFree(ctx.p);
    return failed(&s);
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(read, no_time) -> the columns and tape of a plain-data snapshot pickle, read with read(n) -> bytes; "
     "ValueError('unsupported: ...') otherwise"},
    {"scan_json", scan_json, METH_VARARGS,
     "scan_json(read, no_time) -> the same of a snapshot in JSON (UTF-8), or ValueError('unsupported: ...')"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pkscan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pkscan(void) {
    if (PyType_Ready(&BlockType) < 0) return NULL;
    return PyModule_Create(&module);
}
