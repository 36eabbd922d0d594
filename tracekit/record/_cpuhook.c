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

PyMODINIT_FUNC PyInit__cpuhook(void) { return PyModule_Create(&module); }
