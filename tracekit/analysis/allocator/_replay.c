/* The replay of one device's trace through the caching-allocator model (model_replay.py), compiled.
 *
 * It makes the same decisions as tracekit/analysis/allocator/model_replay.py's loop, entry for
 * entry, for files without expandable segments or private pools (the caller keeps the
 * Python loop for those): best fit over free blocks ordered by (stream, size, address),
 * the split rule, merging on free, segments from the trace's own segment entries, and the
 * same counts of entries the model could not follow. model_replay.py is the reference; the tests
 * compare the two on every fixture and on random request streams.
 *
 * replay(action, addr, size, stream,             per-entry columns (int8, uint64, int64, int64; stream may
 *                                               be one value, every entry's: a constant column is not copied out)
 *        blk_addr, blk_size, blk_stream, blk_state, blk_small, blk_seg, blk_req,
 *                                               the state at the first entry, by address (state 0 free,
 *                                               1 allocated, 2 pending; seg: start of its segment)
 *        seg_start, seg_size,                   its segments
 *        divisions (16 x int64), max_split_size, max_non_split_rounding,
 *        out_allocated, out_reserved, out_block  writable int64 buffers, one value per entry; out_reserved may
 *                                               be one value when no entry is a segment_alloc or segment_free
 *                                               (then it never changes)
 *        [stop,                                  stop after this entry (default -1: the whole trace)
 *         out_entries])                          writable int32 or int64: then out_block is sparse, the blocks
 *                                               the allocs got in order of entry, their entries here (both at
 *                                               least as long as the alloc entries; what follows stays as it is)
 * -> (placed, slack, [count per reason], allocated0, reserved0,
 *     [(addr, size, state, first block of its segment), ...] the blocks at the end)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { A_ALLOC, A_FREE_REQUESTED, A_FREE_COMPLETED, A_SEGMENT_ALLOC, A_SEGMENT_FREE, A_SEGMENT_MAP,
       A_SEGMENT_UNMAP, A_SNAPSHOT, A_OOM, A_OTHER };
enum { R_NEWSEG_CACHED, R_SEG_SIZE, R_NOT_AT_NEWSEG, R_BEST_FIT, R_NO_CACHED, R_OUTSIDE, R_SMALLER, R_TWICE,
       R_FREE_UNKNOWN, R_NO_REQUEST, R_SEG_FREE, R_OOM_CACHED, N_REASONS };

/* The allocator's constants: config.py names them; tests/test_allocator_compiled.py checks that these equal
 * them (the module exposes each as an attribute of the same name, and REASONS as the reasons' text). */
#define MIN_BLOCK 512
#define SMALL_SIZE (1LL << 20)
#define SMALL_BUFFER (2LL << 20)
#define LARGE_BUFFER (20LL << 20)
#define MIN_LARGE_ALLOC (10LL << 20)
#define ROUND_LARGE (2LL << 20)
#define POWER2_START_LOG2 20  /* roundup_power2_divisions' first interval starts at 1 MiB */
#define INTERVALS 16
#define NONE (-1)
#define EMPTY UINT64_MAX
#define F_ALLOCATED 1
#define F_PENDING 2
#define F_PHANTOM 4

typedef struct {
    uint64_t addr, seg;
    int64_t size, stream;
    int32_t prev, next;
    uint8_t small, flags;
} Blk;

typedef struct { int64_t stream, size; uint64_t addr; } Key;
typedef struct { Key *k; Py_ssize_t n, cap; } Pool;
typedef struct { uint64_t *keys; int32_t *vals; size_t cap, n; } Map;
typedef struct { uint64_t start; int64_t size; } Seg;
typedef struct { int64_t stream; uint64_t addr; int64_t size; } Fresh;

typedef struct {
    Blk *b; int32_t nb, capb; int32_t *freeslots; int32_t nfree, capfree;
    Map blocks, live;
    Pool pool[2];  /* [0] large, [1] small */
    Seg *segs; Py_ssize_t nsegs, capsegs;
    Fresh *fresh; Py_ssize_t nfresh, capfresh;
    int64_t allocated, reserved;
    int64_t div[INTERVALS];
    uint64_t mss;
    int64_t rounding;
    int oom;
} St;

/* ---- memory helpers ---------------------------------------------------------------------------- */

static int reserve(void **p, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    if (need <= *cap) return 0;
    Py_ssize_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = PyMem_RawRealloc(*p, (size_t)c * item);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

static uint64_t mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static int map_init(Map *m, size_t cap) {
    m->cap = 64;
    while (m->cap < cap * 2) m->cap *= 2;
    m->n = 0;
    m->keys = PyMem_RawMalloc(m->cap * sizeof(uint64_t));
    m->vals = PyMem_RawMalloc(m->cap * sizeof(int32_t));
    if (!m->keys || !m->vals) return -1;
    for (size_t i = 0; i < m->cap; i++) m->keys[i] = EMPTY;
    return 0;
}

static int32_t map_get(Map *m, uint64_t k) {
    size_t mask = m->cap - 1, i = mix(k) & mask;
    while (m->keys[i] != EMPTY) {
        if (m->keys[i] == k) return m->vals[i];
        i = (i + 1) & mask;
    }
    return NONE;
}

static int map_put(Map *m, uint64_t k, int32_t v);

static int map_grow(Map *m) {
    uint64_t *ok = m->keys;
    int32_t *ov = m->vals;
    size_t oc = m->cap;
    if (map_init(m, oc) < 0) return -1;  /* doubles: cap >= 2 * oc */
    for (size_t i = 0; i < oc; i++)
        if (ok[i] != EMPTY) map_put(m, ok[i], ov[i]);
    PyMem_RawFree(ok);
    PyMem_RawFree(ov);
    return 0;
}

static int map_put(Map *m, uint64_t k, int32_t v) {
    if ((m->n + 1) * 2 > m->cap && map_grow(m) < 0) return -1;
    size_t mask = m->cap - 1, i = mix(k) & mask;
    while (m->keys[i] != EMPTY) {
        if (m->keys[i] == k) { m->vals[i] = v; return 0; }
        i = (i + 1) & mask;
    }
    m->keys[i] = k;
    m->vals[i] = v;
    m->n++;
    return 0;
}

static void map_del(Map *m, uint64_t k) {
    size_t mask = m->cap - 1, i = mix(k) & mask;
    while (m->keys[i] != EMPTY) {
        if (m->keys[i] == k) break;
        i = (i + 1) & mask;
    }
    if (m->keys[i] == EMPTY) return;
    m->keys[i] = EMPTY;
    m->n--;
    size_t j = i;
    for (;;) {  /* backward-shift deletion keeps every probe chain unbroken */
        j = (j + 1) & mask;
        if (m->keys[j] == EMPTY) return;
        size_t h = mix(m->keys[j]) & mask;
        if ((j > i && (h <= i || h > j)) || (j < i && (h <= i && h > j))) {
            m->keys[i] = m->keys[j];
            m->vals[i] = m->vals[j];
            m->keys[j] = EMPTY;
            i = j;
        }
    }
}

/* The value slot of key k, made (holding NONE) when k is not there yet: one probe where a map_get and a
 * map_put take two. NULL when out of memory. The pointer holds until the next insertion. */
static int32_t *map_slot(Map *m, uint64_t k) {
    if ((m->n + 1) * 2 > m->cap && map_grow(m) < 0) return NULL;
    size_t mask = m->cap - 1, i = mix(k) & mask;
    while (m->keys[i] != EMPTY) {
        if (m->keys[i] == k) return &m->vals[i];
        i = (i + 1) & mask;
    }
    m->keys[i] = k;
    m->vals[i] = NONE;
    m->n++;
    return &m->vals[i];
}

static int32_t new_blk(St *s) {
    if (s->nfree) return s->freeslots[--s->nfree];
    if (s->nb == s->capb) {
        int32_t c = s->capb ? s->capb * 2 : 256;
        Blk *q = PyMem_RawRealloc(s->b, (size_t)c * sizeof(Blk));
        if (!q) return NONE;
        s->b = q;
        s->capb = c;
    }
    return s->nb++;
}

static int drop_blk(St *s, int32_t i) {
    if (s->nfree == s->capfree) {
        int32_t c = s->capfree ? s->capfree * 2 : 256;
        int32_t *q = PyMem_RawRealloc(s->freeslots, (size_t)c * sizeof(int32_t));
        if (!q) return -1;
        s->freeslots = q;
        s->capfree = c;
    }
    s->freeslots[s->nfree++] = i;
    return 0;
}

/* ---- pools: free blocks sorted by (stream, size, addr) ------------------------------------------ */

static int key_less(const Key *a, int64_t stream, int64_t size, uint64_t addr, int below) {
    if (a->stream != stream) return a->stream < stream;
    if (a->size != size) return a->size < size;
    if (below) return 0;  /* the search key's address is below every address */
    return a->addr < addr;
}

static Py_ssize_t lower(Pool *p, int64_t stream, int64_t size, uint64_t addr, int below) {
    Py_ssize_t lo = 0, hi = p->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (key_less(&p->k[mid], stream, size, addr, below)) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static int pool_insert(St *s, int32_t bi) {
    Blk *b = &s->b[bi];
    Pool *p = &s->pool[b->small];
    if (reserve((void **)&p->k, &p->cap, p->n + 1, sizeof(Key)) < 0) return -1;
    Py_ssize_t i = lower(p, b->stream, b->size, b->addr, 0);
    memmove(&p->k[i + 1], &p->k[i], (size_t)(p->n - i) * sizeof(Key));
    p->k[i].stream = b->stream;
    p->k[i].size = b->size;
    p->k[i].addr = b->addr;
    p->n++;
    return 0;
}

static int pool_remove(St *s, int32_t bi) {
    Blk *b = &s->b[bi];
    Pool *p = &s->pool[b->small];
    Py_ssize_t i = lower(p, b->stream, b->size, b->addr, 0);
    if (i < p->n && p->k[i].stream == b->stream && p->k[i].size == b->size && p->k[i].addr == b->addr) {
        memmove(&p->k[i], &p->k[i + 1], (size_t)(p->n - i - 1) * sizeof(Key));
        p->n--;
        return 1;
    }
    return 0;
}

/* ---- the allocator's rules ------------------------------------------------------------------------ */

static int64_t round_size(St *s, int64_t size) {
    if (size < MIN_BLOCK) return MIN_BLOCK;
    int log = 63 - __builtin_clzll((unsigned long long)size);
    int idx = log - POWER2_START_LOG2;
    if (idx < 0) idx = 0;
    if (idx > INTERVALS - 1) idx = INTERVALS - 1;
    int64_t div = s->div[idx];
    if (div > 1 && size > MIN_BLOCK * div) {
        if ((size & (size - 1)) == 0) return size;
        int64_t floor = (int64_t)1 << log;
        int64_t step = floor >> (63 - __builtin_clzll((unsigned long long)div));
        if (step == 0) return floor << 1;
        int64_t low = size & ~(step - 1);
        return low == size ? size : low + step;
    }
    return (size + MIN_BLOCK - 1) / MIN_BLOCK * MIN_BLOCK;
}

static int64_t allocation_size(int64_t size) {
    if (size <= SMALL_SIZE) return SMALL_BUFFER;
    if (size < MIN_LARGE_ALLOC) return LARGE_BUFFER;
    return (size + ROUND_LARGE - 1) / ROUND_LARGE * ROUND_LARGE;
}

static int is_free(Blk *b) { return !(b->flags & (F_ALLOCATED | F_PENDING)); }

/* get_free_block without taking: the index in the pool, or NONE */
static Py_ssize_t find_free(St *s, int small, int64_t size, int64_t stream) {
    Pool *p = &s->pool[small];
    Py_ssize_t i = lower(p, stream, size, 0, 1);
    if (i == p->n || p->k[i].stream != stream) return NONE;
    int64_t bsize = p->k[i].size;
    if ((uint64_t)size < s->mss && (uint64_t)bsize >= s->mss) return NONE;
    if ((uint64_t)size >= s->mss && bsize >= size + s->rounding) return NONE;
    return i;
}

static int cache(St *s, int32_t bi) {
    Blk *b = &s->b[bi];
    int32_t pi = b->prev;
    if (pi != NONE && is_free(&s->b[pi])) {
        Blk *p = &s->b[pi];
        pool_remove(s, pi);
        map_del(&s->blocks, b->addr);
        b->addr = p->addr;
        b->size += p->size;
        b->prev = p->prev;
        if (p->prev != NONE) s->b[p->prev].next = bi;
        if (map_put(&s->blocks, b->addr, bi) < 0 || drop_blk(s, pi) < 0) return -1;
    }
    int32_t ni = b->next;
    if (ni != NONE && is_free(&s->b[ni])) {
        Blk *n = &s->b[ni];
        pool_remove(s, ni);
        map_del(&s->blocks, n->addr);
        b->size += n->size;
        b->next = n->next;
        if (n->next != NONE) s->b[n->next].prev = bi;
        if (drop_blk(s, ni) < 0) return -1;
    }
    return pool_insert(s, bi);
}

static int take(St *s, int32_t bi, int64_t size) {
    Blk *b = &s->b[bi];
    int64_t remaining = b->size - size;
    int split = b->small ? remaining >= MIN_BLOCK : ((uint64_t)size < s->mss && remaining > SMALL_SIZE);
    if (split) {
        int32_t ri = new_blk(s);
        if (ri == NONE) return -1;
        b = &s->b[bi];
        Blk *r = &s->b[ri];
        r->addr = b->addr + (uint64_t)size;
        r->size = remaining;
        r->stream = b->stream;
        r->small = b->small;
        r->seg = b->seg;
        r->flags = 0;
        r->prev = bi;
        r->next = b->next;
        if (b->next != NONE) s->b[b->next].prev = ri;
        b->next = ri;
        b->size = size;
        if (map_put(&s->blocks, r->addr, ri) < 0 || pool_insert(s, ri) < 0) return -1;
    }
    s->b[bi].flags = F_ALLOCATED;
    s->allocated += s->b[bi].size;
    return 0;
}

static Py_ssize_t seg_find(St *s, uint64_t start) {
    Py_ssize_t lo = 0, hi = s->nsegs;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (s->segs[mid].start < start) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static int seg_add(St *s, uint64_t start, int64_t size) {
    Py_ssize_t i = seg_find(s, start);
    if (i < s->nsegs && s->segs[i].start == start) { s->segs[i].size = size; return 0; }
    if (reserve((void **)&s->segs, &s->capsegs, s->nsegs + 1, sizeof(Seg)) < 0) return -1;
    memmove(&s->segs[i + 1], &s->segs[i], (size_t)(s->nsegs - i) * sizeof(Seg));
    s->segs[i].start = start;
    s->segs[i].size = size;
    s->nsegs++;
    return 0;
}

static int64_t seg_pop(St *s, uint64_t start) {  /* -1 when absent */
    Py_ssize_t i = seg_find(s, start);
    if (i < s->nsegs && s->segs[i].start == start) {
        int64_t z = s->segs[i].size;
        memmove(&s->segs[i], &s->segs[i + 1], (size_t)(s->nsegs - i - 1) * sizeof(Seg));
        s->nsegs--;
        return z;
    }
    return -1;
}

static int seg_of(St *s, uint64_t addr, uint64_t *start) {
    Py_ssize_t i = seg_find(s, addr + 1) - 1;
    if (i >= 0 && addr < s->segs[i].start + (uint64_t)s->segs[i].size) { *start = s->segs[i].start; return 1; }
    return 0;
}

static int32_t block_at(St *s, uint64_t addr) {
    int32_t bi = map_get(&s->blocks, addr);
    if (bi != NONE) return bi;
    uint64_t start;
    if (!seg_of(s, addr, &start)) return NONE;
    bi = map_get(&s->blocks, start);
    while (bi != NONE && s->b[bi].prev != NONE) bi = s->b[bi].prev;
    while (bi != NONE && !(s->b[bi].addr <= addr && addr < s->b[bi].addr + (uint64_t)s->b[bi].size)) bi = s->b[bi].next;
    return bi;
}

static int32_t new_segment(St *s, uint64_t addr, int64_t size, int64_t stream, int small) {
    int32_t bi = new_blk(s);
    if (bi == NONE) return NONE;
    Blk *b = &s->b[bi];
    b->addr = addr; b->seg = addr; b->size = size; b->stream = stream; b->small = (uint8_t)small;
    b->prev = b->next = NONE; b->flags = 0;
    if (map_put(&s->blocks, addr, bi) < 0 || seg_add(s, addr, size) < 0) return NONE;
    return bi;
}

static int flush(St *s, int64_t stream) {
    Py_ssize_t w = 0;
    for (Py_ssize_t r = 0; r < s->nfresh; r++) {
        Fresh f = s->fresh[r];
        if (f.stream == stream) {
            int32_t bi = new_segment(s, f.addr, f.size, stream, f.size == SMALL_BUFFER);
            if (bi == NONE || pool_insert(s, bi) < 0) return -1;
        } else {
            s->fresh[w++] = f;
        }
    }
    s->nfresh = w;
    return 0;
}

static int32_t resync(St *s, uint64_t addr, int64_t size) {
    int32_t bi = block_at(s, addr);
    if (bi == NONE) return NONE;
    Blk *b = &s->b[bi];
    if (!is_free(b) || b->addr + (uint64_t)b->size < addr + (uint64_t)size) return NONE;
    pool_remove(s, bi);
    if (b->addr < addr) {
        int32_t hi = new_blk(s);
        if (hi == NONE) return -2;
        b = &s->b[bi];
        Blk *h = &s->b[hi];
        h->addr = b->addr; h->size = (int64_t)(addr - b->addr); h->stream = b->stream; h->small = b->small;
        h->seg = b->seg; h->flags = 0; h->prev = b->prev; h->next = bi;
        if (b->prev != NONE) s->b[b->prev].next = hi;
        b->prev = hi;
        map_del(&s->blocks, b->addr);
        b->size -= (int64_t)(addr - b->addr);
        b->addr = addr;
        if (map_put(&s->blocks, h->addr, hi) < 0 || map_put(&s->blocks, addr, bi) < 0 || pool_insert(s, hi) < 0)
            return -2;
    }
    return bi;
}

/* _release: 1 when the model had that segment free, 0 when it had to drop what it held there */
static int release(St *s, uint64_t addr, int64_t size) {
    int32_t bi = map_get(&s->blocks, addr);
    if (bi != NONE) {
        Blk *b = &s->b[bi];
        if (is_free(b) && b->prev == NONE && b->next == NONE && b->size == size) {
            pool_remove(s, bi);
            map_del(&s->blocks, addr);
            seg_pop(s, addr);
            s->reserved -= size;
            drop_blk(s, bi);
            return 1;
        }
    }
    uint64_t start;
    if (seg_of(s, addr, &start)) {
        int32_t c = map_get(&s->blocks, start);
        while (c != NONE) {
            Blk *b = &s->b[c];
            int32_t nxt = b->next;
            if (is_free(b)) pool_remove(s, c);
            else if (b->flags & F_ALLOCATED) { s->allocated -= b->size; b->flags &= ~F_ALLOCATED; }
            /* live entries that point at it go */
            for (size_t k = 0; k < s->live.cap; k++) {
                if (s->live.keys[k] != EMPTY && s->live.vals[k] == c) {
                    uint64_t key = s->live.keys[k];
                    map_del(&s->live, key);
                    k = (size_t)-1;  /* the table shifted: start over */
                }
            }
            if (map_get(&s->blocks, b->addr) == c) map_del(&s->blocks, b->addr);
            drop_blk(s, c);
            c = nxt;
        }
        s->reserved -= seg_pop(s, start);
    } else {
        s->reserved -= size;
    }
    return 0;
}

/* ---- buffers ----------------------------------------------------------------------------------- */

typedef struct { Py_buffer v; int have; } Buf;

static int get_buf(PyObject *o, Buf *b, Py_ssize_t item, int writable, const char *name) {
    if (PyObject_GetBuffer(o, &b->v, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0) return -1;
    b->have = 1;
    if (b->v.itemsize != item) {
        PyErr_Format(PyExc_ValueError, "%s: items of %zd bytes expected", name, item);
        return -1;
    }
    return 0;
}

#define LEN(b) ((b).v.len / (b).v.itemsize)

static PyObject *replay(PyObject *self, PyObject *args) {
    PyObject *o[20];
    unsigned long long mss;
    long long rounding;
    Py_ssize_t stop = -1;
    PyObject *oe = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOOKLOOO|nO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7],
                          &o[8], &o[9], &o[10], &o[11], &o[12], &o[13], &mss, &rounding, &o[14], &o[15], &o[16],
                          &stop, &oe))
        return NULL;
    Buf E = {0};  /* out_entries */
    static const Py_ssize_t items[17] = {1, 8, 8, 8, 8, 8, 8, 1, 1, 8, 8, 8, 8, 8, 8, 8, 8};
    static const char *names[17] = {"action", "addr", "size", "stream", "blk_addr", "blk_size", "blk_stream",
                                    "blk_state", "blk_small", "blk_seg", "blk_req", "seg_start", "seg_size",
                                    "divisions", "out_allocated", "out_reserved", "out_block"};
    Buf B[17];
    memset(B, 0, sizeof(B));
    St S;
    memset(&S, 0, sizeof(S));
    St *s = &S;
    PyObject *result = NULL;
    for (int k = 0; k < 17; k++)
        if (get_buf(o[k], &B[k], items[k], k >= 14, names[k]) < 0) goto done;
    if (oe && oe != Py_None) {
        if (PyObject_GetBuffer(oe, &E.v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
        E.have = 1;
        if (E.v.itemsize != 4 && E.v.itemsize != 8) {
            PyErr_SetString(PyExc_ValueError, "out_entries: items of 4 or 8 bytes expected");
            goto done;
        }
    }
    Py_ssize_t n = LEN(B[0]);
    if (LEN(B[1]) != n || LEN(B[2]) != n || (LEN(B[3]) != n && LEN(B[3]) != 1) || LEN(B[14]) != n
        || (LEN(B[15]) != n && LEN(B[15]) != 1)
        || (E.have ? LEN(E) != LEN(B[16]) : LEN(B[16]) != n) || LEN(B[13]) != INTERVALS) {
        PyErr_SetString(PyExc_ValueError, "column lengths differ");
        goto done;
    }
    const int8_t *action = B[0].v.buf;
    const uint64_t *addr = B[1].v.buf;
    const int64_t *size = B[2].v.buf, *stream = B[3].v.buf;
    const Py_ssize_t stream_step = LEN(B[3]) == n ? 1 : 0;  /* one value: every entry's stream */
    int64_t *out_alloc = B[14].v.buf, *out_res = B[15].v.buf, *out_blk = B[16].v.buf;
    /* out_reserved one value: written in place each time; out_block sparse (with out_entries): the k-th alloc
     * that gets a block puts it at k */
    const Py_ssize_t res_step = LEN(B[15]) == n ? 1 : 0, nblk = LEN(B[16]);
    int32_t *ent32 = E.have && E.v.itemsize == 4 ? E.v.buf : NULL;
    int64_t *ent64 = E.have && E.v.itemsize == 8 ? E.v.buf : NULL;
    Py_ssize_t kb = 0;  /* blocks put so far (sparse) */
#define PUT_BLOCK(z) do {                                                                                  \
        if (!E.have) out_blk[i] = (z);                                                                      \
        else if ((z) != 0) {                                                                                \
            if (kb >= nblk) { PyErr_SetString(PyExc_ValueError, "out_block: fewer values than allocs"); goto done; } \
            out_blk[kb] = (z);                                                                              \
            if (ent32) ent32[kb] = (int32_t)i; else ent64[kb] = i;                                          \
            kb++;                                                                                           \
        }                                                                                                   \
    } while (0)
    memcpy(s->div, B[13].v.buf, sizeof(s->div));
    s->mss = mss;
    s->rounding = rounding;
    Py_ssize_t nb = LEN(B[4]);
    if (map_init(&s->blocks, (size_t)nb + 1024) < 0 || map_init(&s->live, (size_t)nb + 1024) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    {   /* the state at the first entry */
        const uint64_t *ba = B[4].v.buf, *bseg = B[9].v.buf;
        const int64_t *bz = B[5].v.buf, *bst = B[6].v.buf;
        const int8_t *bstate = B[7].v.buf, *bsmall = B[8].v.buf;
        const uint64_t *ss = B[11].v.buf;
        const int64_t *sz = B[12].v.buf;
        for (Py_ssize_t k = 0; k < LEN(B[11]); k++) {
            if (seg_add(s, ss[k], sz[k]) < 0) { PyErr_NoMemory(); goto done; }
            s->reserved += sz[k];
        }
        int32_t prev = NONE;
        for (Py_ssize_t k = 0; k < nb; k++) {
            int32_t bi = new_blk(s);
            if (bi == NONE) { PyErr_NoMemory(); goto done; }
            Blk *b = &s->b[bi];
            b->addr = ba[k]; b->size = bz[k]; b->stream = bst[k]; b->small = (uint8_t)(bsmall[k] != 0);
            b->seg = bseg[k]; b->next = NONE;
            b->flags = bstate[k] == 1 ? F_ALLOCATED : bstate[k] == 2 ? F_PENDING : 0;
            b->prev = (prev != NONE && s->b[prev].seg == b->seg && s->b[prev].addr + (uint64_t)s->b[prev].size == b->addr)
                          ? prev : NONE;
            if (b->prev != NONE) s->b[prev].next = bi;
            if (map_put(&s->blocks, b->addr, bi) < 0) { PyErr_NoMemory(); goto done; }
            if (b->flags) {
                if (map_put(&s->live, b->addr, bi) < 0) { PyErr_NoMemory(); goto done; }
                if (b->flags & F_ALLOCATED) s->allocated += b->size;
            } else if (pool_insert(s, bi) < 0) { PyErr_NoMemory(); goto done; }
            prev = bi;
        }
    }
    int64_t allocated0 = s->allocated, reserved0 = s->reserved;
    if (stop >= 0 && stop + 1 < n) n = stop + 1;  /* the state after entry `stop` */
    long long placed = 0, slack = 0, reasons[N_REASONS] = {0};
    for (Py_ssize_t i = 0; i < n; i++) {
        int a = action[i];
        if (!E.have) out_blk[i] = 0;
        if (a == A_ALLOC) {
            uint64_t p = addr[i];
            int64_t r = size[i], st = stream[i * stream_step];
            int64_t sz = round_size(s, r);
            int small = sz <= SMALL_SIZE;
            int32_t bi = NONE;
            Py_ssize_t fk = NONE;
            for (Py_ssize_t k = 0; k < s->nfresh; k++)
                if (s->fresh[k].stream == st) { fk = k; break; }
            if (fk != NONE) {
                Fresh f = s->fresh[fk];
                memmove(&s->fresh[fk], &s->fresh[fk + 1], (size_t)(s->nfresh - fk - 1) * sizeof(Fresh));
                s->nfresh--;
                if (find_free(s, small, sz, st) != NONE) reasons[R_NEWSEG_CACHED]++;
                int32_t nbi = new_segment(s, f.addr, f.size, st, small);
                if (nbi == NONE) { PyErr_NoMemory(); goto done; }
                if (f.size != allocation_size(sz)) reasons[R_SEG_SIZE]++;
                if (f.addr == p) { bi = nbi; placed++; }
                else {
                    if (pool_insert(s, nbi) < 0) { PyErr_NoMemory(); goto done; }
                    reasons[R_NOT_AT_NEWSEG]++;
                }
            } else {
                Py_ssize_t k = find_free(s, small, sz, st);
                if (k != NONE && s->pool[small].k[k].addr == p) {
                    bi = map_get(&s->blocks, p);
                    Pool *pl = &s->pool[small];
                    memmove(&pl->k[k], &pl->k[k + 1], (size_t)(pl->n - k - 1) * sizeof(Key));
                    pl->n--;
                    placed++;
                } else {
                    reasons[k != NONE ? R_BEST_FIT : R_NO_CACHED]++;
                }
            }
            if (bi == NONE) {
                slack += small ? 0 : ((uint64_t)sz >= s->mss ? s->rounding : SMALL_SIZE);
                bi = resync(s, p, sz);
                if (bi == -2) { PyErr_NoMemory(); goto done; }
                if (bi == NONE) {
                    reasons[R_OUTSIDE]++;
                    int32_t ph = new_blk(s);
                    if (ph == NONE) { PyErr_NoMemory(); goto done; }
                    Blk *b = &s->b[ph];
                    b->addr = p; b->size = sz; b->stream = st; b->small = (uint8_t)small; b->seg = 0;
                    b->prev = b->next = NONE; b->flags = F_ALLOCATED | F_PHANTOM;
                    s->allocated += sz;
                    if (map_put(&s->live, p, ph) < 0) { PyErr_NoMemory(); goto done; }
                    PUT_BLOCK(sz);
                    out_alloc[i] = s->allocated;
                    out_res[i * res_step] = s->reserved;
                    continue;
                }
            }
            if (s->b[bi].size < sz) { reasons[R_SMALLER]++; sz = s->b[bi].size; }
            if (take(s, bi, sz) < 0) { PyErr_NoMemory(); goto done; }
            int32_t old = map_get(&s->live, p);
            if (old != NONE && (s->b[old].flags & (F_ALLOCATED | F_PENDING))) reasons[R_TWICE]++;
            if (map_put(&s->live, p, bi) < 0) { PyErr_NoMemory(); goto done; }
            PUT_BLOCK(s->b[bi].size);
        } else if (a == A_FREE_REQUESTED) {
            int32_t bi = map_get(&s->live, addr[i]);
            if (bi == NONE || !(s->b[bi].flags & F_ALLOCATED)) reasons[R_FREE_UNKNOWN]++;
            else {
                Blk *b = &s->b[bi];
                b->flags = (uint8_t)((b->flags & ~F_ALLOCATED) | F_PENDING);
                s->allocated -= b->size;
            }
        } else if (a == A_FREE_COMPLETED) {
            int32_t bi = map_get(&s->live, addr[i]);
            if (bi == NONE) reasons[R_FREE_UNKNOWN]++;
            else {
                map_del(&s->live, addr[i]);
                Blk *b = &s->b[bi];
                if (b->flags & F_PHANTOM) {
                    if (b->flags & F_ALLOCATED) s->allocated -= b->size;
                    drop_blk(s, bi);
                } else if (b->flags & F_ALLOCATED) {
                    reasons[R_NO_REQUEST]++;
                    b->flags = 0;
                    s->allocated -= b->size;
                    if (cache(s, bi) < 0) { PyErr_NoMemory(); goto done; }
                } else if (b->flags & F_PENDING) {
                    b->flags = 0;
                    if (cache(s, bi) < 0) { PyErr_NoMemory(); goto done; }
                }
            }
        } else if (a == A_SEGMENT_ALLOC) {
            if (reserve((void **)&s->fresh, &s->capfresh, s->nfresh + 1, sizeof(Fresh)) < 0) { PyErr_NoMemory(); goto done; }
            s->fresh[s->nfresh].stream = stream[i * stream_step];
            s->fresh[s->nfresh].addr = addr[i];
            s->fresh[s->nfresh].size = size[i];
            s->nfresh++;
            s->reserved += size[i];
        } else if (a == A_SEGMENT_FREE) {
            if (flush(s, stream[i * stream_step]) < 0) { PyErr_NoMemory(); goto done; }
            if (!release(s, addr[i], size[i])) reasons[R_SEG_FREE]++;
        } else if (a == A_OOM) {
            int64_t sz = size[i];
            int after_frees = i > 0 && (action[i - 1] == A_FREE_COMPLETED || action[i - 1] == A_SEGMENT_FREE
                                        || action[i - 1] == A_SEGMENT_UNMAP);
            if (!after_frees && find_free(s, sz <= SMALL_SIZE, sz, stream[i * stream_step]) != NONE) reasons[R_OOM_CACHED]++;
        } else if (a == A_SEGMENT_MAP || a == A_SEGMENT_UNMAP) {
            PyErr_SetString(PyExc_ValueError, "expandable segments: use the Python replay");
            goto done;
        }
        out_alloc[i] = s->allocated;
        out_res[i * res_step] = s->reserved;
    }
    while (s->nfresh) {
        if (flush(s, s->fresh[0].stream) < 0) { PyErr_NoMemory(); goto done; }
    }
    {   /* the final state: every segment's blocks, from its first block */
        PyObject *final = PyList_New(0), *counts = PyList_New(N_REASONS);
        if (!final || !counts) { Py_XDECREF(final); Py_XDECREF(counts); goto done; }
        for (int k = 0; k < N_REASONS; k++) PyList_SET_ITEM(counts, k, PyLong_FromLongLong(reasons[k]));
        for (size_t k = 0; k < s->blocks.cap; k++) {
            if (s->blocks.keys[k] == EMPTY) continue;
            int32_t bi = s->blocks.vals[k];
            if (s->b[bi].prev != NONE) continue;
            for (; bi != NONE; bi = s->b[bi].next) {
                Blk *b = &s->b[bi];
                int state = (b->flags & F_ALLOCATED) ? 1 : (b->flags & F_PENDING) ? 2 : 0;
                PyObject *t = Py_BuildValue("(KLii)", (unsigned long long)b->addr, (long long)b->size, state,
                                            b->prev == NONE);
                if (!t || PyList_Append(final, t) < 0) { Py_XDECREF(t); Py_DECREF(final); Py_DECREF(counts); goto done; }
                Py_DECREF(t);
            }
        }
        result = Py_BuildValue("(LLNLLN)", placed, slack, counts, (long long)allocated0, (long long)reserved0, final);
    }
done:
#undef PUT_BLOCK
    for (int k = 0; k < 17; k++)
        if (B[k].have) PyBuffer_Release(&B[k].v);
    if (E.have) PyBuffer_Release(&E.v);
    PyMem_RawFree(s->b);
    PyMem_RawFree(s->freeslots);
    PyMem_RawFree(s->blocks.keys);
    PyMem_RawFree(s->blocks.vals);
    PyMem_RawFree(s->live.keys);
    PyMem_RawFree(s->live.vals);
    PyMem_RawFree(s->pool[0].k);
    PyMem_RawFree(s->pool[1].k);
    PyMem_RawFree(s->segs);
    PyMem_RawFree(s->fresh);
    return result;
}

/* first_touches(action, addr) -> (addresses, first entry index, its action): for every address an alloc,
 * free_requested or free_completed names, its first such entry, in order of address. */
static PyObject *first_touches(PyObject *self, PyObject *args) {
    PyObject *oa, *ob;
    if (!PyArg_ParseTuple(args, "OO", &oa, &ob)) return NULL;
    Buf A = {0}, B = {0};
    Map m = {0};
    PyObject *result = NULL;
    uint64_t *ua = NULL;
    int64_t *ui = NULL;
    int8_t *uc = NULL;
    if (get_buf(oa, &A, 1, 0, "action") < 0 || get_buf(ob, &B, 8, 0, "addr") < 0) goto done;
    Py_ssize_t n = LEN(A);
    if (LEN(B) != n) { PyErr_SetString(PyExc_ValueError, "column lengths differ"); goto done; }
    const int8_t *action = A.v.buf;
    const uint64_t *addr = B.v.buf;
    if (map_init(&m, 1024) < 0) { PyErr_NoMemory(); goto done; }
    Py_ssize_t cap = 1024, k = 0;
    ua = PyMem_RawMalloc(cap * sizeof(uint64_t));
    ui = PyMem_RawMalloc(cap * sizeof(int64_t));
    uc = PyMem_RawMalloc(cap);
    if (!ua || !ui || !uc) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        int a = action[i];
        if (a != A_ALLOC && a != A_FREE_REQUESTED && a != A_FREE_COMPLETED) continue;
        if (addr[i] == EMPTY) continue;
        int32_t *v = map_slot(&m, addr[i]);
        if (!v) { PyErr_NoMemory(); goto done; }
        if (*v != NONE) continue;
        if (k == cap) {
            cap *= 2;
            uint64_t *q1 = PyMem_RawRealloc(ua, cap * sizeof(uint64_t));
            if (q1) ua = q1;
            int64_t *q2 = PyMem_RawRealloc(ui, cap * sizeof(int64_t));
            if (q2) ui = q2;
            int8_t *q3 = PyMem_RawRealloc(uc, cap);
            if (q3) uc = q3;
            if (!q1 || !q2 || !q3) { PyErr_NoMemory(); goto done; }
        }
        *v = (int32_t)k;
        ua[k] = addr[i];
        ui[k] = i;
        uc[k] = (int8_t)a;
        k++;
    }
    result = Py_BuildValue("(y#y#y#)", (const char *)ua, (Py_ssize_t)(k * 8), (const char *)ui, (Py_ssize_t)(k * 8),
                           (const char *)uc, (Py_ssize_t)k);
done:
    if (A.have) PyBuffer_Release(&A.v);
    if (B.have) PyBuffer_Release(&B.v);
    PyMem_RawFree(m.keys);
    PyMem_RawFree(m.vals);
    PyMem_RawFree(ua);
    PyMem_RawFree(ui);
    PyMem_RawFree(uc);
    return result;
}

/* pair_lifetimes(addr, size, stack, is_alloc, is_free[, blk_addr, blk_size, blk_stack]) -> (addr, size,
 * alloc_index, free_index, stack_id, free_stack_id, origin, last_addr, last_is_alloc, last_size) as bytearrays,
 * or None when an address is
 * UINT64_MAX (the map's empty key) or there are 2**31 entries or more. One device's entries in order (`stack` and
 * `size` may be one value for all); each alloc pairs with the next entry of its address when that is a free; a
 * free whose address's previous entry is not an alloc stands alone (allocated before the trace: origin 1). One
 * row per lifetime, in order of its first entry, -1 where it has no alloc or no free; then, when the final
 * segments' live blocks are given (uint64, int64, int32; stack may be one value), a row for each whose address
 * no entry names (allocated before the trace, never freed: origin 1), in their order. last_*: each address the
 * entries name (uint64), whether its last alloc or free entry is an alloc (bool), that entry's size (int64), in
 * no order. What analysis/replay.py's pairing by a sort of the addresses gives, in one pass. */
static PyObject *pair_lifetimes(PyObject *self, PyObject *args) {
    PyObject *o[8] = {NULL};
    if (!PyArg_ParseTuple(args, "OOOOO|OOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7])) return NULL;
    static const Py_ssize_t items[8] = {8, 8, 4, 1, 1, 8, 8, 4};
    static const char *names[8] = {"addr", "size", "stack", "is_alloc", "is_free", "blk_addr", "blk_size",
                                   "blk_stack"};
    static const Py_ssize_t widths[10] = {8, 8, 8, 8, 4, 4, 1, 8, 1, 8};
    Buf B[8];
    memset(B, 0, sizeof B);
    Map m = {0};
    PyObject *c[10] = {NULL};
    PyObject *result = NULL;
    int nargs = o[5] ? 8 : 5;
    if (o[5] && (!o[6] || !o[7])) { PyErr_SetString(PyExc_TypeError, "the blocks take three columns"); return NULL; }
    for (int k = 0; k < nargs; k++)
        if (get_buf(o[k], &B[k], items[k], 0, names[k]) < 0) goto done;
    Py_ssize_t n = LEN(B[0]), nb = nargs == 8 ? LEN(B[5]) : 0;
    if ((LEN(B[1]) != n && LEN(B[1]) != 1) || LEN(B[3]) != n || LEN(B[4]) != n || (LEN(B[2]) != n && LEN(B[2]) != 1)
        || (nargs == 8 && (LEN(B[6]) != nb || (LEN(B[7]) != nb && LEN(B[7]) != 1)))) {
        PyErr_SetString(PyExc_ValueError, "column lengths differ");
        goto done;
    }
    if (n >= INT32_MAX - 2) { result = Py_None; Py_INCREF(result); goto done; }
    const uint64_t *addr = B[0].v.buf;
    const int64_t *size = B[1].v.buf;
    const int32_t *stack = B[2].v.buf;
    const uint8_t *al = B[3].v.buf, *fr = B[4].v.buf;
    const Py_ssize_t size_step = LEN(B[1]) == n ? 1 : 0, stack_step = LEN(B[2]) == n ? 1 : 0;
    /* every row takes an alloc or a free of its own, or a block: that many rows at most, the columns made
     * that long at once (pages never written cost no memory) and cut to length at the end */
    Py_ssize_t cap = nb;
    for (Py_ssize_t i = 0; i < n; i++) cap += al[i] | fr[i];
    for (int k = 0; k < 7; k++)
        if (!(c[k] = PyByteArray_FromStringAndSize(NULL, (cap ? cap : 1) * widths[k]))) goto done;
    uint64_t *r_addr = (uint64_t *)PyByteArray_AS_STRING(c[0]);
    int64_t *r_size = (int64_t *)PyByteArray_AS_STRING(c[1]), *r_alloc = (int64_t *)PyByteArray_AS_STRING(c[2]),
            *r_free = (int64_t *)PyByteArray_AS_STRING(c[3]);
    int32_t *r_stack = (int32_t *)PyByteArray_AS_STRING(c[4]), *r_fstack = (int32_t *)PyByteArray_AS_STRING(c[5]);
    int8_t *r_origin = (int8_t *)PyByteArray_AS_STRING(c[6]);
    if (map_init(&m, 1024) < 0) { PyErr_NoMemory(); goto done; }
    /* each address's value in the map: its last entry, as the row of that alloc (>= 0) or -2 - the entry of
     * that free */
    Py_ssize_t r = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!(al[i] | fr[i])) continue;
        uint64_t x = addr[i];
        if (x == EMPTY) { result = Py_None; Py_INCREF(result); goto done; }
        int32_t *v = map_slot(&m, x);
        if (!v) { PyErr_NoMemory(); goto done; }
        int32_t st = stack[i * stack_step];
        if (al[i]) {
            r_addr[r] = x; r_size[r] = size[i * size_step]; r_alloc[r] = i; r_free[r] = -1;
            r_stack[r] = st; r_fstack[r] = -1; r_origin[r] = 0;
            *v = (int32_t)r++;
            continue;
        }
        if (*v >= 0) {  /* the free of the alloc just before it at this address */
            r_free[*v] = i;
            r_fstack[*v] = st;
        } else {
            r_addr[r] = x; r_size[r] = size[i * size_step]; r_alloc[r] = -1; r_free[r] = i;
            r_stack[r] = -1; r_fstack[r] = st; r_origin[r] = 1;
            r++;
        }
        *v = (int32_t)(-2 - i);
    }
    if (nargs == 8) {
        const uint64_t *ba = B[5].v.buf;
        const int64_t *bz = B[6].v.buf;
        const int32_t *bst = B[7].v.buf;
        const Py_ssize_t bst_step = LEN(B[7]) == nb ? 1 : 0;
        for (Py_ssize_t k = 0; k < nb; k++) {
            if (map_get(&m, ba[k]) != NONE) continue;
            r_addr[r] = ba[k]; r_size[r] = bz[k]; r_alloc[r] = -1; r_free[r] = -1;
            r_stack[r] = bst[k * bst_step]; r_fstack[r] = -1; r_origin[r] = 1;
            r++;
        }
    }
    for (int k = 7; k < 10; k++)
        if (!(c[k] = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(m.n ? m.n : 1) * widths[k]))) goto done;
    uint64_t *l_addr = (uint64_t *)PyByteArray_AS_STRING(c[7]);
    uint8_t *l_alloc = (uint8_t *)PyByteArray_AS_STRING(c[8]);
    int64_t *l_size = (int64_t *)PyByteArray_AS_STRING(c[9]);
    Py_ssize_t u = 0;
    for (size_t k = 0; k < m.cap; k++) {
        if (m.keys[k] == EMPTY) continue;
        int32_t v = m.vals[k];
        l_addr[u] = m.keys[k];
        l_alloc[u] = v >= 0;
        l_size[u] = v >= 0 ? r_size[v] : size[(-2 - (int64_t)v) * size_step];
        u++;
    }
    for (int k = 0; k < 10; k++)
        if (PyByteArray_Resize(c[k], (k < 7 ? r : u) * widths[k]) < 0) goto done;
    result = PyTuple_New(10);
    if (!result) goto done;
    for (int k = 0; k < 10; k++) {
        PyTuple_SET_ITEM(result, k, c[k]);
        c[k] = NULL;
    }
done:
    for (int k = 0; k < 8; k++)
        if (B[k].have) PyBuffer_Release(&B[k].v);
    for (int k = 0; k < 10; k++) Py_XDECREF(c[k]);
    PyMem_RawFree(m.keys);
    PyMem_RawFree(m.vals);
    return result;
}

/* running_sum(size, up, down, initial, out): out[i] = initial plus size[j] for every j <= i where up[j], less
 * size[j] where down[j], wrapping as numpy's int64 does; `size` (int64) may be one value for every entry, `up`
 * and `down` are bool, `out` a writable int64 buffer as long. replay.py's allocated bytes after each entry, in one
 * pass and no temporary of the entries' length. */
static PyObject *running_sum(PyObject *self, PyObject *args) {
    PyObject *o[4];
    long long initial;
    if (!PyArg_ParseTuple(args, "OOOLO", &o[0], &o[1], &o[2], &initial, &o[3])) return NULL;
    static const Py_ssize_t items[4] = {8, 1, 1, 8};
    static const char *names[4] = {"size", "up", "down", "out"};
    Buf B[4];
    memset(B, 0, sizeof B);
    PyObject *result = NULL;
    for (int k = 0; k < 4; k++)
        if (get_buf(o[k], &B[k], items[k], k == 3, names[k]) < 0) goto done;
    Py_ssize_t n = LEN(B[3]);
    if ((LEN(B[0]) != n && LEN(B[0]) != 1) || LEN(B[1]) != n || LEN(B[2]) != n) {
        PyErr_SetString(PyExc_ValueError, "column lengths differ");
        goto done;
    }
    const int64_t *size = B[0].v.buf;
    const uint8_t *up = B[1].v.buf, *down = B[2].v.buf;
    int64_t *out = B[3].v.buf;
    const Py_ssize_t step = LEN(B[0]) == n ? 1 : 0;
    uint64_t run = (uint64_t)initial;  /* unsigned: wraps without undefined behaviour */
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t z = (uint64_t)size[i * step];
        run += up[i] ? z : 0;
        run -= down[i] ? z : 0;
        out[i] = (int64_t)run;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (int k = 0; k < 4; k++)
        if (B[k].have) PyBuffer_Release(&B[k].v);
    return result;
}

static PyObject *change_steps(PyObject *self, PyObject *args);
static PyObject *group_peaks(PyObject *self, PyObject *args);

static PyMethodDef methods[] = {
    {"replay", replay, METH_VARARGS, "Replay one device's trace through the caching-allocator model."},
    {"first_touches", first_touches, METH_VARARGS, "First alloc/free entry of every address, in order of entry."},
    {"pair_lifetimes", pair_lifetimes, METH_VARARGS, "One device's allocs and frees paired into lifetimes, in one pass."},
    {"running_sum", running_sum, METH_VARARGS, "Allocated bytes after each entry: a running sum, in one pass."},
    {"change_steps", change_steps, METH_VARARGS, "Per class, allocations' changes in entry order and their running sum."},
    {"group_peaks", group_peaks, METH_VARARGS, "The most bytes each group of allocations held live at once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_replay", NULL, -1, methods};

/* the reasons' text, in the order of the R_ enum (analysis/allocator/model_replay.py's REASONS begins with these) */
static const char *reason_text[N_REASONS] = {
    "a new segment where the model had a cached block",
    "segment of another size than the model asks for",
    "request not at its new segment",
    "best fit differs from the recorded address",
    "no cached block in the model where the allocator found one",
    "address outside the known free memory",
    "recorded block smaller than the request",
    "allocated twice without a free",
    "free of an address not allocated",
    "free_completed without free_requested",
    "segment_free of a segment that is not free in the model",
    "out of memory where the model had a cached block",
};

PyMODINIT_FUNC PyInit__replay(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *reasons = PyTuple_New(N_REASONS);
    if (!reasons) goto fail;
    for (int k = 0; k < N_REASONS; k++) {
        PyObject *t = PyUnicode_FromString(reason_text[k]);
        if (!t) { Py_DECREF(reasons); goto fail; }
        PyTuple_SET_ITEM(reasons, k, t);
    }
    if (PyModule_AddObject(m, "REASONS", reasons) < 0) { Py_DECREF(reasons); goto fail; }
    if (PyModule_AddIntConstant(m, "MIN_BLOCK", MIN_BLOCK) < 0 || PyModule_AddIntConstant(m, "SMALL_SIZE", SMALL_SIZE) < 0
        || PyModule_AddIntConstant(m, "SMALL_BUFFER", SMALL_BUFFER) < 0
        || PyModule_AddIntConstant(m, "LARGE_BUFFER", LARGE_BUFFER) < 0
        || PyModule_AddIntConstant(m, "MIN_LARGE_ALLOC", MIN_LARGE_ALLOC) < 0
        || PyModule_AddIntConstant(m, "ROUND_LARGE", ROUND_LARGE) < 0
        || PyModule_AddIntConstant(m, "POWER2_START_LOG2", POWER2_START_LOG2) < 0
        || PyModule_AddIntConstant(m, "INTERVALS", INTERVALS) < 0
        || PyModule_AddIntConstant(m, "A_ALLOC", A_ALLOC) < 0
        || PyModule_AddIntConstant(m, "A_FREE_REQUESTED", A_FREE_REQUESTED) < 0
        || PyModule_AddIntConstant(m, "A_FREE_COMPLETED", A_FREE_COMPLETED) < 0
        || PyModule_AddIntConstant(m, "A_SEGMENT_ALLOC", A_SEGMENT_ALLOC) < 0
        || PyModule_AddIntConstant(m, "A_SEGMENT_FREE", A_SEGMENT_FREE) < 0
        || PyModule_AddIntConstant(m, "A_SEGMENT_MAP", A_SEGMENT_MAP) < 0
        || PyModule_AddIntConstant(m, "A_SEGMENT_UNMAP", A_SEGMENT_UNMAP) < 0
        || PyModule_AddIntConstant(m, "A_OOM", A_OOM) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}

/* ---- allocations' changes in entry order, without a sort ------------------------------------------------------
 *
 * Every trace entry is at most one change: the alloc or the free of one allocation (alloc_index / free_index are
 * entry positions, -1: before the trace / never freed). So the changes come in entry order by walking the entries,
 * a window at a time: each window's allocs and frees are put in a map of its entries (row * 2 + 1 for a free, -1
 * none), which is then read in order. The allocations come in order of their first entry (replay.py makes them so),
 * so a pointer over the rows finds each window's allocs; frees past the window wait in a list (the allocations
 * live across it: few). Allocations out of that order, two changes at one entry, or an entry of 2**31 - 1 or more
 * make the walk give up (the callers keep their sort for those). */

#define WALK_WINDOW (1 << 20)  /* entries per window: its map is 4 MiB, whatever the trace's length */

typedef struct {
    const int64_t *a, *f;
    const char *cls;  /* each row's class (a category, a group), `item` bytes, signed; rows outside [0, ncls) are left out */
    Py_ssize_t item, ncls, m;
    Py_ssize_t row, lo, hi;  /* the rows' pointer; the window's entries [lo, hi) */
    int32_t *map;  /* WALK_WINDOW slots */
    int32_t *pend;  /* rows whose free is past the window */
    Py_ssize_t npend, cap;
} Walk;

static inline int64_t cls_of(const Walk *w, Py_ssize_t r) {
    switch (w->item) {
    case 1: return ((const int8_t *)w->cls)[r];
    case 2: return ((const int16_t *)w->cls)[r];
    case 4: return ((const int32_t *)w->cls)[r];
    default: return ((const int64_t *)w->cls)[r];
    }
}

static inline int walk_keeps(const Walk *w, Py_ssize_t r) {
    int64_t c = cls_of(w, r);
    return c >= 0 && c < w->ncls;
}

static inline int walk_put(Walk *w, int64_t at, int32_t v) {
    if (at < w->lo || at >= w->hi || at >= INT32_MAX) return -1;  /* out of the rows' order; past int32 */
    int32_t *slot = &w->map[at - w->lo];
    if (*slot != NONE) return -1;  /* two changes at one entry */
    *slot = v;
    return 0;
}

/* Row r's first change, in *first: 1; 0 where it has none here (another class, or made before the trace and never
 * freed); -1 for an index below -1. */
static inline int row_first(const Walk *w, Py_ssize_t r, int64_t *first) {
    if (!walk_keeps(w, r)) return 0;
    int64_t a = w->a[r], f = w->f[r];
    if (a < -1 || f < -1) return -1;
    *first = a >= 0 ? a : f;
    return *first >= 0;
}

/* Fill the map with the next window's changes. 1: a window is ready; 0: no change is left; -1: give up; -2: no
 * memory. */
static int walk_next(Walk *w) {
    /* the window starts at the next change: the first waiting free or the next row's first entry */
    int64_t next = INT64_MAX;
    for (Py_ssize_t k = 0; k < w->npend; k++)
        if (w->f[w->pend[k]] < next) next = w->f[w->pend[k]];
    for (; w->row < w->m; w->row++) {
        int64_t first;
        int has = row_first(w, w->row, &first);
        if (has < 0) return -1;
        if (has) {
            if (first < next) next = first;
            break;
        }
    }
    if (next == INT64_MAX) return 0;
    if (next >= INT32_MAX) return -1;
    w->lo = next > w->hi ? next : w->hi;  /* below hi: out of order, which walk_put finds */
    w->hi = w->lo + WALK_WINDOW;
    memset(w->map, 0xff, WALK_WINDOW * sizeof(int32_t));
    Py_ssize_t keep = 0;
    for (Py_ssize_t k = 0; k < w->npend; k++) {
        int32_t r = w->pend[k];
        if (w->f[r] < w->hi) {
            if (walk_put(w, w->f[r], 2 * r + 1) < 0) return -1;
        } else {
            w->pend[keep++] = r;
        }
    }
    w->npend = keep;
    for (; w->row < w->m; w->row++) {
        Py_ssize_t r = w->row;
        int64_t first;
        int has = row_first(w, r, &first);
        if (has < 0) return -1;
        if (!has) continue;
        if (first >= w->hi) break;
        int64_t a = w->a[r], f = w->f[r];
        if (a >= 0 && walk_put(w, a, 2 * (int32_t)r) < 0) return -1;
        if (f < 0) continue;
        if (f < w->hi) {
            if (walk_put(w, f, 2 * (int32_t)r + 1) < 0) return -1;
        } else {
            if (w->npend == w->cap) {
                Py_ssize_t cap = w->cap ? 2 * w->cap : 4096;
                int32_t *p = PyMem_RawRealloc(w->pend, (size_t)cap * sizeof(int32_t));
                if (!p) return -2;
                w->pend = p;
                w->cap = cap;
            }
            w->pend[w->npend++] = (int32_t)r;
        }
    }
    return 1;
}

/* Parse (alloc_index, free_index, size, cls, ncls) into buffers and a walk; -1 with an exception set. */
static int walk_open(PyObject *const *o, Buf *B, Walk *w, Py_ssize_t ncls);

/* The arguments of change_steps and group_peaks (alloc_index, free_index, size, cls, ncls) taken into B and w: 0;
 * 1 when there are 2**30 allocations or more (the caller returns None); -1 on an error (set). */
static int walk_args(PyObject *args, Buf *B, Walk *w, Py_ssize_t *ncls) {
    PyObject *o[4];
    memset(B, 0, 4 * sizeof *B);
    memset(w, 0, sizeof *w);
    if (!PyArg_ParseTuple(args, "OOOOn", &o[0], &o[1], &o[2], &o[3], ncls)) return -1;
    if (*ncls < 0) { PyErr_SetString(PyExc_ValueError, "a count of classes below 0"); return -1; }
    if (walk_open(o, B, w, *ncls) < 0) return -1;
    return w->m >= (1 << 30);
}

/* What walk_args took, and the walk's own memory, let go. */
static void walk_close(Buf *B, Walk *w) {
    for (int k = 0; k < 4; k++)
        if (B[k].have) PyBuffer_Release(&B[k].v);
    PyMem_RawFree(w->map);
    PyMem_RawFree(w->pend);
}

static int walk_open(PyObject *const *o, Buf *B, Walk *w, Py_ssize_t ncls) {
    static const char *names[4] = {"alloc_index", "free_index", "size", "cls"};
    for (int k = 0; k < 4; k++) {
        if (PyObject_GetBuffer(o[k], &B[k].v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
        B[k].have = 1;
        const char *fmt = B[k].v.format ? B[k].v.format : "B";
        if (*fmt == '<' || *fmt == '=' || *fmt == '@') fmt++;
        Py_ssize_t it = B[k].v.itemsize;
        int is_signed = *fmt && strchr("bhilq", *fmt) != NULL && fmt[1] == 0;
        if (!is_signed || (k < 3 ? it != 8 : (it != 1 && it != 2 && it != 4 && it != 8))) {
            PyErr_Format(PyExc_ValueError, "%s: signed integers expected (int64, or for cls int8 to int64)", names[k]);
            return -1;
        }
    }
    Py_ssize_t m = LEN(B[0]);
    if (LEN(B[1]) != m || LEN(B[2]) != m || LEN(B[3]) != m) {
        PyErr_SetString(PyExc_ValueError, "column lengths differ");
        return -1;
    }
    memset(w, 0, sizeof *w);
    w->a = B[0].v.buf;
    w->f = B[1].v.buf;
    w->cls = B[3].v.buf;
    w->item = B[3].v.itemsize;
    w->ncls = ncls;
    w->m = m;
    return 0;
}

/* change_steps(alloc_index, free_index, size, cls, ncls) -> ([initial bytes per class], [(entries int32, cumulative
 * bytes int64) per class]) as bytearrays, or None (see above; and 2**30 rows or more). Per class of `cls` in
 * [0, ncls): the sizes of its allocations made before the trace, and its changes in entry order (+size at an
 * alloc, -size at a free) with their running sum: what analysis/timeline.py's sort of the changes gives. */
static PyObject *change_steps(PyObject *self, PyObject *args) {
    Py_ssize_t ncls;
    Buf B[4];
    Walk w;
    PyObject *result = NULL, *initial = NULL, *cols = NULL;
    Py_ssize_t *count = NULL, *at = NULL;
    int64_t *run = NULL, *init = NULL;
    int32_t **pos = NULL;
    int64_t **cum = NULL;
    int took = walk_args(args, B, &w, &ncls);
    if (took < 0) goto done;
    if (took) { result = Py_None; Py_INCREF(result); goto done; }
    const int64_t *size = B[2].v.buf;
    size_t nc = ncls ? (size_t)ncls : 1;
    count = PyMem_RawCalloc(nc, sizeof *count);
    at = PyMem_RawCalloc(nc, sizeof *at);
    run = PyMem_RawCalloc(nc, sizeof *run);
    init = PyMem_RawCalloc(nc, sizeof *init);
    pos = PyMem_RawCalloc(nc, sizeof *pos);
    cum = PyMem_RawCalloc(nc, sizeof *cum);
    w.map = PyMem_RawMalloc(WALK_WINDOW * sizeof(int32_t));
    if (!count || !at || !run || !init || !pos || !cum || !w.map) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t r = 0; r < w.m; r++) {
        if (!walk_keeps(&w, r)) continue;
        int64_t c = cls_of(&w, r);
        count[c] += (w.a[r] >= 0) + (w.f[r] >= 0);
        if (w.a[r] < 0) init[c] = (int64_t)((uint64_t)init[c] + (uint64_t)size[r]);  /* wraps as numpy's sum */
    }
    cols = PyList_New(ncls);
    if (!cols) goto done;
    for (Py_ssize_t c = 0; c < ncls; c++) {
        PyObject *p = PyByteArray_FromStringAndSize(NULL, count[c] * (Py_ssize_t)sizeof(int32_t));
        PyObject *s = p ? PyByteArray_FromStringAndSize(NULL, count[c] * (Py_ssize_t)sizeof(int64_t)) : NULL;
        PyObject *t = s ? PyTuple_Pack(2, p, s) : NULL;
        Py_XDECREF(p);
        Py_XDECREF(s);
        if (!t) goto done;
        PyList_SET_ITEM(cols, c, t);
        pos[c] = (int32_t *)PyByteArray_AS_STRING(p);
        cum[c] = (int64_t *)PyByteArray_AS_STRING(s);
    }
    int got;
    while ((got = walk_next(&w)) == 1) {
        for (Py_ssize_t i = 0; i < WALK_WINDOW; i++) {
            int32_t v = w.map[i];
            if (v < 0) continue;
            int32_t r = v >> 1;
            int64_t c = cls_of(&w, r);
            uint64_t d = (uint64_t)size[r];
            run[c] = (int64_t)((uint64_t)run[c] + ((v & 1) ? -d : d));
            pos[c][at[c]] = (int32_t)(w.lo + i);
            cum[c][at[c]++] = run[c];
        }
    }
    if (got == -2) { PyErr_NoMemory(); goto done; }
    if (got == -1) { result = Py_None; Py_INCREF(result); goto done; }
    initial = PyList_New(ncls);
    if (!initial) goto done;
    for (Py_ssize_t c = 0; c < ncls; c++) {
        PyObject *x = PyLong_FromLongLong(init[c]);
        if (!x) goto done;
        PyList_SET_ITEM(initial, c, x);
    }
    result = PyTuple_Pack(2, initial, cols);
done:
    walk_close(B, &w);
    Py_XDECREF(initial);
    Py_XDECREF(cols);
    PyMem_RawFree(count);
    PyMem_RawFree(at);
    PyMem_RawFree(run);
    PyMem_RawFree(init);
    PyMem_RawFree(pos);
    PyMem_RawFree(cum);
    return result;
}

/* group_peaks(alloc_index, free_index, size, group, ngroups) -> the most bytes each group held live at once (int64
 * per group, a bytearray; 0 for a group without allocations), or None (see above; and 2**30 rows or more). The
 * changes in the order analysis/modules.py's sort puts them: the allocations made before the trace first (in row
 * order), then the entries in order, then the frees of those never freed (in row order); the most after any. */
static PyObject *group_peaks(PyObject *self, PyObject *args) {
    Py_ssize_t ng;
    Buf B[4];
    Walk w;
    PyObject *result = NULL, *out = NULL;
    int64_t *run = NULL;
    uint8_t *seen = NULL;
    int took = walk_args(args, B, &w, &ng);
    if (took < 0) goto done;
    if (took) { result = Py_None; Py_INCREF(result); goto done; }
    const int64_t *size = B[2].v.buf;
    size_t n = ng ? (size_t)ng : 1;
    out = PyByteArray_FromStringAndSize(NULL, ng * (Py_ssize_t)sizeof(int64_t));
    run = PyMem_RawCalloc(n, sizeof *run);
    seen = PyMem_RawCalloc(n, 1);
    w.map = PyMem_RawMalloc(WALK_WINDOW * sizeof(int32_t));
    if (!out || !run || !seen || !w.map) { if (!PyErr_Occurred()) PyErr_NoMemory(); goto done; }
    int64_t *peak = (int64_t *)PyByteArray_AS_STRING(out);
    if (ng) memset(peak, 0, (size_t)ng * sizeof *peak);
#define CHANGE(g, d) do { \
        run[g] = (int64_t)((uint64_t)run[g] + (d)); \
        if (!seen[g] || run[g] > peak[g]) peak[g] = run[g]; \
        seen[g] = 1; \
    } while (0)
    for (Py_ssize_t r = 0; r < w.m; r++)
        if (walk_keeps(&w, r) && w.a[r] < 0) CHANGE(cls_of(&w, r), (uint64_t)size[r]);
    int got;
    while ((got = walk_next(&w)) == 1) {
        for (Py_ssize_t i = 0; i < WALK_WINDOW; i++) {
            int32_t v = w.map[i];
            if (v < 0) continue;
            int32_t r = v >> 1;
            uint64_t d = (uint64_t)size[r];
            CHANGE(cls_of(&w, r), (v & 1) ? -d : d);
        }
    }
    if (got == -2) { PyErr_NoMemory(); goto done; }
    if (got == -1) { result = Py_None; Py_INCREF(result); goto done; }
    for (Py_ssize_t r = 0; r < w.m; r++)
        if (walk_keeps(&w, r) && w.f[r] < 0) CHANGE(cls_of(&w, r), -(uint64_t)size[r]);
#undef CHANGE
    result = out;
    out = NULL;
done:
    walk_close(B, &w);
    Py_XDECREF(out);
    PyMem_RawFree(run);
    PyMem_RawFree(seen);
    return result;
}
