/* The CPU sampler's steps that take many small numpy and torch calls (executor/sampler.py), each
 * in one compiled call. finite_scaled() flags the rows holding a NaN or an infinity and divides the
 * others by their temperature in one pass (IEEE division: torch's quotients to the bit), where torch
 * took a sum, a finite check, a fill and a division.
 *
 * The first round of a top-k / top-p draw (_draw_candidates) takes two calls instead of about
 * thirty numpy operations: gather() finds each row's candidates, the caller
 * exponentiates them with torch (so that the probabilities are torch's to the last bit, as a
 * device's draw computes them), and pick() holds them to the floor, decides whether they hold the
 * row's nucleus, sorts them and draws. Every step is the numpy round's, in the same float32
 * operations and float64 sums (built with -ffp-contract=off, so that no multiply and add fuse):
 * tests/executor/test_sampler.py holds the two to the same tokens. Rows it cannot decide (more
 * candidates than the caller's room, or a nucleus wider than them) are left to numpy's later rounds.
 *
 * sample_rows() draws, in one call, every row of a batch that no logits processing touches (the
 * caller marks the others): per row one pass for the finite check, the largest logit and its first
 * column, one that sums the exponentials (with the candidates of a top-k / top-p row, or the block
 * sums of a plain one, gathered in the same pass), the draw, and for a row that wants alternatives
 * one more pass that keeps its most likely tokens, with no table of logprobs written; a cut row
 * its candidates do not decide is drawn among all its tokens (change 86). Its exponential is its own (exp_lanes), so its logprobs are torch's
 * log_softmax to float32 rounding, not to the bit, and its tokens those of the passes above except
 * where a uniform or a top-p cut falls within that rounding of a token's edge
 * (docs/control_plane.md, change 83).
 *
 * Each call releases the GIL, so that the executor's link thread can stage the next step meanwhile
 * (sample_rows() only over enough logits to pay for taking it back). sample_rows() draws a large
 * batch's rows on the caller's thread and on helper threads of its own, one a CPU the process may
 * run on at most (between two forwards the forward's threads sit idle, and the other ranks of a
 * group wait for rank 0's sample): a row's draw depends on that row alone, so which thread draws
 * it changes nothing. */

#define _GNU_SOURCE /* sched_getcpu, CPU_* and pthread_setaffinity_np */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if FLT_EVAL_METHOD != 0
#error "float arithmetic here must round to float32 at every step (x87's excess precision does not)"
#endif
#ifdef __FAST_MATH__
#error "built with -ffast-math (-Ofast in CFLAGS?): it reorders the float64 sums numpy takes in order"
#endif

/* sample_rows() gives up the GIL only over this many logits or more (~50 us of work): taking it
 * back from a thread that ran Python meanwhile cost more than a small batch's whole draw. */
#define RELEASE_GIL_ELEMENTS (1 << 15)
/* ...and is drawn by several threads over this many (two rows of a 32k vocabulary; ~80 us alone),
 * where a helper's wake-up (tens of microseconds across cores) is paid back. */
#define PARALLEL_ELEMENTS (1 << 16)

/* The interface executor/sampler.py expects (_SAMPLING_INTERFACE): raised with every change of a
 * call's arguments or meaning, so that a build of an older source is not used. */
#define INTERFACE 7

typedef struct {
    float prob;
    int32_t id;
} Candidate;

/* Whether a goes before b: descending probability, ties in id order (numpy's stable argsort of the
 * negated probabilities of candidates listed in id order). */
static inline int goes_first(Candidate a, Candidate b) {
    return a.prob > b.prob || (a.prob == b.prob && a.id < b.id);
}

/* Whole-vocabulary passes in GCC's vector types (VECTOR floats at once, lowered to the widest
 * instructions of each clone, chosen at load), since the compiler does not vectorize the selects
 * and early exits below from plain loops. */
#define VECTOR 16
#if defined(__x86_64__) || defined(__i386__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif
typedef float floats __attribute__((vector_size(VECTOR * sizeof(float))));
typedef int32_t ints __attribute__((vector_size(VECTOR * sizeof(float))));

/* An unaligned load; a macro, since a function returning a vector would take the default
 * clone's calling convention. */
#define LOAD(v, at) memcpy(&(v), (at), sizeof(v))

/* Whether any lane of a comparison's mask is set; a macro, as LOAD is. */
#define ANY_LANE(out, mask)                                 \
    do {                                                    \
        int32_t any_ = 0;                                   \
        for (int i_ = 0; i_ < VECTOR; i_++) any_ |= (mask)[i_]; \
        (out) = any_;                                       \
    } while (0)

/* A NaN or an infinity: its exponent bits are all ones. */
static inline int not_finite(const float *x) {
    uint32_t bits;
    memcpy(&bits, x, sizeof bits);
    return (bits & 0x7f800000u) == 0x7f800000u;
}

/* The row's largest value. Exact in any order: a row here holds no NaN (non-finite rows were
 * zeroed before log_softmax). */
CLONES static float row_max(const float *row, Py_ssize_t vocab) {
    float top = row[0];
    Py_ssize_t j = 0;
    if (vocab >= VECTOR) {
        floats lanes, x;
        LOAD(lanes, row);
        for (j = VECTOR; j + VECTOR <= vocab; j += VECTOR) {
            LOAD(x, row + j);
            ints above = x > lanes;
            lanes = (floats)(((ints)x & above) | ((ints)lanes & ~above));
        }
        for (int i = 0; i < VECTOR; i++) top = lanes[i] > top ? lanes[i] : top;
    }
    for (; j < vocab; j++) top = row[j] > top ? row[j] : top;
    return top;
}

/* The columns at or above `threshold`, in id order, into ids and values; -1 when more than room.
 * A peaked row has a few such columns in tens of thousands: spans of CHUNK columns are compared
 * whole and looked into only where one holds any. */
#define CHUNK (16 * VECTOR)
CLONES static Py_ssize_t at_or_above(const float *row, Py_ssize_t vocab, float threshold, Py_ssize_t room, int32_t *ids, float *values) {
    Py_ssize_t n = 0;
    for (Py_ssize_t j = 0; j < vocab; j += CHUNK) {
        Py_ssize_t end = j + CHUNK <= vocab ? j + CHUNK : vocab;
        if (end - j == CHUNK) {
            ints hit = (ints){};
            for (Py_ssize_t c = j; c < end; c += VECTOR) {
                floats x;
                LOAD(x, row + c);
                hit |= x >= threshold;
            }
            int32_t any;
            ANY_LANE(any, hit);
            if (!any) continue;
        }
        for (Py_ssize_t c = j; c < end; c++) {
            if (row[c] >= threshold) {
                if (n == room) return -1;
                ids[n] = (int32_t)c;
                values[n] = row[c];
                n++;
            }
        }
    }
    return n;
}

/* Whether a row holds no NaN and no infinity (its exponent bits are all ones only there); with
 * `out`, the row divided by its temperature as well, in the same pass: IEEE division, each
 * quotient correctly rounded, as torch's. */
CLONES static int row_finite_scaled(const float *row, Py_ssize_t vocab, float temperature, float *out) {
    const ints exponent = (ints){} + 0x7f800000;
    ints bad = (ints){};
    Py_ssize_t j = 0;
    for (; j + VECTOR <= vocab; j += VECTOR) {
        floats x;
        LOAD(x, row + j);
        bad |= ((ints)x & exponent) == exponent;
        if (out) {
            floats q = x / temperature;
            memcpy(out + j, &q, sizeof q);
        }
    }
    int32_t any;
    ANY_LANE(any, bad);
    for (; j < vocab; j++) {
        any |= not_finite(row + j);
        if (out) out[j] = row[j] / temperature;
    }
    return !any;
}

/* A C-contiguous buffer of at least `at_least` items of `kind`: 'f' float32, 'i' a signed integer or
 * 'u' an unsigned one (bool included), `itemsize` bytes each. */
static int buffer_of(PyObject *obj, Py_buffer *view, int writable, char kind, Py_ssize_t itemsize, Py_ssize_t at_least, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    const char *format = view->format ? view->format : "B";
    const uint16_t one = 1;
    const char native = *(const uint8_t *)&one ? '<' : '>';
    if (format[0] == '@' || format[0] == '=' || format[0] == native) format++;  /* '>' or '!' on this host: another byte order */
    int right = format[0] != '\0' && format[1] == '\0' && strchr(kind == 'f' ? "f" : kind == 'i' ? "bhilqn" : "BHILQN?", format[0]) != NULL;
    if (!right || view->itemsize != itemsize || at_least > view->len / itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected at least %zd items of %c%zd bytes", name, at_least, kind, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* A float32 buffer of whole rows of `vocab` (released again where it is not): its row count, or
 * -1 with an error set. */
static Py_ssize_t rows_of(PyObject *obj, Py_buffer *view, Py_ssize_t vocab, const char *name) {
    if (buffer_of(obj, view, 0, 'f', sizeof(float), 0, name) < 0) return -1;
    Py_ssize_t rows = view->len / (Py_ssize_t)sizeof(float) / vocab;
    if (rows * vocab * (Py_ssize_t)sizeof(float) != view->len) {
        PyErr_Format(PyExc_ValueError, "%s does not hold whole rows of %zd", name, vocab);
        PyBuffer_Release(view);
        return -1;
    }
    return rows;
}

/* sample_rows' logits: a float32 buffer of whole rows (rows_of), or (address, rows) of a contiguous
 * float32[rows, vocab] tensor that the caller holds through the call. A torch tensor has no buffer
 * interface, and the numpy view of it, made each step, cost 50-90 us between two forwards right
 * after the CPU came back from a halt, where its address costs a few (docs/control_plane.md,
 * change 110). `view` is then a bare one, which PyBuffer_Release leaves alone. */
static Py_ssize_t logits_rows(PyObject *obj, Py_buffer *view, Py_ssize_t vocab, const char *name) {
    if (!PyTuple_Check(obj)) return rows_of(obj, view, vocab, name);
    Py_ssize_t address, rows;
    if (!PyArg_ParseTuple(obj, "nn", &address, &rows)) return -1;
    Py_ssize_t most = PY_SSIZE_T_MAX / vocab / (Py_ssize_t)sizeof(float);
    if (rows < 0 || rows > most) return PyErr_Format(PyExc_ValueError, "%s: %zd rows, not 0 to %zd", name, rows, most), -1;
    /* An empty tensor's address is 0 (a step that samples no row): nothing is read from it. */
    if (address < 0 || (address == 0 && rows > 0))
        return PyErr_Format(PyExc_ValueError, "%s: address %zd for %zd rows", name, address, rows), -1;
    memset(view, 0, sizeof(*view));
    view->buf = (void *)address;
    view->len = rows * vocab * (Py_ssize_t)sizeof(float);
    return rows;
}

/* gather(log_probs, vocab, log_ratio, margin, room, ids, values, counts) -> total
 *
 * log_probs: float32[rows, vocab]. A row's candidates are its columns at or above
 * (its largest + log_ratio) - margin, in id order: their ids go to ids and their logprobs to values,
 * packed row after row; counts[row] is how many, or -1 for a row with more than `room` (none
 * stored). After the `total` stored come the rows' largest logprobs, one a row, so that one
 * torch.exp gives the floors' probabilities too. ids holds rows * room, values rows * (room + 1). */
static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *lp_obj, *ids_obj, *values_obj, *counts_obj;
    Py_ssize_t vocab, room;
    float log_ratio, margin;
    if (!PyArg_ParseTuple(args, "OnffnOOO", &lp_obj, &vocab, &log_ratio, &margin, &room, &ids_obj, &values_obj, &counts_obj)) return NULL;
    if (vocab <= 0 || room <= 0 || room > vocab) return PyErr_Format(PyExc_ValueError, "vocab must be positive, room in 1 to vocab");
    Py_buffer lp, ids, values, counts;
    Py_ssize_t rows = rows_of(lp_obj, &lp, vocab, "log_probs");
    if (rows < 0) return NULL;
    /* rows * vocab floats fit in memory, and room <= vocab: neither product overflows */
    if (buffer_of(ids_obj, &ids, 1, 'i', sizeof(int32_t), rows * room, "ids") < 0) goto fail_ids;
    if (buffer_of(values_obj, &values, 1, 'f', sizeof(float), rows * (room + 1), "values") < 0) goto fail_values;
    if (buffer_of(counts_obj, &counts, 1, 'i', sizeof(int64_t), rows, "counts") < 0) goto fail_counts;

    Py_ssize_t total = 0;
    Py_BEGIN_ALLOW_THREADS
    int32_t *id_out = ids.buf;
    float *value_out = values.buf;
    int64_t *count_out = counts.buf;
    float *tops = value_out + rows * room; /* moved down to follow the candidates at the end */
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *row = (const float *)lp.buf + r * vocab;
        float top = row_max(row, vocab);
        float floor = top + log_ratio; /* numpy's float32 floor, then its margin */
        Py_ssize_t n = at_or_above(row, vocab, floor - margin, room, id_out + total, value_out + total);
        count_out[r] = n;
        if (n > 0) total += n;
        tops[r] = top;
    }
    for (Py_ssize_t r = 0; r < rows; r++) value_out[total + r] = tops[r]; /* total <= rows * room: never ahead of its source */
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&counts);
    PyBuffer_Release(&values);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&lp);
    return PyLong_FromSsize_t(total);

fail_counts:
    PyBuffer_Release(&values);
fail_values:
    PyBuffer_Release(&ids);
fail_ids:
    PyBuffer_Release(&lp);
    return NULL;
}

/* finite_scaled(logits, vocab, temperature, out, finite) -> rows not finite
 *
 * logits: float32[rows, vocab]. finite[row] (uint8) says whether the row holds no NaN and no
 * infinity. With `out` (float32[rows, vocab], or None for no division), each finite row divided by
 * its temperature, and every other row zeros, as _sample_on_host's torch passes make them. */
static PyObject *finite_scaled(PyObject *self, PyObject *args) {
    PyObject *logits_obj, *t_obj, *out_obj, *finite_obj;
    Py_ssize_t vocab;
    if (!PyArg_ParseTuple(args, "OnOOO", &logits_obj, &vocab, &t_obj, &out_obj, &finite_obj)) return NULL;
    if (vocab <= 0) return PyErr_Format(PyExc_ValueError, "vocab must be positive");
    Py_buffer logits, temperature, out, finite;
    int dividing = out_obj != Py_None;
    PyObject *result = NULL;
    Py_ssize_t rows = rows_of(logits_obj, &logits, vocab, "logits");
    if (rows < 0) return NULL;
    if (buffer_of(t_obj, &temperature, 0, 'f', sizeof(float), rows, "temperature") < 0) goto done_logits;
    if (buffer_of(finite_obj, &finite, 1, 'u', sizeof(uint8_t), rows, "finite") < 0) goto done_temperature;
    if (dividing && buffer_of(out_obj, &out, 1, 'f', sizeof(float), rows * vocab, "out") < 0) goto done_finite;

    Py_ssize_t bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *row = (const float *)logits.buf + r * vocab;
        float *dest = dividing ? (float *)out.buf + r * vocab : NULL;
        int ok = row_finite_scaled(row, vocab, ((const float *)temperature.buf)[r], dest);
        ((uint8_t *)finite.buf)[r] = (uint8_t)ok;
        bad += !ok;
        if (!ok && dest) memset(dest, 0, (size_t)vocab * sizeof(float));
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(bad);

    if (dividing) PyBuffer_Release(&out);
done_finite:
    PyBuffer_Release(&finite);
done_temperature:
    PyBuffer_Release(&temperature);
done_logits:
    PyBuffer_Release(&logits);
    return result;
}

/* heap[at] down to its place in a heap of n whose root is the candidate that goes first */
static void sift_down(Candidate *heap, Py_ssize_t n, Py_ssize_t at) {
    Candidate moving = heap[at];
    for (;;) {
        Py_ssize_t child = 2 * at + 1;
        if (child >= n) break;
        if (child + 1 < n && goes_first(heap[child + 1], heap[child])) child++;
        if (!goes_first(heap[child], moving)) break;
        heap[at] = heap[child];
        at = child;
    }
    heap[at] = moving;
}

static inline uint32_t bits_of(float p) {
    uint32_t bits;
    memcpy(&bits, &p, sizeof bits);
    return bits;
}

/* Candidates in goes_first's order by a stable LSD radix sort of their probabilities' bits (a
 * probability is at least +0, whose bits order as its value), largest first, ties in the order
 * given (id order); a pass whose byte is the same in all is skipped. Returns whichever of c and
 * spare (as long) holds them. */
static Candidate *radix_sorted(Candidate *c, Candidate *spare, Py_ssize_t n) {
    for (int shift = 0; shift < 32; shift += 8) {
        Py_ssize_t at[256] = {0};
        for (Py_ssize_t j = 0; j < n; j++) at[255 - ((bits_of(c[j].prob) >> shift) & 255)]++;
        int one_byte = 0;
        for (int b = 0; b < 256; b++) one_byte |= at[b] == n;
        if (one_byte) continue;
        Py_ssize_t start = 0;
        for (int b = 0; b < 256; b++) {
            Py_ssize_t count = at[b];
            at[b] = start;
            start += count;
        }
        for (Py_ssize_t j = 0; j < n; j++) spare[at[255 - ((bits_of(c[j].prob) >> shift) & 255)]++] = c[j];
        Candidate *sorted = spare;
        spare = c;
        c = sorted;
    }
    return c;
}

/* _pick_sorted's draw among `kept` candidates taken in goes_first's order: the mass before each (a
 * float64 prefix sum rounded to float32, less itself), dropped past top_p, kept within k; then the
 * draw's prefix sum over the kept ones and the first whose sum passes u times the whole. `c` is in
 * order already, or (on_heap) a heap in any order, popped into its own freed tail, so that
 * c[kept - 1 - j] is then the j-th. Either way candidates are taken only until the first one top-k
 * or top-p drops: the mass before a candidate never falls along the order (a rounded prefix sum
 * that never falls, less a probability that never grows), so no later one is kept, and a nucleus
 * of a few among hundreds costs a heap's build and a few pops. `sums` has room for kept. */
static int64_t draw_in_order(Candidate *c, Py_ssize_t kept, int on_heap, int64_t k, float top_p, float uniform, float *sums) {
    if (on_heap) {
        for (Py_ssize_t j = kept / 2; j-- > 0;) sift_down(c, kept, j);
    }
    double before = 0.0, cdf = 0.0;
    Py_ssize_t taken = 0, heap = kept;
    while (taken < kept) {
        Candidate next = c[taken];
        if (on_heap) {
            next = c[0];
            c[0] = c[--heap];
            c[heap] = next;
            sift_down(c, heap, 0);
        }
        float p = next.prob;
        before += (double)p;
        float mass_before = (float)before - p;
        int keep = taken < k && !(top_p < 1.0f && mass_before > top_p);
        cdf += (double)(p * (float)keep);
        sums[taken++] = (float)cdf;
        if (!keep) break;
    }
    float target = uniform * sums[taken - 1];
    Py_ssize_t at = 0;
    while (at < taken && sums[at] <= target) at++;
    if (at < taken) return c[on_heap ? kept - 1 - at : at].id;
    /* numpy's clamp to the last candidate in order (u < 1 keeps every reachable target under the
     * total; a target rounded up to it passes every sum), past the cut: on a heap, the last of
     * those left on it */
    if (!on_heap) return c[kept - 1].id;
    if (taken == kept) return c[0].id;
    Py_ssize_t last = 0;
    for (Py_ssize_t j = 1; j < heap; j++) {
        if (goes_first(c[last], c[j])) last = j;
    }
    return c[last].id;
}

/* From this many candidates a radix sort, where a spare array is given, instead of the heap: a
 * wide nucleus pops most of a heap, at a sift of log2(n) levels each. */
#define RADIX_FROM 1024

/* One row's draw among its candidates (id order, probabilities `probs`), or -1 when they do not
 * hold its nucleus (whole: they are the whole row, which always does). `scratch`, `sums` and
 * `spare` (or NULL: the heap only) have room for all of them. */
static int64_t pick_row(const int32_t *ids, const float *probs, Py_ssize_t n, float floor, int whole, int64_t k, float top_p, float uniform,
                        Candidate *scratch, Candidate *spare, float *sums) {
    Py_ssize_t kept = 0;
    double mass = 0.0;
    for (Py_ssize_t j = 0; j < n; j++) {
        if (probs[j] >= floor) {
            scratch[kept].prob = probs[j] + 0.0f; /* -0 as +0: the radix sort orders bits */
            scratch[kept].id = ids == NULL ? (int32_t)j : ids[j];
            mass += (double)probs[j];
            kept++;
        }
    }
    /* numpy's `covered`: top-k cuts inside the candidates, or they hold more than top_p by more
     * than a float32 prefix sum's rounding (1e-6) */
    if (kept == 0 || !(whole || k <= kept || (top_p < 1.0f && mass > (double)top_p + 1e-6))) return -1;
    if (spare == NULL || kept < RADIX_FROM) return draw_in_order(scratch, kept, 1, k, top_p, uniform, sums);
    return draw_in_order(radix_sorted(scratch, spare, kept), kept, 0, k, top_p, uniform, sums);
}

/* pick(ids, probs, counts, ratio, k, top_p, uniforms, out) -> rows left undecided
 *
 * gather()'s candidates after torch.exp (probs: the candidates' probabilities, then each row's
 * largest); each row's floor is its largest probability times `ratio`. out[row] is the token drawn,
 * or -1 where numpy's later rounds must decide. */
static PyObject *pick(PyObject *self, PyObject *args) {
    PyObject *ids_obj, *probs_obj, *counts_obj, *k_obj, *top_p_obj, *u_obj, *out_obj;
    float ratio;
    if (!PyArg_ParseTuple(args, "OOOfOOOO", &ids_obj, &probs_obj, &counts_obj, &ratio, &k_obj, &top_p_obj, &u_obj, &out_obj)) return NULL;
    Py_buffer counts, ids, probs, k, top_p, u, out;
    if (buffer_of(counts_obj, &counts, 0, 'i', sizeof(int64_t), 0, "counts") < 0) return NULL;
    PyObject *result = NULL;
    if (buffer_of(ids_obj, &ids, 0, 'i', sizeof(int32_t), 0, "ids") < 0) goto done_counts;
    Py_ssize_t rows = counts.len / (Py_ssize_t)sizeof(int64_t), total = 0, widest = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        int64_t n = ((int64_t *)counts.buf)[r];
        if (n > ids.len / (Py_ssize_t)sizeof(int32_t) - total) {
            PyErr_Format(PyExc_ValueError, "counts: more candidates than ids holds");
            goto done_ids;
        }
        if (n > 0) total += n;
        if (n > widest) widest = n;
    }
    if (buffer_of(probs_obj, &probs, 0, 'f', sizeof(float), total + rows, "probs") < 0) goto done_ids;
    if (buffer_of(k_obj, &k, 0, 'i', sizeof(int64_t), rows, "k") < 0) goto done_probs;
    if (buffer_of(top_p_obj, &top_p, 0, 'f', sizeof(float), rows, "top_p") < 0) goto done_k;
    if (buffer_of(u_obj, &u, 0, 'f', sizeof(float), rows, "uniforms") < 0) goto done_top_p;
    if (buffer_of(out_obj, &out, 1, 'i', sizeof(int64_t), rows, "out") < 0) goto done_u;

    Candidate *scratch = (Candidate *)malloc((size_t)(widest > 0 ? widest : 1) * sizeof(Candidate));
    Candidate *spare = (Candidate *)malloc((size_t)(widest > 0 ? widest : 1) * sizeof(Candidate));
    float *sums = (float *)malloc((size_t)(widest > 0 ? widest : 1) * sizeof(float));
    if (scratch == NULL || spare == NULL || sums == NULL) {
        free(scratch);
        free(spare);
        free(sums);
        PyErr_NoMemory();
        goto done_out;
    }
    Py_ssize_t undecided = 0;
    Py_BEGIN_ALLOW_THREADS
    const int32_t *id_at = ids.buf;
    const float *prob_at = probs.buf;
    const float *largest = (const float *)probs.buf + total;
    for (Py_ssize_t r = 0; r < rows; r++) {
        int64_t n = ((int64_t *)counts.buf)[r];
        int64_t token = -1;
        if (n > 0) {
            token = pick_row(id_at, prob_at, n, largest[r] * ratio, 0, ((int64_t *)k.buf)[r], ((float *)top_p.buf)[r], ((float *)u.buf)[r], scratch, spare, sums);
            id_at += n;
            prob_at += n;
        }
        ((int64_t *)out.buf)[r] = token;
        undecided += token < 0;
    }
    Py_END_ALLOW_THREADS
    free(scratch);
    free(spare);
    free(sums);
    result = PyLong_FromSsize_t(undecided);

done_out:
    PyBuffer_Release(&out);
done_u:
    PyBuffer_Release(&u);
done_top_p:
    PyBuffer_Release(&top_p);
done_k:
    PyBuffer_Release(&k);
done_probs:
    PyBuffer_Release(&probs);
done_ids:
    PyBuffer_Release(&ids);
done_counts:
    PyBuffer_Release(&counts);
    return result;
}

/* e^x in float32 lanes for x <= 0 (a logit less its row's largest), in place: Cephes' expf, x =
 * n ln2 + r with ln2 in two parts (Cody and Waite), a degree-6 polynomial in r and 2^n put into the
 * exponent; within 2 ulp of the true value, 1 exactly at 0, and 0 below the smallest normal's
 * logarithm (-inf included). Through a pointer, as LOAD is a macro: a vector passed by value would
 * take the default clone's calling convention. */
static inline __attribute__((always_inline)) void exp_lanes(floats *v) {
    floats x = *v;
    const floats lowest = (floats){} - 87.33654475f;
    ints under = x < lowest;
    x = (floats)(((ints)x & ~under) | ((ints)lowest & under));
    /* n = round(x / ln2): adding 1.5 * 2^23 leaves the integer part in the mantissa */
    floats n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    floats r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    floats p = (floats){} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    floats y = p * r * r + r + 1.0f;
    ints two_n = (__builtin_convertvector(n, ints) + 127) << 23;
    *v = (floats)((ints)(y * (floats)two_n) & ~under);
}

/* e^x of n values into out, through the same lanes (the tail padded with -inf, which gives 0). */
CLONES static void exp_of(const float *x, Py_ssize_t n, float *out) {
    for (Py_ssize_t j = 0; j < n; j += VECTOR) {
        floats v = (floats){} - __builtin_inff();
        Py_ssize_t take = n - j < VECTOR ? n - j : VECTOR;
        memcpy(&v, x + j, (size_t)take * sizeof(float));
        exp_lanes(&v);
        memcpy(out + j, &v, (size_t)take * sizeof(float));
    }
}

/* The lanes of a row's columns j..j+VECTOR, divided by t where dividing, less its largest; past
 * vocab, -inf (weight 0). */
#define SHIFTED(v, row, j, vocab, t, dividing, top)                                    \
    do {                                                                                \
        if ((j) + VECTOR <= (vocab)) {                                                  \
            LOAD(v, (row) + (j));                                                       \
        } else {                                                                        \
            v = (floats){} - __builtin_inff();                                          \
            memcpy(&v, (row) + (j), (size_t)((vocab) - (j)) * sizeof(float));           \
        }                                                                               \
        if (dividing) v = v / (t);                                                      \
        v = v - (top);                                                                  \
    } while (0)

/* Whether a row holds no NaN and no infinity, its largest value and the first column that holds
 * it (torch's argmax), read once: each lane keeps its own largest and the first column of it, and
 * of the lanes that hold the row's largest the lowest column is the row's first. */
CLONES static int row_finite_top(const float *row, Py_ssize_t vocab, float *top_out, Py_ssize_t *at_out) {
    const ints exponent = (ints){} + 0x7f800000;
    ints bad = (ints){};
    float top = row[0];
    Py_ssize_t at = 0, j = 0;
    if (vocab >= VECTOR) {
        floats lanes;
        _Static_assert(VECTOR == 16, "one column a lane, listed below");
        ints column = (ints){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, first = column;
        LOAD(lanes, row);
        for (j = 0; j + VECTOR <= vocab; j += VECTOR, column += VECTOR) {
            floats x;
            LOAD(x, row + j);
            bad |= ((ints)x & exponent) == exponent;
            ints above = x > lanes;
            lanes = (floats)(((ints)x & above) | ((ints)lanes & ~above));
            first = (column & above) | (first & ~above);
        }
        top = lanes[0];
        at = first[0];
        for (int i = 1; i < VECTOR; i++) {
            if (lanes[i] > top || (lanes[i] == top && first[i] < at)) {
                top = lanes[i];
                at = first[i];
            }
        }
    }
    int32_t any;
    ANY_LANE(any, bad);
    for (; j < vocab; j++) {
        any |= not_finite(row + j);
        if (row[j] > top) {
            top = row[j];
            at = j;
        }
    }
    *top_out = top;
    *at_out = at;
    return !any;
}

/* The sum of e^(x/t - top) over a row, in float32 lanes of PLAIN_BLOCK columns summed in float64,
 * with, where asked, the sum of each PLAIN_BLOCK columns (blocks) or the columns whose x/t - top is
 * at least `floor` (ids and shifted values, in id order, found in a copy of each block's shifted
 * values where its lanes say one is there). A row with more of those than room ends the pass at
 * once: *count is then -1 and the sum is not made. */
#define PLAIN_BLOCK (16 * VECTOR)
/* How sample_rows draws a row: executor/sampler.py's DRAW_* (a test holds the two equal). */
enum { DRAW_GREEDY, DRAW_PLAIN, DRAW_CUT, DRAW_ELSEWHERE };
CLONES static double row_sum(const float *row, Py_ssize_t vocab, float t, int dividing, float top, float floor, Py_ssize_t room, int32_t *ids, float *values, Py_ssize_t *count, double *blocks) {
    double total = 0.0;
    Py_ssize_t n = 0;
    float shifted[PLAIN_BLOCK];
    for (Py_ssize_t b = 0; b < vocab; b += PLAIN_BLOCK) {
        floats acc = (floats){};
        ints hit = (ints){};
        Py_ssize_t end = b + PLAIN_BLOCK < vocab ? b + PLAIN_BLOCK : vocab;
        for (Py_ssize_t j = b; j < end; j += VECTOR) {
            floats v;
            SHIFTED(v, row, j, vocab, t, dividing, top);
            if (ids) {
                hit |= v >= floor;
                memcpy(shifted + (j - b), &v, sizeof v);
            }
            exp_lanes(&v);
            acc += v;
        }
        double sum = 0.0;
        for (int i = 0; i < VECTOR; i++) sum += (double)acc[i];
        if (blocks) blocks[b / PLAIN_BLOCK] = sum;
        total += sum;
        if (ids) {
            int32_t any;
            ANY_LANE(any, hit);
            for (Py_ssize_t c = 0; any && c < end - b; c++) {
                if (shifted[c] >= floor) {
                    if (n == room) {
                        *count = -1;
                        return 0.0;
                    }
                    ids[n] = (int32_t)(b + c);
                    values[n] = shifted[c];
                    n++;
                }
            }
        }
    }
    if (count) *count = n;
    return total;
}

/* A plain row's draw: the block whose running sum of e^(x/t - top) passes target, by the block sums,
 * then the column within it. A block's sum was made in float32 lanes and its columns are added here
 * one by one in float64, so the target's share of the block is carried over in proportion (the
 * two sums differ by a few roundings, which would otherwise all fall on the block's last column).
 * -1 where no block passes the target (not reached: u * total < total, summed in the same order).
 * `scratch` holds PLAIN_BLOCK floats. */
CLONES static int64_t row_plain_draw(const float *row, Py_ssize_t vocab, float t, int dividing, float top, const double *blocks, double target, float *scratch) {
    double before = 0.0;
    Py_ssize_t blocks_n = (vocab + PLAIN_BLOCK - 1) / PLAIN_BLOCK, b = 0;
    while (b < blocks_n && before + blocks[b] <= target) before += blocks[b++];
    if (b == blocks_n) return -1;
    Py_ssize_t start = b * PLAIN_BLOCK, end = start + PLAIN_BLOCK < vocab ? start + PLAIN_BLOCK : vocab;
    double inside = 0.0;
    for (Py_ssize_t j = start; j < end; j += VECTOR) {
        floats v;
        SHIFTED(v, row, j, vocab, t, dividing, top);
        exp_lanes(&v);
        memcpy(scratch + (j - start), &v, sizeof v);
    }
    for (Py_ssize_t j = start; j < end; j++) inside += (double)scratch[j - start];
    double share = (target - before) / blocks[b] * inside, running = 0.0;
    Py_ssize_t heaviest = -1;
    for (Py_ssize_t j = start; j < end; j++) {
        float e = scratch[j - start];
        if (e > 0.0f) heaviest = j;
        running += (double)e;
        if (e > 0.0f && running > share) return j;
    }
    return heaviest; /* the share rounded up to the block's whole sum: its last column of any weight */
}

/* What one thread needs for its rows of a sample_rows() call: a cut row's candidates (ids, shifted
 * values); probs and floats hold their logprobs and probabilities with the row's largest after them
 * (room + 1), floats a plain row's block too; blocks a plain row's block sums; candidates and spare
 * the candidates' sort. The whole_ buffers (vocab long) are made when a row first needs them: a
 * cut row drawn among all its tokens (values, probabilities, candidates and their sort, sums). */
typedef struct {
    int32_t *ids;
    float *values;
    float *probs;
    double *blocks;
    float *floats;
    Candidate *candidates;
    Candidate *spare;
    float *whole_values;
    float *whole_probs;
    float *whole_sums;
    Candidate *whole;
    Candidate *whole_spare;
} Scratch;

static void whole_free(Scratch *s) {
    free(s->whole_values);
    free(s->whole_probs);
    free(s->whole_sums);
    free(s->whole_spare);
    free(s->whole);
    s->whole_values = s->whole_probs = s->whole_sums = NULL;
    s->whole_spare = s->whole = NULL;
}

static void scratch_free(Scratch *s) {
    free(s->ids);
    free(s->values);
    free(s->probs);
    free(s->blocks);
    free(s->floats);
    free(s->candidates);
    free(s->spare);
    whole_free(s);
}

static int scratch_alloc(Scratch *s, Py_ssize_t vocab, Py_ssize_t room) {
    *s = (Scratch){0};
    s->ids = malloc((size_t)room * sizeof(int32_t));
    s->values = malloc((size_t)room * sizeof(float));
    s->probs = malloc((size_t)(room + 1) * sizeof(float));
    s->blocks = malloc((size_t)((vocab + PLAIN_BLOCK - 1) / PLAIN_BLOCK) * sizeof(double));
    s->floats = malloc((size_t)(room + 1 > PLAIN_BLOCK ? room + 1 : PLAIN_BLOCK) * sizeof(float));
    s->candidates = malloc((size_t)room * sizeof(Candidate));
    s->spare = malloc((size_t)room * sizeof(Candidate));
    if (s->ids && s->values && s->probs && s->blocks && s->floats && s->candidates && s->spare) return 0;
    scratch_free(s);
    *s = (Scratch){0};
    return -1;
}

/* The whole_ buffers of a thread's scratch, made on first need; -1 where they cannot be. */
static int scratch_whole(Scratch *s, Py_ssize_t vocab) {
    if (s->whole != NULL) return 0;
    s->whole_values = malloc((size_t)vocab * sizeof(float));
    s->whole_probs = malloc((size_t)vocab * sizeof(float));
    s->whole_sums = malloc((size_t)vocab * sizeof(float));
    s->whole_spare = malloc((size_t)vocab * sizeof(Candidate));
    s->whole = malloc((size_t)vocab * sizeof(Candidate));
    if (s->whole_values && s->whole_probs && s->whole_sums && s->whole_spare && s->whole) return 0;
    whole_free(s);
    return -1;
}

/* A sample_rows() call's rows, which each thread on it claims one at a time (next_row), so that a
 * helper woken late takes fewer rows, and none once the caller has claimed them all. */
typedef struct {
    const float *logits;
    Py_ssize_t vocab, room, rows;
    const float *scale, *top_p, *u;
    const uint8_t *kinds;
    const int64_t *k;
    float log_ratio, margin, ratio;
    int64_t *tokens;
    float *logprobs;
    uint8_t *finite;
    const uint8_t *wants; /* the alternatives each row wants returned (0: none) */
    Py_ssize_t alternatives; /* the most any row wants: the width of top_ids and top_logprobs */
    int64_t *top_ids;
    float *top_logprobs;
    _Atomic Py_ssize_t next_row;
} RowsJob;

/* A row's `want` most likely tokens, most likely first (equal values: the lower id first, as the
 * row is read in id order), with their logprobs: their shifted values x/t - top less log_total, as
 * the drawn token's logprob is made. Once `want` are kept, VECTOR columns at a time are compared
 * with the least kept in one vector comparison, so that the few insertions a row makes past its
 * first columns cost little beside the pass. */
CLONES static void row_alternatives(const float *row, Py_ssize_t vocab, float t, int dividing, float top, float log_total, Py_ssize_t want,
                                    int64_t *ids, float *values) {
    Py_ssize_t n = 0;
    float least = -__builtin_inff();
    for (Py_ssize_t j = 0; j < vocab; j += VECTOR) {
        floats v;
        SHIFTED(v, row, j, vocab, t, dividing, top);
        if (n == want) {
            int32_t any;
            ANY_LANE(any, v > least);
            if (!any) continue;
        }
        for (int i = 0; i < VECTOR && j + i < vocab; i++) {
            float x = v[i];
            if (n == want && !(x > least)) continue;
            Py_ssize_t at = n < want ? n++ : want - 1; /* full: the least kept drops out */
            for (; at > 0 && values[at - 1] < x; at--) {
                values[at] = values[at - 1];
                ids[at] = ids[at - 1];
            }
            values[at] = x;
            ids[at] = j + i;
            if (n == want) least = values[want - 1];
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) values[i] -= log_total;
}

/* A cut row drawn among all its tokens, as numpy's last round draws it, where its first candidates
 * did not decide it: every token a candidate, in a radix sort (sixteen near-flat rows of 49,152
 * took the passes' whole-row sorts 46-102 ms). -1 where the buffers cannot be had: the caller's
 * passes draw it then. */
static int64_t draw_whole_row(const float *row, Py_ssize_t vocab, float t, int dividing, float top, float log_total, int64_t k, float top_p,
                              float uniform, Scratch *s, float *logprob) {
    if (scratch_whole(s, vocab) < 0) return -1;
    for (Py_ssize_t j = 0; j < vocab; j++) {
        float v = dividing ? row[j] / t : row[j];
        s->whole_values[j] = v - top;
        s->whole_probs[j] = s->whole_values[j] - log_total;
    }
    exp_of(s->whole_probs, vocab, s->whole_probs);
    int64_t token = pick_row(NULL, s->whole_probs, vocab, 0.0f, 1, k, top_p, uniform, s->whole, s->whole_spare, s->whole_sums);
    if (token >= 0) *logprob = s->whole_values[token] - log_total; /* -1 only from NaN probabilities, which a finite row has none of */
    return token;
}

static void draw_row(const RowsJob *job, Py_ssize_t r, Scratch *s) {
    Py_ssize_t vocab = job->vocab;
    const float *row = job->logits + r * vocab;
    float t = job->scale[r];
    int kind = job->kinds[r];
    int dividing = t != 1.0f;
    int64_t token = 0;
    float logprob = __builtin_nanf("");
    float largest;
    Py_ssize_t first = 0;
    if (kind == DRAW_ELSEWHERE) {
        job->tokens[r] = -1;
        job->logprobs[r] = logprob;
        job->finite[r] = 1;
        return;
    }
    int ok = row_finite_top(row, vocab, &largest, &first);
    /* the largest quotient is the quotient of the largest: division by t > 0 keeps the order */
    float top = dividing ? largest / t : largest;
    ok = ok && top - top == 0.0f; /* a finite row the temperature scales past float32 */
    if (ok) {
        Py_ssize_t count = 0;
        int cut = kind == DRAW_CUT, plain = kind == DRAW_PLAIN;
        double total = row_sum(row, vocab, t, dividing, top, job->log_ratio - job->margin, job->room, cut ? s->ids : NULL, s->values,
                               cut ? &count : NULL, plain ? s->blocks : NULL);
        float log_total = count < 0 ? 0.0f : (float)log(total);
        if (kind == DRAW_GREEDY) {
            token = first;
            logprob = 0.0f - log_total;
        } else if (plain) {
            double target = (double)job->u[r] * total;
            token = row_plain_draw(row, vocab, t, dividing, top, s->blocks, target, s->floats);
            if (token >= 0) logprob = ((dividing ? row[token] / t : row[token]) - top) - log_total;
        } else {
            int64_t row_k = job->k[r] > 0 ? job->k[r] : INT64_MAX;
            token = -1;
            if (count >= 0) {
                for (Py_ssize_t j = 0; j < count; j++) s->floats[j] = s->values[j] - log_total;
                s->floats[count] = 0.0f - log_total;
                exp_of(s->floats, count + 1, s->probs);
                token = pick_row(s->ids, s->probs, count, s->probs[count] * job->ratio, 0, row_k, job->top_p[r], job->u[r], s->candidates,
                                 s->spare, s->floats);
                for (Py_ssize_t j = 0; token >= 0 && j < count; j++) {
                    if (s->ids[j] == token) {
                        logprob = s->values[j] - log_total;
                        break;
                    }
                }
            }
            if (token < 0) { /* past the room, or a nucleus wider than the candidates */
                if (count < 0) log_total = (float)log(row_sum(row, vocab, t, dividing, top, 0.0f, 0, NULL, NULL, NULL, NULL));
                token = draw_whole_row(row, vocab, t, dividing, top, log_total, row_k, job->top_p[r], job->u[r], s, &logprob);
            }
        }
        if (job->wants[r]) { /* every wanting row gets the batch's width, as torch's topk gives the passes' rows */
            Py_ssize_t at = r * job->alternatives;
            row_alternatives(row, vocab, t, dividing, top, log_total, job->alternatives, job->top_ids + at, job->top_logprobs + at);
        }
    }
    job->tokens[r] = token;
    job->logprobs[r] = logprob;
    job->finite[r] = (uint8_t)ok;
}

/* Draws rows of the job until none is left to claim; the number it drew. */
static Py_ssize_t draw_rows(RowsJob *job, Scratch *s) {
    Py_ssize_t drawn = 0;
    for (Py_ssize_t r; (r = atomic_fetch_add(&job->next_row, 1)) < job->rows; drawn++) draw_row(job, r, s);
    return drawn;
}

/* Threads that draw rows beside sample_rows()'s caller: started on first use, up to the caller's
 * thread count less one (and the CPUs it may run on less one), and asleep between calls. A helper
 * is handed a call's job (POSTED) and takes it (RUNNING, then DONE); a caller that has claimed
 * every row before a helper took the job takes it back (IDLE), so that a helper slow to wake never
 * holds a call up. One caller at a time (`pool_busy`); another draws alone. A forked child, which
 * has none of the threads, starts its own (forgotten). Helpers block every signal, which stays the
 * Python threads' to take. */
enum { HELPER_IDLE, HELPER_POSTED, HELPER_RUNNING, HELPER_DONE };

typedef struct {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    RowsJob *job;
    Scratch *scratch;
    _Atomic int state;
    int away_from; /* the CPU it is kept off, -1 for none */
} Helper;

#define MOST_HELPERS 15
static Helper helpers[MOST_HELPERS];
static int helpers_started;
static _Atomic int pool_busy;
static _Atomic Py_ssize_t helper_rows; /* rows the helpers have drawn, for pool_stats() */

static void forgotten(void) {
    helpers_started = 0;
    atomic_store(&pool_busy, 0);
    atomic_store(&helper_rows, 0);
}

static void *helper_main(void *arg) {
    Helper *h = arg;
    pthread_mutex_lock(&h->lock);
    for (;;) {
        while (atomic_load(&h->state) != HELPER_POSTED) pthread_cond_wait(&h->wake, &h->lock);
        int posted = HELPER_POSTED;
        if (!atomic_compare_exchange_strong(&h->state, &posted, HELPER_RUNNING)) continue;
        RowsJob *job = h->job;
        Scratch *s = h->scratch;
        pthread_mutex_unlock(&h->lock);
        atomic_fetch_add(&helper_rows, draw_rows(job, s));
        atomic_store(&h->state, HELPER_DONE);
        pthread_mutex_lock(&h->lock);
    }
    return NULL;
}

/* The helpers that can take a job now (started as needed, at most `wanted`); the pool is held. */
static int helpers_ready(int wanted) {
    while (helpers_started < wanted) {
        Helper *h = &helpers[helpers_started];
        atomic_store(&h->state, HELPER_IDLE);
        h->away_from = -1;
        if (pthread_mutex_init(&h->lock, NULL) != 0) break;
        if (pthread_cond_init(&h->wake, NULL) != 0) {
            pthread_mutex_destroy(&h->lock);
            break;
        }
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 1 << 20);
        sigset_t all, before;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &before);
        int failed = pthread_create(&h->thread, &attr, helper_main, h);
        pthread_sigmask(SIG_SETMASK, &before, NULL);
        pthread_attr_destroy(&attr);
        if (failed) {
            pthread_cond_destroy(&h->wake);
            pthread_mutex_destroy(&h->lock);
            break;
        }
        helpers_started++;
    }
    return helpers_started < wanted ? helpers_started : wanted;
}

/* The CPUs the calling thread may run on (1 where that cannot be told: no helpers then). */
static int cpus_allowed(void) {
#ifdef __linux__
    cpu_set_t allowed;
    return sched_getaffinity(0, sizeof allowed, &allowed) == 0 ? CPU_COUNT(&allowed) : 1;
#else
    return 1;
#endif
}

/* Keeps a helper off the caller's CPU. Woken from a sleep, a helper went to the CPU of the thread
 * that woke it (the other, idle, one a VM's halted vCPU) and took it from the caller, which then
 * drew no row until the helper had drawn them all: at 16 rows of 49,152, no faster than alone.
 * Set again when the caller's CPU changes. */
static void helper_away_from(Helper *h) {
#ifdef __linux__
    int cpu = sched_getcpu();
    if (cpu < 0 || cpu == h->away_from) return;
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || !CPU_ISSET(cpu, &allowed) || CPU_COUNT(&allowed) < 2) return;
    CPU_CLR(cpu, &allowed);
    if (pthread_setaffinity_np(h->thread, sizeof allowed, &allowed) == 0) h->away_from = cpu;
#else
    (void)h;
#endif
}

static void helper_post(Helper *h, RowsJob *job, Scratch *s) {
    helper_away_from(h);
    pthread_mutex_lock(&h->lock);
    h->job = job;
    h->scratch = s;
    atomic_store(&h->state, HELPER_POSTED);
    pthread_cond_signal(&h->wake);
    pthread_mutex_unlock(&h->lock);
}

/* Once the caller has no row left to claim: the job back from a helper that has not taken it, or
 * the helper's last row awaited (at most one row's time: it claims no other). */
static void helper_finish(Helper *h) {
    int posted = HELPER_POSTED;
    if (atomic_compare_exchange_strong(&h->state, &posted, HELPER_IDLE)) return;
    while (atomic_load(&h->state) != HELPER_DONE) sched_yield();
    atomic_store(&h->state, HELPER_IDLE);
}

/* How many helpers a call takes: none under PARALLEL_ELEMENTS logits, and no more than its rows,
 * its threads and the CPUs the process may run on (a helper on the caller's only CPU slows it),
 * each less the caller. */
static int helpers_wanted(Py_ssize_t rows, Py_ssize_t vocab, int threads) {
    if (rows * vocab < PARALLEL_ELEMENTS) return 0;
    Py_ssize_t most = rows < threads ? rows : threads;
    int cpus = cpus_allowed();
    if (most > cpus) most = cpus;
    if (most > MOST_HELPERS + 1) most = MOST_HELPERS + 1;
    return (int)most - 1;
}

/* pool_stats() -> (helpers started in this process, rows they have drawn): what the tests read to
 * know that helpers drew at all. */
static PyObject *pool_stats(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return Py_BuildValue("(in)", helpers_started, atomic_load(&helper_rows));
}

/* sample_rows(logits, vocab, scale, kinds, k, top_p, uniforms, log_ratio, margin, ratio, room,
 *             tokens, logprobs, finite, wants, alternatives, top_ids, top_logprobs, threads)
 *             -> rows left undecided
 *
 * logits: float32[rows, vocab], or its (address, rows) (logits_rows). Per row: scale (its
 * temperature, 1 for greedy), kind (0 greedy, 1 plain: drawn over the whole row, 2 cut: top-k and /
 * or top-p, 3 elsewhere: left to the caller),
 * k (0: off), top_p, uniform (a random row's). Out: the token, its logprob (x/t - top - log of the
 * sum) and whether the row was finite (a NaN or an infinity in it, or a temperature that overflows
 * it: token 0, logprob NaN). A cut row whose candidates (within log_ratio - margin of its largest)
 * are more than room or do not hold its nucleus is drawn among all its tokens. A row left
 * elsewhere (and such a row where its buffers could not be had) gets token -1: the caller samples
 * it otherwise. A finite row drawn here with wants > 0 (uint8[rows], at most `alternatives`) gets
 * its `alternatives` most likely tokens in its row of top_ids (int64[rows, alternatives]) and their
 * logprobs in top_logprobs (float32, the same shape), most likely first; other rows' are left as
 * the caller filled them. Over PARALLEL_ELEMENTS logits or more, up to `threads` threads
 * draw the rows (each row's outputs are its own, whichever thread draws it). */
static PyObject *sample_rows(PyObject *self, PyObject *args) {
    PyObject *logits_obj, *scale_obj, *kinds_obj, *k_obj, *top_p_obj, *u_obj, *tokens_obj, *logprobs_obj, *finite_obj, *wants_obj, *top_ids_obj,
        *top_logprobs_obj;
    Py_ssize_t vocab, room, alternatives;
    float log_ratio, margin, ratio;
    int threads;
    if (!PyArg_ParseTuple(args, "OnOOOOOfffnOOOOnOOi", &logits_obj, &vocab, &scale_obj, &kinds_obj, &k_obj, &top_p_obj, &u_obj, &log_ratio,
                          &margin, &ratio, &room, &tokens_obj, &logprobs_obj, &finite_obj, &wants_obj, &alternatives, &top_ids_obj,
                          &top_logprobs_obj, &threads)) return NULL;
    if (vocab <= 0 || vocab > INT32_MAX || room <= 0 || room > vocab)
        return PyErr_Format(PyExc_ValueError, "vocab must be in 1 to 2**31 - 1, room in 1 to vocab");
    if (alternatives < 0 || alternatives > vocab) return PyErr_Format(PyExc_ValueError, "alternatives must be in 0 to vocab");
    if (threads < 1) return PyErr_Format(PyExc_ValueError, "threads must be at least 1");
    Py_buffer logits, scale, kinds, k, top_p, u, tokens, logprobs, finite, wants, top_ids, top_logprobs;
    PyObject *result = NULL;
    Py_ssize_t rows = logits_rows(logits_obj, &logits, vocab, "logits");
    if (rows < 0) return NULL;
    if (buffer_of(scale_obj, &scale, 0, 'f', sizeof(float), rows, "scale") < 0) goto done_logits;
    if (buffer_of(kinds_obj, &kinds, 0, 'u', sizeof(uint8_t), rows, "kinds") < 0) goto done_scale;
    if (buffer_of(k_obj, &k, 0, 'i', sizeof(int64_t), rows, "k") < 0) goto done_kinds;
    if (buffer_of(top_p_obj, &top_p, 0, 'f', sizeof(float), rows, "top_p") < 0) goto done_k;
    if (buffer_of(u_obj, &u, 0, 'f', sizeof(float), rows, "uniforms") < 0) goto done_top_p;
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (((const uint8_t *)kinds.buf)[r] > DRAW_ELSEWHERE) {
            PyErr_Format(PyExc_ValueError, "kinds[%zd] is not a DRAW_* kind", r);
            goto done_u;
        }
    }
    if (buffer_of(tokens_obj, &tokens, 1, 'i', sizeof(int64_t), rows, "tokens") < 0) goto done_u;
    if (buffer_of(logprobs_obj, &logprobs, 1, 'f', sizeof(float), rows, "logprobs") < 0) goto done_tokens;
    if (buffer_of(finite_obj, &finite, 1, 'u', sizeof(uint8_t), rows, "finite") < 0) goto done_logprobs;
    if (buffer_of(wants_obj, &wants, 0, 'u', sizeof(uint8_t), rows, "wants") < 0) goto done_finite;
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (((const uint8_t *)wants.buf)[r] > alternatives) {
            PyErr_Format(PyExc_ValueError, "wants[%zd] is more than alternatives", r);
            goto done_wants;
        }
    }
    if (buffer_of(top_ids_obj, &top_ids, 1, 'i', sizeof(int64_t), rows * alternatives, "top_ids") < 0) goto done_wants;
    if (buffer_of(top_logprobs_obj, &top_logprobs, 1, 'f', sizeof(float), rows * alternatives, "top_logprobs") < 0) goto done_top_ids;
    if (top_ids.len != rows * alternatives * (Py_ssize_t)sizeof(int64_t) || top_logprobs.len != rows * alternatives * (Py_ssize_t)sizeof(float)) {
        PyErr_Format(PyExc_ValueError, "top_ids and top_logprobs must hold exactly rows x alternatives: a row's are at its stride");
        goto done_top_logprobs;
    }

    RowsJob job = {
        .logits = logits.buf, .vocab = vocab, .room = room, .rows = rows, .scale = scale.buf, .top_p = top_p.buf, .u = u.buf,
        .kinds = kinds.buf, .k = k.buf, .log_ratio = log_ratio, .margin = margin, .ratio = ratio, .tokens = tokens.buf,
        .logprobs = logprobs.buf, .finite = finite.buf, .wants = wants.buf, .alternatives = alternatives, .top_ids = top_ids.buf,
        .top_logprobs = top_logprobs.buf,
    };
    atomic_init(&job.next_row, 0);
    Scratch scratch[MOST_HELPERS + 1]; /* the caller's, then one per helper */
    if (scratch_alloc(&scratch[0], vocab, room) < 0) {
        PyErr_NoMemory();
        goto done_top_logprobs;
    }
    PyThreadState *released = rows * vocab >= RELEASE_GIL_ELEMENTS ? PyEval_SaveThread() : NULL;
    int wanted = helpers_wanted(rows, vocab, threads), free_pool = 0, helping = 0;
    int pooled = wanted > 0 && atomic_compare_exchange_strong(&pool_busy, &free_pool, 1);
    if (pooled) {
        helping = helpers_ready(wanted);
        for (int h = 0; h < helping; h++) {
            if (scratch_alloc(&scratch[h + 1], vocab, room) < 0) {
                helping = h;
                break;
            }
            helper_post(&helpers[h], &job, &scratch[h + 1]);
        }
    }
    draw_rows(&job, &scratch[0]);
    for (int h = 0; h < helping; h++) helper_finish(&helpers[h]);
    if (pooled) atomic_store(&pool_busy, 0);
    if (released != NULL) PyEval_RestoreThread(released);
    Py_ssize_t undecided = 0;
    for (Py_ssize_t r = 0; r < rows; r++) undecided += job.tokens[r] < 0;
    result = PyLong_FromSsize_t(undecided);
    for (int h = 0; h <= helping; h++) scratch_free(&scratch[h]);

done_top_logprobs:
    PyBuffer_Release(&top_logprobs);
done_top_ids:
    PyBuffer_Release(&top_ids);
done_wants:
    PyBuffer_Release(&wants);
done_finite:
    PyBuffer_Release(&finite);
done_logprobs:
    PyBuffer_Release(&logprobs);
done_tokens:
    PyBuffer_Release(&tokens);
done_u:
    PyBuffer_Release(&u);
done_top_p:
    PyBuffer_Release(&top_p);
done_k:
    PyBuffer_Release(&k);
done_kinds:
    PyBuffer_Release(&kinds);
done_scale:
    PyBuffer_Release(&scale);
done_logits:
    PyBuffer_Release(&logits);
    return result;
}

static PyMethodDef methods[] = {
    {"finite_scaled", finite_scaled, METH_VARARGS, "Which rows are finite, and the finite ones over their temperature (executor/_sampling.c)."},
    {"gather", gather, METH_VARARGS, "Each row's first-round candidates: ids, logprobs, counts (executor/_sampling.c)."},
    {"pick", pick, METH_VARARGS, "Each row's draw among its candidates, -1 where they do not decide it (executor/_sampling.c)."},
    {"sample_rows", sample_rows, METH_VARARGS, "A batch without logits processing drawn in one call (executor/_sampling.c)."},
    {"pool_stats", pool_stats, METH_NOARGS, "The helper threads started in this process and the rows they have drawn (executor/_sampling.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sampling", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sampling(void) {
    static int at_fork;
    if (!at_fork && pthread_atfork(NULL, NULL, forgotten) != 0) return PyErr_Format(PyExc_OSError, "pthread_atfork failed");
    at_fork = 1;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "INTERFACE", INTERFACE) < 0 || PyModule_AddIntConstant(m, "DRAW_GREEDY", DRAW_GREEDY) < 0
                      || PyModule_AddIntConstant(m, "DRAW_PLAIN", DRAW_PLAIN) < 0 || PyModule_AddIntConstant(m, "DRAW_CUT", DRAW_CUT) < 0
                      || PyModule_AddIntConstant(m, "DRAW_ELSEWHERE", DRAW_ELSEWHERE) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
