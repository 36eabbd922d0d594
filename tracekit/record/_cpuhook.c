/* The CPU recorder's allocation source: every CPU tensor allocation and free, at almost no cost.
 *
 * PyTorch's CPU allocator (c10::alloc_cpu / c10::free_cpu, in libc10) calls posix_memalign and free
 * through libc10's procedure linkage table. `install(path)` points libc10's two jump slots at the
 * functions below, which call the real ones and, while recording, append an event
 * (time, address, size; a free has size < 0) to a buffer that Python drains (`drain`). A free is only
 * recorded for an address allocated while recording or registered with `track` (storages that existed
 * before): the others are not tensors, or were never seen. Events carry a running index (`mark`), so
 * the recorder knows exactly which allocations happened between two points of the program, without
 * comparing clocks.
 *
 * Only the jump slots are changed (direct calls); the address of `free` that libc10 may hand out as a
 * function pointer is left alone, so a deleter compared by address still compares equal. The slots
 * are written with a single aligned store; the functions here stay valid for the life of the process
 * (this module is never unloaded), so a call already under way when `uninstall` runs completes.
 * After fork, the child records nothing (pthread_atfork). Linux (x86-64, aarch64) only: elsewhere
 * `install` says why not, and the recorder uses torch.profiler instead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <time.h>

#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
#define TK_SUPPORTED 1
#include <elf.h>
#include <link.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>
#else
#define TK_SUPPORTED 0
#endif

#if TK_SUPPORTED

typedef struct {
    int64_t t;     /* Unix time, ns (CLOCK_REALTIME, the clock of time.time_ns and the profiler) */
    uint64_t ptr;
    int64_t size;  /* > 0: allocation; < 0: free of that many bytes */
} Event;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static volatile int recording = 0;
static Event *events = NULL;       /* ring of `capacity` events */
static size_t capacity = 0;
static uint64_t total = 0;         /* events ever recorded (the index of the next one) */
static uint64_t drained = 0;       /* index of the first event not yet drained */

/* Addresses whose free we record: open addressing, linear probing, tombstones. */
typedef struct { uint64_t ptr; int64_t size; } Slot;
#define EMPTY 0
#define TOMB 1
static Slot *table = NULL;
static size_t table_cap = 0, table_used = 0, table_live = 0;

static int (*real_memalign)(void **, size_t, size_t) = NULL;
static void (*real_free)(void *) = NULL;

static void **slot_memalign = NULL, **slot_free = NULL;  /* libc10's jump slots, once installed */
static int installed = 0;

static inline uint64_t hash_ptr(uint64_t p) {
    p ^= p >> 33; p *= 0xff51afd7ed558ccdULL; p ^= p >> 33;
    return p;
}

static int table_grow(void) {
    size_t cap = table_cap ? table_cap * 2 : 4096;
    while (table_live * 2 >= cap) cap *= 2;
    Slot *t = calloc(cap, sizeof(Slot));
    if (!t) return -1;
    for (size_t i = 0; i < table_cap; i++) {
        uint64_t p = table[i].ptr;
        if (p > TOMB) {
            size_t j = hash_ptr(p) & (cap - 1);
            while (t[j].ptr) j = (j + 1) & (cap - 1);
            t[j] = table[i];
        }
    }
    free(table);  /* our own allocation: libc's free, not the hook (this file is not libc10) */
    table = t;
    table_cap = cap;
    table_used = table_live;
    return 0;
}

static void table_put(uint64_t p, int64_t size) {
    if ((table_used + 1) * 4 >= table_cap * 3 && table_grow() != 0) return;
    size_t j = hash_ptr(p) & (table_cap - 1), tomb = (size_t)-1;
    while (table[j].ptr) {
        if (table[j].ptr == p) { table[j].size = size; return; }
        if (table[j].ptr == TOMB && tomb == (size_t)-1) tomb = j;
        j = (j + 1) & (table_cap - 1);
    }
    if (tomb != (size_t)-1) j = tomb; else table_used++;
    table[j].ptr = p;
    table[j].size = size;
    table_live++;
}

static int64_t table_pop(uint64_t p) {
    if (!table_live) return 0;
    size_t j = hash_ptr(p) & (table_cap - 1);
    while (table[j].ptr) {
        if (table[j].ptr == p) {
            int64_t size = table[j].size;
            table[j].ptr = TOMB;
            table_live--;
            return size;
        }
        j = (j + 1) & (table_cap - 1);
    }
    return 0;
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void push(uint64_t p, int64_t size) {
    Event *e = &events[total % capacity];
    e->t = now_ns();
    e->ptr = p;
    e->size = size;
    __atomic_store_n(&total, total + 1, __ATOMIC_RELEASE);
}

static int hook_memalign(void **out, size_t alignment, size_t size) {
    int r = real_memalign(out, alignment, size);
    if (r == 0 && recording && size > 0) {
        pthread_mutex_lock(&lock);
        if (recording) {
            table_put((uint64_t)*out, (int64_t)size);
            push((uint64_t)*out, (int64_t)size);
        }
        pthread_mutex_unlock(&lock);
    }
    return r;
}

static void hook_free(void *p) {
    if (p && recording) {
        /* recorded before the memory is given back: an allocation that reuses the address comes after */
        pthread_mutex_lock(&lock);
        if (recording) {
            int64_t size = table_pop((uint64_t)p);
            if (size > 0) push((uint64_t)p, -size);
        }
        pthread_mutex_unlock(&lock);
    }
    real_free(p);
}

static void atfork_prepare(void) { pthread_mutex_lock(&lock); }
static void atfork_parent(void) { pthread_mutex_unlock(&lock); }
static void atfork_child(void) {
    recording = 0;  /* a forked worker records nothing (its buffers are the parent's copy) */
    pthread_mutex_unlock(&lock);
}

/* -- finding libc10's jump slots ------------------------------------------------------------- */

typedef struct {
    const char *suffix;
    void **memalign_slot, **free_slot;
    uintptr_t relro_start, relro_end;
    int found_lib;
} Search;

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

#if defined(__x86_64__)
#define TK_JUMP_SLOT R_X86_64_JUMP_SLOT
#else
#define TK_JUMP_SLOT R_AARCH64_JUMP_SLOT
#endif

static int find_slots(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    Search *s = (Search *)data;
    if (!info->dlpi_name || !ends_with(info->dlpi_name, s->suffix)) return 0;
    s->found_lib = 1;
    const ElfW(Dyn) *dyn = NULL;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type == PT_DYNAMIC) dyn = (const ElfW(Dyn) *)(info->dlpi_addr + ph->p_vaddr);
        if (ph->p_type == PT_GNU_RELRO) {
            s->relro_start = info->dlpi_addr + ph->p_vaddr;
            s->relro_end = s->relro_start + ph->p_memsz;
        }
    }
    if (!dyn) return 1;
    const ElfW(Rela) *jmprel = NULL;
    size_t pltrelsz = 0;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    long pltrel = 0;
    for (const ElfW(Dyn) *d = dyn; d->d_tag != DT_NULL; d++) {
        /* glibc has relocated these entries to addresses already (d_ptr); keep both readings safe */
        switch (d->d_tag) {
            case DT_JMPREL: jmprel = (const ElfW(Rela) *)d->d_un.d_ptr; break;
            case DT_PLTRELSZ: pltrelsz = d->d_un.d_val; break;
            case DT_SYMTAB: symtab = (const ElfW(Sym) *)d->d_un.d_ptr; break;
            case DT_STRTAB: strtab = (const char *)d->d_un.d_ptr; break;
            case DT_PLTREL: pltrel = (long)d->d_un.d_val; break;
        }
    }
    if (!jmprel || !symtab || !strtab || pltrel != DT_RELA) return 1;
    /* glibc stores absolute addresses; other loaders may leave offsets from the base */
    if ((uintptr_t)jmprel < info->dlpi_addr) {
        jmprel = (const ElfW(Rela) *)((uintptr_t)jmprel + info->dlpi_addr);
        symtab = (const ElfW(Sym) *)((uintptr_t)symtab + info->dlpi_addr);
        strtab = (const char *)((uintptr_t)strtab + info->dlpi_addr);
    }
    size_t n = pltrelsz / sizeof(ElfW(Rela));
    for (size_t i = 0; i < n; i++) {
        const ElfW(Rela) *r = &jmprel[i];
        if (ELF64_R_TYPE(r->r_info) != TK_JUMP_SLOT) continue;
        const char *name = strtab + symtab[ELF64_R_SYM(r->r_info)].st_name;
        void **slot = (void **)(info->dlpi_addr + r->r_offset);
        if (strcmp(name, "posix_memalign") == 0) s->memalign_slot = slot;
        else if (strcmp(name, "free") == 0) s->free_slot = slot;
    }
    return 1;
}

static int write_slot(void **slot, void *value, const Search *s) {
    uintptr_t a = (uintptr_t)slot;
    int relro = a >= s->relro_start && a < s->relro_end;
    long page = sysconf(_SC_PAGESIZE);
    void *start = (void *)(a & ~(uintptr_t)(page - 1));
    if (relro && mprotect(start, (size_t)page, PROT_READ | PROT_WRITE) != 0) return -1;
    __atomic_store_n(slot, value, __ATOMIC_SEQ_CST);
    if (relro) mprotect(start, (size_t)page, PROT_READ);
    return 0;
}

static Search found;

#endif /* TK_SUPPORTED */

/* -- Python ---------------------------------------------------------------------------------- */

static PyObject *py_install(PyObject *self, PyObject *args) {
    const char *suffix;
    if (!PyArg_ParseTuple(args, "s", &suffix)) return NULL;
#if TK_SUPPORTED
    if (installed) Py_RETURN_NONE;
    static int atfork = 0;
    if (!atfork) {
        if (pthread_atfork(atfork_prepare, atfork_parent, atfork_child) != 0)
            return PyUnicode_FromString("pthread_atfork failed");
        atfork = 1;
    }
    memset(&found, 0, sizeof(found));
    found.suffix = suffix;
    dl_iterate_phdr(find_slots, &found);
    if (!found.found_lib) return PyUnicode_FromFormat("%s is not loaded", suffix);
    if (!found.memalign_slot || !found.free_slot)
        return PyUnicode_FromFormat("%s calls posix_memalign and free other than through its jump slots", suffix);
    real_memalign = posix_memalign;
    real_free = free;
    if (write_slot(found.free_slot, (void *)hook_free, &found) != 0)
        return PyUnicode_FromString("cannot write the jump slot of free");
    if (write_slot(found.memalign_slot, (void *)hook_memalign, &found) != 0) {
        write_slot(found.free_slot, (void *)real_free, &found);
        return PyUnicode_FromString("cannot write the jump slot of posix_memalign");
    }
    slot_memalign = found.memalign_slot;
    slot_free = found.free_slot;
    installed = 1;
    Py_RETURN_NONE;
#else
    (void)suffix;
    return PyUnicode_FromString("only on Linux (x86-64, aarch64)");
#endif
}

static PyObject *py_uninstall(PyObject *self, PyObject *noargs) {
#if TK_SUPPORTED
    if (installed) {
        recording = 0;
        /* the resolved functions, never the lazy-binding stub that was there before */
        write_slot(slot_memalign, (void *)real_memalign, &found);
        write_slot(slot_free, (void *)real_free, &found);
        installed = 0;
    }
#endif
    Py_RETURN_NONE;
}

static PyObject *py_start(PyObject *self, PyObject *args) {
    Py_ssize_t cap;
    if (!PyArg_ParseTuple(args, "n", &cap)) return NULL;
#if TK_SUPPORTED
    if (cap < 1) cap = 1;
    Event *buf = malloc((size_t)cap * sizeof(Event));
    if (!buf) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&lock);
    free(events);
    events = buf;
    capacity = (size_t)cap;
    total = drained = 0;
    free(table);
    table = NULL;
    table_cap = table_used = table_live = 0;
    table_grow();
    recording = installed;
    pthread_mutex_unlock(&lock);
    Py_END_ALLOW_THREADS
#endif
    Py_RETURN_NONE;
}

static PyObject *py_stop(PyObject *self, PyObject *noargs) {
#if TK_SUPPORTED
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&lock);
    recording = 0;
    pthread_mutex_unlock(&lock);
    Py_END_ALLOW_THREADS
#endif
    Py_RETURN_NONE;
}

static PyObject *py_release(PyObject *self, PyObject *noargs) {
    /* drop the buffers (after stop and the last drain) */
#if TK_SUPPORTED
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&lock);
    if (!recording) {
        free(events);
        events = NULL;
        capacity = 0;
        free(table);
        table = NULL;
        table_cap = table_used = table_live = 0;
    }
    pthread_mutex_unlock(&lock);
    Py_END_ALLOW_THREADS
#endif
    Py_RETURN_NONE;
}

static PyObject *py_track(PyObject *self, PyObject *args) {
    /* track(bytes of (uint64 ptr, int64 size) pairs): storages alive now whose frees we record */
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "y*", &view)) return NULL;
#if TK_SUPPORTED
    const uint64_t *pairs = (const uint64_t *)view.buf;
    Py_ssize_t n = view.len / 16;
    pthread_mutex_lock(&lock);
    if (table_cap)
        for (Py_ssize_t i = 0; i < n; i++)
            if (pairs[2 * i] > TOMB && (int64_t)pairs[2 * i + 1] > 0) table_put(pairs[2 * i], (int64_t)pairs[2 * i + 1]);
    pthread_mutex_unlock(&lock);
#endif
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *py_mark(PyObject *self, PyObject *noargs) {
#if TK_SUPPORTED
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&total, __ATOMIC_ACQUIRE));
#else
    return PyLong_FromLong(0);
#endif
}

static PyObject *py_drain(PyObject *self, PyObject *noargs) {
    /* (bytes of events (int64 t, uint64 ptr, int64 size) since the last drain, index of the first, dropped) */
#if TK_SUPPORTED
    PyObject *out = NULL;
    uint64_t first, n, dropped = 0;
    pthread_mutex_lock(&lock);
    first = drained;
    n = total - drained;
    if (n > capacity) {  /* the ring wrapped: the oldest were overwritten */
        dropped = n - capacity;
        first += dropped;
        n = capacity;
    }
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * sizeof(Event)));
    if (out) {
        char *dst = PyBytes_AS_STRING(out);
        for (uint64_t i = 0; i < n; i++)
            memcpy(dst + i * sizeof(Event), &events[(first + i) % capacity], sizeof(Event));
        drained = total;
    }
    pthread_mutex_unlock(&lock);
    if (!out) return NULL;
    return Py_BuildValue("(NKK)", out, (unsigned long long)first, (unsigned long long)dropped);
#else
    return Py_BuildValue("(y#ii)", "", (Py_ssize_t)0, 0, 0);
#endif
}

static PyObject *py_state(PyObject *self, PyObject *noargs) {
#if TK_SUPPORTED
    return Py_BuildValue("{s:i,s:i,s:K,s:n,s:n}", "installed", installed, "recording", recording,
                         "total", (unsigned long long)total, "capacity", (Py_ssize_t)capacity,
                         "tracked", (Py_ssize_t)table_live);
#else
    return Py_BuildValue("{s:i}", "installed", 0);
#endif
}


/* -- the op log's hot path (oplog.py): one torch call logged, in C --------------------------------
 *
 * `Core.call(func, args, kwargs)` is what the op log's __torch_function__ does for every torch call made
 * from Python (after asking torch.compiler.is_compiling(), which must stay in Python): skip what is not
 * logged, walk the caller's frames up to the running module's frame, intern the stack, note the
 * allocation hook's event index and the autograd sequence number before and after, call the function,
 * and append one row of 12 int64 (k0, k1, t0, t1, stack, module, s0, s1, parent, cid, op, container).
 * The Python version (oplog.py) does the same, slower; this one exists because the cost of each call is
 * the recorder's cost on a step made of many small ops.
 */
#include <structmember.h>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define TK_POSIX 1
#endif

static int core_forked = 0;
static PyTypeObject *method_wrapper_type = NULL;  /* type(object().__str__): a property's __get__ / __set__ */
#if TK_POSIX
static void core_after_fork(void) { core_forked = 1; }
#endif

#define NCOLS 12

typedef struct {
    PyObject_HEAD
    int on, busy, use_mark, timed;
    unsigned long thread;
    PyObject *special;   /* dict: func -> 1 (not logged) or 2 (a backward call) */
    PyObject *mods;      /* list of (path id, anchor frame, stack above it, id(module)); innermost last */
    PyObject *ids;       /* dict: parts tuple -> stack id (StackTable._ids) */
    PyObject *parts;     /* list: stack id -> parts tuple (StackTable._parts) */
    PyObject *get_seq;   /* torch._C._autograd._get_sequence_nr */
    PyObject *setter;    /* CUDA: the allocator's metadata setter, or None */
    PyObject *md_base;   /* str */
    int md_active;
    int op_names;
    PyObject *op_ids;    /* dict: func -> op id (op_names) */
    PyObject *op_funcs;  /* list: op id -> func */
    PyObject *on_full;
    long long calls, container;
    Py_ssize_t limit;
    int64_t *rows;
    Py_ssize_t nrows, caprows;
} Core;

static int64_t core_mark(Core *c) {
#if TK_SUPPORTED
    if (c->use_mark) return (int64_t)__atomic_load_n(&total, __ATOMIC_ACQUIRE);
#endif
    (void)c;
    return 0;
}

static int64_t core_now(Core *c) {
    if (!c->timed) return 0;
    struct timespec ts;
#if defined(_WIN32)
    timespec_get(&ts, TIME_UTC);  /* the clock of time.time_ns() */
#else
    clock_gettime(CLOCK_REALTIME, &ts);
#endif
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int64_t core_seq(Core *c) {
    PyObject *r = PyObject_CallNoArgs(c->get_seq);
    if (!r) { PyErr_Clear(); return -1; }
    long long v = PyLong_AsLongLong(r);
    Py_DECREF(r);
    if (v == -1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
    return v;
}

static int core_push_row(Core *c, const int64_t *row) {
    if (c->nrows >= c->caprows) {
        Py_ssize_t cap = c->caprows ? c->caprows * 2 : 4096;
        int64_t *r = PyMem_Realloc(c->rows, (size_t)cap * NCOLS * sizeof(int64_t));
        if (!r) return -1;
        c->rows = r;
        c->caprows = cap;
    }
    memcpy(c->rows + c->nrows * NCOLS, row, NCOLS * sizeof(int64_t));
    c->nrows++;
    return 0;
}

static int core_set_md(Core *c, long long cid) {
    if (!c->md_active || c->setter == NULL || c->setter == Py_None) return 0;
    PyObject *s = cid >= 0 ? PyUnicode_FromFormat("%U:op=%lld", c->md_base, cid) : (Py_INCREF(c->md_base), c->md_base);
    if (!s) return -1;
    PyObject *r = PyObject_CallOneArg(c->setter, s);
    Py_DECREF(s);
    if (!r) { PyErr_Clear(); return 0; }  /* never fail the user's call over the metadata */
    Py_DECREF(r);
    return 0;
}

static int frame_lasti(PyFrameObject *f) {
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetLasti(f);
#else
    PyObject *v = PyObject_GetAttrString((PyObject *)f, "f_lasti");
    if (!v) { PyErr_Clear(); return -1; }
    long n = PyLong_AsLong(v);
    Py_DECREF(v);
    return (int)n;
#endif
}

/* The interned stack of `f` outwards, up to the innermost running module's frame (then the stack interned
 * when that module began is the parent). Returns the stack id, or -1 with an exception set. */
static long long core_stack(Core *c, PyFrameObject *f, long long *module) {
    Py_ssize_t n = PyList_GET_SIZE(c->mods);
    PyObject *top = n ? PyList_GET_ITEM(c->mods, n - 1) : NULL;
    PyObject *anchor = NULL;
    long long above = 0;
    *module = 0;
    if (top && PyTuple_Check(top) && PyTuple_GET_SIZE(top) >= 3) {
        *module = PyLong_AsLongLong(PyTuple_GET_ITEM(top, 0));
        anchor = PyTuple_GET_ITEM(top, 1);
        above = PyLong_AsLongLong(PyTuple_GET_ITEM(top, 2));
        if (PyErr_Occurred()) return -1;
    }
    PyObject *items[256];
    Py_ssize_t k = 0;
    long long parent = 0;
    PyObject *list = NULL;  /* used past 256 frames */
    Py_XINCREF(f);
    while (f != NULL) {
        PyCodeObject *code = PyFrame_GetCode(f);
        PyObject *lasti = PyLong_FromLong(frame_lasti(f));
        if (!lasti) { Py_DECREF(code); Py_DECREF(f); goto fail; }
        if (k + 2 > 256 && list == NULL) {
            list = PyList_New(0);
            if (!list) { Py_DECREF(code); Py_DECREF(lasti); Py_DECREF(f); goto fail; }
            for (Py_ssize_t i = 0; i < k; i++) { PyList_Append(list, items[i]); Py_DECREF(items[i]); }
            k = 0;
        }
        if (list) {
            PyList_Append(list, (PyObject *)code);
            PyList_Append(list, lasti);
            Py_DECREF(code);
            Py_DECREF(lasti);
        } else {
            items[k++] = (PyObject *)code;
            items[k++] = lasti;
        }
        if ((PyObject *)f == anchor) {
            parent = above;
            Py_DECREF(f);
            break;
        }
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    PyObject *p = PyLong_FromLongLong(parent);
    if (!p) goto fail;
    PyObject *key;
    if (list) {
        PyList_Append(list, p);
        Py_DECREF(p);
        key = PyList_AsTuple(list);
        Py_CLEAR(list);
        if (!key) return -1;
    } else {
        key = PyTuple_New(k + 1);
        if (!key) { Py_DECREF(p); goto fail; }
        for (Py_ssize_t i = 0; i < k; i++) PyTuple_SET_ITEM(key, i, items[i]);
        PyTuple_SET_ITEM(key, k, p);
        k = 0;
    }
    PyObject *id = PyDict_GetItemWithError(c->ids, key);  /* borrowed */
    long long out;
    if (id) {
        out = PyLong_AsLongLong(id);
    } else {
        if (PyErr_Occurred()) { Py_DECREF(key); return -1; }
        out = PyList_GET_SIZE(c->parts);
        PyObject *v = PyLong_FromLongLong(out);
        if (!v || PyDict_SetItem(c->ids, key, v) < 0 || PyList_Append(c->parts, key) < 0) {
            Py_XDECREF(v);
            Py_DECREF(key);
            return -1;
        }
        Py_DECREF(v);
    }
    Py_DECREF(key);
    return out;
fail:
    for (Py_ssize_t i = 0; i < k; i++) Py_DECREF(items[i]);
    Py_XDECREF(list);
    return -1;
}

static PyObject *core_call(Core *c, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "call(func, args, kwargs)"); return NULL; }
    PyObject *func = argv[0], *args = argv[1], *kwargs = argv[2];
    if (kwargs == Py_None) kwargs = NULL;
    if (!PyTuple_Check(args)) { PyErr_SetString(PyExc_TypeError, "args must be a tuple"); return NULL; }
    long kind = 0;
    if (Py_TYPE(func) == method_wrapper_type) {
        kind = 1;  /* a property read or write (x.shape, p.grad = None) */
    } else {
        PyObject *k = PyDict_GetItemWithError(c->special, func);
        if (k) kind = PyLong_AsLong(k);
        else if (PyErr_Occurred()) PyErr_Clear();
    }
    if (kind == 1 || !c->on || c->busy || core_forked || PyThread_get_thread_ident() != c->thread)
        return PyObject_Call(func, args, kwargs);
    long long cid = c->calls++;
    long long module = 0;
    PyFrameObject *here = PyEval_GetFrame();  /* borrowed: the __torch_function__ frame */
    PyFrameObject *caller = here ? PyFrame_GetBack(here) : NULL;
    long long stack = core_stack(c, caller, &module);
    Py_XDECREF(caller);
    if (stack < 0) { PyErr_Clear(); stack = 0; }  /* never fail the user's call over the log */
    long long parent = c->container;
    int container = kind == 2;
    long long op = -1;
    if (c->op_names) {
        PyObject *o = PyDict_GetItemWithError(c->op_ids, func);
        if (o) op = PyLong_AsLongLong(o);
        else {
            PyErr_Clear();
            op = PyList_GET_SIZE(c->op_funcs);
            PyObject *v = PyLong_FromLongLong(op);
            if (!v || PyDict_SetItem(c->op_ids, func, v) < 0 || PyList_Append(c->op_funcs, func) < 0) {
                PyErr_Clear();
                op = -1;
            }
            Py_XDECREF(v);
        }
    }
    core_set_md(c, cid);
    int64_t row[NCOLS];
    row[8] = parent;
    row[9] = cid;
    row[10] = op;
    row[11] = container;
    row[4] = stack;
    row[5] = module;
    row[6] = core_seq(c);
    row[2] = core_now(c);
    row[0] = core_mark(c);
    if (container) c->container = cid;  /* the engine's Python (hooks, recomputation) is logged inside it */
    PyObject *result = PyObject_Call(func, args, kwargs);
    row[1] = core_mark(c);
    row[3] = core_now(c);
    if (container) c->container = parent;
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    core_set_md(c, parent);
    row[7] = core_seq(c);
    if (core_push_row(c, row) == 0 && c->nrows >= c->limit && c->on_full && c->on_full != Py_None) {
        c->busy++;
        PyObject *r = PyObject_CallNoArgs(c->on_full);
        c->busy--;
        if (r) Py_DECREF(r); else PyErr_Clear();
    }
    PyErr_Restore(et, ev, etb);
    return result;
}

static PyObject *core_append(Core *c, PyObject *row) {
    /* a row made in Python (the op log's slow path) */
    int64_t r[NCOLS];
    if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != NCOLS) {
        PyErr_SetString(PyExc_TypeError, "a row is a tuple of 12 ints");
        return NULL;
    }
    for (int i = 0; i < NCOLS; i++) {
        r[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(row, i));
        if (r[i] == -1 && PyErr_Occurred()) return NULL;
    }
    if (core_push_row(c, r) < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *core_take(Core *c, PyObject *noargs) {
    PyObject *out = PyBytes_FromStringAndSize((const char *)c->rows, c->nrows * NCOLS * (Py_ssize_t)sizeof(int64_t));
    if (!out) return NULL;
    c->nrows = 0;
    if (c->caprows > (1 << 16)) {  /* give a big buffer back */
        PyMem_Free(c->rows);
        c->rows = NULL;
        c->caprows = 0;
    }
    return out;
}

static PyObject *core_len(Core *c, PyObject *noargs) { return PyLong_FromSsize_t(c->nrows); }

static PyObject *core_stack_of(Core *c, PyObject *frame) {
    /* stack_of(frame): the interned stack of `frame` outwards (as the op log's _stack) */
    if (!PyFrame_Check(frame)) { PyErr_SetString(PyExc_TypeError, "a frame"); return NULL; }
    long long module;
    long long k = core_stack(c, (PyFrameObject *)frame, &module);
    if (k < 0) return NULL;
    return PyLong_FromLongLong(k);
}

static int core_init(Core *c, PyObject *args, PyObject *kw) {
    static char *names[] = {"special", "mods", "ids", "parts", "get_seq", "use_mark", "timed", NULL};
    PyObject *special, *mods, *ids, *parts, *get_seq;
    int use_mark = 0, timed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!O!O!O|pp", names, &PyDict_Type, &special, &PyList_Type, &mods,
                                     &PyDict_Type, &ids, &PyList_Type, &parts, &get_seq, &use_mark, &timed))
        return -1;
    Py_INCREF(special); Py_XSETREF(c->special, special);
    Py_INCREF(mods); Py_XSETREF(c->mods, mods);
    Py_INCREF(ids); Py_XSETREF(c->ids, ids);
    Py_INCREF(parts); Py_XSETREF(c->parts, parts);
    Py_INCREF(get_seq); Py_XSETREF(c->get_seq, get_seq);
    Py_INCREF(Py_None); Py_XSETREF(c->setter, Py_None);
    Py_XSETREF(c->md_base, PyUnicode_FromString(""));
    Py_XSETREF(c->op_ids, PyDict_New());
    Py_XSETREF(c->op_funcs, PyList_New(0));
    Py_INCREF(Py_None); Py_XSETREF(c->on_full, Py_None);
    if (!c->md_base || !c->op_ids || !c->op_funcs) return -1;
    c->use_mark = use_mark;
    c->timed = timed;
    c->thread = PyThread_get_thread_ident();
    c->container = -1;
    c->limit = PY_SSIZE_T_MAX;
    return 0;
}

static int core_traverse(Core *c, visitproc visit, void *arg) {
    Py_VISIT(c->special); Py_VISIT(c->mods); Py_VISIT(c->ids); Py_VISIT(c->parts); Py_VISIT(c->get_seq);
    Py_VISIT(c->setter); Py_VISIT(c->md_base); Py_VISIT(c->op_ids); Py_VISIT(c->op_funcs); Py_VISIT(c->on_full);
    return 0;
}

static int core_clear(Core *c) {
    Py_CLEAR(c->special); Py_CLEAR(c->mods); Py_CLEAR(c->ids); Py_CLEAR(c->parts); Py_CLEAR(c->get_seq);
    Py_CLEAR(c->setter); Py_CLEAR(c->md_base); Py_CLEAR(c->op_ids); Py_CLEAR(c->op_funcs); Py_CLEAR(c->on_full);
    return 0;
}

static void core_dealloc(Core *c) {
    PyObject_GC_UnTrack(c);
    core_clear(c);
    PyMem_Free(c->rows);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyObject *core_get_obj(Core *c, void *which) {
    PyObject *v = NULL;
    switch ((intptr_t)which) {
        case 0: v = c->setter; break;
        case 1: v = c->md_base; break;
        case 2: v = c->on_full; break;
        case 3: v = c->op_funcs; break;
    }
    if (!v) v = Py_None;
    Py_INCREF(v);
    return v;
}

static int core_set_obj(Core *c, PyObject *v, void *which) {
    if (!v) { PyErr_SetString(PyExc_AttributeError, "cannot delete"); return -1; }
    if ((intptr_t)which == 1 && !PyUnicode_Check(v)) { PyErr_SetString(PyExc_TypeError, "md_base is a str"); return -1; }
    Py_INCREF(v);
    switch ((intptr_t)which) {
        case 0: Py_XSETREF(c->setter, v); break;
        case 1: Py_XSETREF(c->md_base, v); break;
        case 2: Py_XSETREF(c->on_full, v); break;
        default: Py_DECREF(v); PyErr_SetString(PyExc_AttributeError, "read-only"); return -1;
    }
    return 0;
}

static PyGetSetDef core_getset[] = {
    {"setter", (getter)core_get_obj, (setter)core_set_obj, NULL, (void *)0},
    {"md_base", (getter)core_get_obj, (setter)core_set_obj, NULL, (void *)1},
    {"on_full", (getter)core_get_obj, (setter)core_set_obj, NULL, (void *)2},
    {"op_funcs", (getter)core_get_obj, NULL, NULL, (void *)3},
    {NULL},
};

static PyMemberDef core_members[] = {
    {"on", T_INT, offsetof(Core, on), 0, NULL},
    {"busy", T_INT, offsetof(Core, busy), 0, NULL},
    {"md_active", T_INT, offsetof(Core, md_active), 0, NULL},
    {"op_names", T_INT, offsetof(Core, op_names), 0, NULL},
    {"calls", T_LONGLONG, offsetof(Core, calls), 0, NULL},
    {"container", T_LONGLONG, offsetof(Core, container), 0, NULL},
    {"limit", T_PYSSIZET, offsetof(Core, limit), 0, NULL},
    {NULL},
};

static PyMethodDef core_methods[] = {
    {"call", (PyCFunction)(void (*)(void))core_call, METH_FASTCALL, "call(func, args, kwargs): run it, logged"},
    {"append", (PyCFunction)core_append, METH_O, "append(row): a row made in Python"},
    {"take", (PyCFunction)core_take, METH_NOARGS, "the rows so far as bytes of int64 (n x 12); emptied"},
    {"rows", (PyCFunction)core_len, METH_NOARGS, "rows not yet taken"},
    {"stack_of", (PyCFunction)core_stack_of, METH_O, "stack_of(frame): the interned stack id of frame outwards"},
    {NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tracekit.record._cpuhook.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)core_init,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_methods = core_methods,
    .tp_members = core_members,
    .tp_getset = core_getset,
};

static PyMethodDef methods[] = {
    {"install", py_install, METH_VARARGS, "install(library_suffix) -> None, or why not (str)"},
    {"uninstall", py_uninstall, METH_NOARGS, "put libc10's jump slots back"},
    {"start", py_start, METH_VARARGS, "start(capacity): record into a fresh ring of `capacity` events"},
    {"stop", py_stop, METH_NOARGS, "stop recording (drain what is left)"},
    {"release", py_release, METH_NOARGS, "free the buffers once stopped"},
    {"track", py_track, METH_VARARGS, "track(bytes of (ptr, size) pairs): record the frees of these storages"},
    {"mark", py_mark, METH_NOARGS, "index of the next event"},
    {"drain", py_drain, METH_NOARGS, "(events bytes, index of the first, dropped)"},
    {"state", py_state, METH_NOARGS, "a dict for tests"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpuhook", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpuhook(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    {
        PyObject *o = PyObject_GetAttrString((PyObject *)&PyBaseObject_Type, "__str__");  /* a slot wrapper */
        PyObject *inst = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
        PyObject *bound = inst ? PyObject_GetAttrString(inst, "__str__") : NULL;  /* a method-wrapper */
        if (!bound) { Py_XDECREF(o); Py_XDECREF(inst); return NULL; }
        method_wrapper_type = Py_TYPE(bound);
        Py_INCREF(method_wrapper_type);
        Py_DECREF(bound);
        Py_DECREF(inst);
        Py_XDECREF(o);
    }
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
#if TK_POSIX
    pthread_atfork(NULL, NULL, core_after_fork);
#endif
    return m;
}
