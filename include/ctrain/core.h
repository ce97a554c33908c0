/*
 * ctrain core: status codes and error messages, logging with a rank prefix,
 * the tracked allocator, the counter-based RNG, 16-bit float conversion, the
 * BLAS set-up and matrix products by dtype (OpenBLAS, oneDNN).  Everything
 * else in ctrain stands on this room; it knows nothing of layers or ranks.
 */
#ifndef CTRAIN_CORE_H
#define CTRAIN_CORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CT_VERSION "0.1.0"

/* ---- status ------------------------------------------------------------ */

/* 0 is success; every failure is negative and comes with a message. */
typedef int ct_status;
enum {
    CT_OK = 0,
    CT_EINVAL = -1,       /* bad argument or configuration */
    CT_ENOMEM = -2,       /* allocation failed */
    CT_EIO = -3,          /* file system or stream error */
    CT_EFORMAT = -4,      /* malformed file contents */
    CT_ECOMM = -5,        /* communication (MPI) failure */
    CT_ESTATE = -6,       /* call not valid in the current state */
    CT_EUNSUPPORTED = -7  /* valid request this build cannot do */
};

/* Short name of a status code ("invalid argument"); never NULL. */
const char *ct_strerror(ct_status s);
/* The calling thread's last error message ("" if none); valid until the next error. */
const char *ct_last_error(void);
/* Sets the thread's error message from printf-style args and returns code. */
ct_status ct_error(ct_status code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Clears the thread's error message (and its status). */
void ct_clear_error(void);
/* The code given with the thread's last error (CT_OK if none since the last
 * clear): what a constructor that returns NULL failed with. */
ct_status ct_last_status(void);

/* Programmer errors only: always checked, prints the expression and location, aborts. */
#define CT_ASSERT(cond)                                                       \
    do {                                                                      \
        if (!(cond)) ct__assert_fail(#cond, __FILE__, __LINE__);              \
    } while (0)
void ct__assert_fail(const char *expr, const char *file, int line)
    __attribute__((noreturn));

/* Propagates a failing status to the caller. */
#define CT_TRY(expr)                                                          \
    do {                                                                      \
        ct_status ct__s = (expr);                                             \
        if (ct__s != CT_OK) return ct__s;                                     \
    } while (0)

/* ---- logging ----------------------------------------------------------- */

typedef enum { CT_LOG_ERROR = 0, CT_LOG_WARN, CT_LOG_INFO, CT_LOG_DEBUG } ct_log_level;

/* Sets the "[rank r/n]" prefix; size 1 prints no prefix. */
void ct_log_set_rank(int rank, int size);
/* Messages above level are dropped; the default is INFO, or CTRAIN_LOG=error|warn|info|debug. */
void ct_log_set_level(ct_log_level level);
ct_log_level ct_log_get_level(void);
/* Writes one line to stderr with the rank prefix. */
void ct_log(ct_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* ---- tracked allocator ------------------------------------------------- */

typedef enum {
    CT_MEM_PARAM = 0,
    CT_MEM_GRAD,
    CT_MEM_OPTIM,
    CT_MEM_ACT,
    CT_MEM_COMM,
    CT_MEM_DATA,   /* data sets loaded in memory */
    CT_MEM_OTHER,
    CT_MEM_NCAT
} ct_mem_cat;

/* 64-byte aligned block of bytes counted under cat, NOT zeroed (like
 * torch.empty: for memory that is written in full before it is read); NULL
 * (error set) on failure.  Blocks of 64 KiB and more are page aligned. */
void *ct_alloc(size_t bytes, ct_mem_cat cat);
/* Same, zeroed. */
void *ct_alloc_zeroed(size_t bytes, ct_mem_cat cat);
/* Frees a block from ct_alloc or ct_alloc_zeroed; NULL is a no-op. */
void ct_free(void *p);
/* A growable array with room for one more element: arr itself while n <
 * *cap, else a copy of its n elements in a block of double the capacity
 * (from 4) under cat, the old block freed, so n appends copy O(n) elements
 * in all.  NULL (error set) when out of memory; arr is then untouched. */
void *ct_grow(void *arr, int n, int *cap, size_t elem, ct_mem_cat cat);
/* Bytes the block was allocated with (0 for NULL). */
size_t ct_alloc_size(const void *p);
/* Bytes currently allocated in cat. */
size_t ct_mem_current(ct_mem_cat cat);
/* Highest ct_mem_current(cat) since start or the last reset. */
size_t ct_mem_peak(ct_mem_cat cat);
/* Highest sum over all categories since start or the last reset. */
size_t ct_mem_peak_total(void);
/* Highest sum over all categories over the process's life, never reset:
 * the high-water mark under which the cache may hold freed blocks. */
size_t ct_mem_life_peak_total(void);
/* Starts a new peak window: every peak (per category, total, resident and
 * RSS) is set to its current value. */
void ct_mem_reset_peak(void);
/* "param", "grad", "optim", "act", "comm", "data", "other". */
const char *ct_mem_cat_name(ct_mem_cat cat);
/* Bytes of freed large blocks kept for reuse (not counted as in use). */
size_t ct_mem_cached(void);
/* The highest ct_mem_cached since start or the last ct_mem_reset_peak. */
size_t ct_mem_cached_peak(void);
/* Returns every cached block to the OS (munmap), and malloc's free memory
 * where the C library allows it, so the process's RSS falls. */
void ct_mem_trim(void);
/* The cache's automatic bound: CT_MEM_CACHE_UNITS times the largest
 * ct_mem_cache_hint, and at least CT_MEM_CACHE_MIN_MB MiB; past it, what
 * fits with the live bytes under ct_mem_life_peak_total. */
#define CT_MEM_CACHE_AUTO ((size_t)-1)
#define CT_MEM_CACHE_UNITS 4
#define CT_MEM_CACHE_MIN_MB 64
/* Bounds the cache of freed large blocks to bytes (0 turns it off;
 * CT_MEM_CACHE_AUTO: the automatic bound), trimming it if it holds more;
 * overrides CTRAIN_ALLOC_CACHE_MB (MiB, or "auto"), whose absence means
 * auto (0 under AddressSanitizer, which keeps use-after-free visible).
 * Strategies set it from their option alloc_cache_mb. */
void ct_mem_set_cache_limit(size_t bytes);
/* The bound in force now, in bytes (the automatic one resolved). */
size_t ct_mem_get_cache_limit(void);
/* Tells the allocator that blocks of bytes are allocated and freed over and
 * over (a DDP bucket, an FSDP unit, an offload slice: the flat layer hints
 * every flat); the automatic bound follows the largest hint of the process. */
void ct_mem_cache_hint(size_t bytes);
/* The largest ct_mem_cache_hint so far (0: none). */
size_t ct_mem_cache_hinted(void);
/* Fault injection: the n-th ct_alloc from now (0 = the next one) fails; -1 turns it off. */
void ct_mem_fail_after(long n);
/* Allocations left before the injected failure (>= 0), or -1 once it has
 * happened (or none is set): how a fault-injection walk knows it is done. */
long ct_mem_fail_pending(void);

/* ---- phases of the process's life --------------------------------------- */

/* What the process is doing, for the memory report's whole-life peak RSS:
 * each phase keeps its own peak, and the report names the phase of the
 * largest.  A phase lasts until the next one begins; phases may repeat
 * (train, save, train, ...), their peaks are over all their spans. */
typedef enum {
    CT_PHASE_START = 0, /* process start to the first mark: libraries, MPI, data sets */
    CT_PHASE_BUILD,     /* building and initialising the model (ct_model_build) */
    CT_PHASE_WRAP,      /* a strategy taking the model over (ct_strategy_create) */
    CT_PHASE_LOAD,      /* reading checkpoints into the model (ct_strategy_load_state) */
    CT_PHASE_TRAIN,     /* training steps (ct_strategy_train_step, ct_strategy_step) */
    CT_PHASE_EVAL,      /* evaluation between or after steps */
    CT_PHASE_SAVE,      /* gathering and writing checkpoints */
    CT_PHASE_TEARDOWN,  /* freeing it all (ct_strategy_destroy) */
    CT_PHASE_N
} ct_mem_phase;

/* Marks that the process enters phase p (a no-op if it is in p already).
 * The library marks its own entry points (in parentheses above); programs
 * mark the rest (eval, their own teardown). */
void ct_mem_phase_begin(ct_mem_phase p);
/* The phase the process is in. */
ct_mem_phase ct_mem_phase_current(void);
/* "start", "build", "wrap", "load", "train", "eval", "save", "teardown". */
const char *ct_mem_phase_name(ct_mem_phase p);

/* ---- memory report ----------------------------------------------------- */

/* One rank's memory, in bytes.  Peaks are since the start of the process or
 * the last ct_mem_reset_peak.  A plain value: ranks can combine reports
 * (say, an allreduce MAX over the fields) before formatting them. */
typedef struct {
    size_t current[CT_MEM_NCAT], peak[CT_MEM_NCAT]; /* per category (ct_mem_cat) */
    size_t current_total, peak_total;  /* all categories; the peak is of the sum */
    size_t resident, peak_resident;    /* param + grad + optim; the peak is of the sum,
                                          not a sum of the three peaks */
    size_t cached, peak_cached;        /* freed large blocks kept for reuse, apart
                                          from the above (ct_mem_cached), and the
                                          most held in the window */
    size_t cache_limit;                /* the cache's bound (ct_mem_get_cache_limit) */
    size_t mapped, life_mapped;        /* large blocks in use by their mapped size (a
                                          larger cached block reused counts whole), and
                                          the most they and the cache have held together
                                          over the process's life: past cache_limit the
                                          automatic bound keeps mapped + cached under it */
    size_t rss, peak_rss;              /* the process's resident set: VmRSS now, and
                                          its highest value in the window (VmHWM after
                                          a reset through /proc/self/clear_refs, else
                                          the highest sample); 0 where unknown */
    size_t life_peak_rss;              /* the highest RSS of the process's whole life so
                                          far (VmHWM as it reads with no reset) */
    ct_mem_phase life_peak_phase;      /* the phase it was reached in */
    ct_mem_phase phase;                /* the phase the process is in */
    size_t phase_peak_rss[CT_PHASE_N]; /* each phase's peak RSS (0: not entered) */
} ct_mem_report;

/* Buffer sizes that always fit ct_mem_report_format / ct_mem_report_json. */
#define CT_MEM_REPORT_TABLE_MAX 2048
#define CT_MEM_REPORT_JSON_MAX 1024

/* Fills r from the allocator's counters and /proc/self/status. */
void ct_mem_report_get(ct_mem_report *r);
/* Writes r as a table for people (one row per category, current and peak,
 * then total, resident, cached (now and its peak, with the bound), RSS (now
 * and the window's peak), the whole life's peak RSS with its phase, and
 * each phase's peak; sizes in KiB/MiB/GiB) into buf, each line ending in a
 * newline.  CT_EINVAL if n is too small (nothing is cut silently): pass
 * CT_MEM_REPORT_TABLE_MAX bytes. */
ct_status ct_mem_report_format(const ct_mem_report *r, char *buf, size_t n);
/* Writes r as one JSON object on one line (no newline), every size an
 * integer count of bytes:
 *   {"rank":R,"param":P,"grad":G,"optim":O,"act":A,"comm":C,"data":D,
 *    "other":X,"peak_total":T,"resident":S,"cached":K,"peak_cached":KP,
 *    "cache_limit":KL,"rss":M,"rss_life":L,"rss_life_phase":"train",
 *    "rss_phases":{"start":..,"build":..,...}}
 * where rank is the caller's rank (core knows no ranks), each category is
 * its peak since the last reset (r->peak[cat]), peak_total is r->peak_total,
 * resident is the peak of param+grad+optim (r->peak_resident), cached is the
 * cache now (r->cached), peak_cached its peak in the window, cache_limit its
 * bound, rss the window's peak RSS (r->peak_rss), rss_life the whole life's
 * with its phase, and rss_phases every entered phase's peak.  CT_EINVAL if n
 * is too small: pass CT_MEM_REPORT_JSON_MAX bytes. */
ct_status ct_mem_report_json(const ct_mem_report *r, int rank, char *buf, size_t n);

/* ---- counter-based RNG (Philox 4x32-10) -------------------------------- */

/* The four 32-bit words for (key, counter); a pure function of its inputs. */
void ct_philox4x32(uint64_t key, const uint32_t ctr[4], uint32_t out[4]);

/* A stream of numbers: element i depends only on (seed, stream, i). */
typedef struct {
    uint64_t seed;
    uint64_t stream;
    uint64_t offset; /* index of the next 32-bit word */
} ct_rng;

/* Starts a stream at offset 0. */
void ct_rng_init(ct_rng *r, uint64_t seed, uint64_t stream);
/* n uniform floats in [0,1); advances offset by n. */
void ct_rng_uniform(ct_rng *r, float *out, size_t n);
/* n normal floats (mean, std) by Box-Muller; advances offset by 2*ceil(n/2). */
void ct_rng_normal(ct_rng *r, float *out, size_t n, float mean, float std);
/* 64-bit FNV-1a hash, used to turn names into RNG streams. */
uint64_t ct_hash64(const void *data, size_t n);

/* ---- 16-bit floats ----------------------------------------------------- */

/* Round to nearest even; inf stays inf, nan stays nan (quiet). */
uint16_t ct_f32_to_bf16(float f);
float ct_bf16_to_f32(uint16_t h);
uint16_t ct_f32_to_f16(float f);
float ct_f16_to_f32(uint16_t h);
void ct_f32_to_bf16_n(const float *in, uint16_t *out, size_t n);
void ct_bf16_to_f32_n(const uint16_t *in, float *out, size_t n);
/* One read of x [rows, cols] (row-major): y = its bf16 cast (NULL: skipped) and colsum[j] +=
 * the sum of column j taken down the rows in order (NULL: skipped); a gradient's bf16 copy
 * and its bias gradient together. */
void ct_f32_to_bf16_rows(const float *x, int64_t rows, int64_t cols, uint16_t *y, float *colsum);
void ct_f32_to_f16_n(const float *in, uint16_t *out, size_t n);
void ct_f16_to_f32_n(const uint16_t *in, float *out, size_t n);

/* ---- BLAS -------------------------------------------------------------- */

/* Row-major C = alpha*op(A)*op(B) + beta*C with op(X) = X or X^T; A is MxK after op. */
void ct_sgemm(int trans_a, int trans_b, int m, int n, int k, float alpha,
              const float *a, int lda, const float *b, int ldb, float beta,
              float *c, int ldc);
/* Threads this rank's work may use from now on (>= 1): one OpenMP team that runs
 * oneDNN's products, OpenBLAS's (called from the team, one thread each) and ctrain's
 * own kernels (src/core/parallel.c).  Without a call, OpenBLAS's default count. */
void ct_blas_set_threads(int n);
int ct_blas_get_threads(void);

/* ---- the parallel-for every kernel shares ------------------------------ */
/* Work on items [lo, hi) of a range cut by ct_parallel_for. */
typedef void (*ct_range_fn)(void *ctx, int64_t lo, int64_t hi);
/* Runs fn over [0, n) cut into one contiguous range per thread of the rank's team (at
 * most n / grain ranges; boundaries on multiples of 16 items when n allows), each range
 * running exactly the code one thread runs over it: items that do not depend on each
 * other give the same bits at any thread count.  Serial inside a team, on a thread
 * that called ct_parallel_serial_here, or when n < 2 * grain. */
void ct_parallel_for(int64_t n, int64_t grain, ct_range_fn fn, void *ctx);
/* The number of ranges ct_parallel_for(n, grain, ...) would cut on this thread. */
int ct_parallel_threads(int64_t n, int64_t grain);
/* Kernels called on this thread run on it alone from now on (a communication or I/O
 * thread: a team of its own would take the cores the compute thread's team uses). */
void ct_parallel_serial_here(void);
/* Name of the kernel OpenBLAS runs ("SkylakeX", "Haswell", ...). */
const char *ct_blas_corename(void);
/* How the kernel was chosen: "auto-selected by ctrain", "user's OPENBLAS_CORETYPE", "OpenBLAS default". */
const char *ct_blas_kernel_source(void);
/* Re-executes this program once with the fast kernel if OpenBLAS picked a
 * slow one (OpenBLAS reads OPENBLAS_CORETYPE only when it loads, so there is
 * no other cure), and with OMP_WAIT_POLICY=PASSIVE unless the user set it
 * or GOMP_SPINCOUNT (libgomp reads them only when it loads; its spinning
 * threads starve each other when ranks share cores: src/core/blas.c).
 * Call it first thing in main, with main's argc and argv unchanged, before
 * threads or other state exist: on re-execution it does not return, and the
 * program starts again from the top.  Linking libctrain never does this by
 * itself.  Returns CT_OK and does nothing when both are settled already
 * (the kernel is fine, the CPU has nothing better or the user set
 * OPENBLAS_CORETYPE; the wait policy is set), or CTRAIN_NO_REEXEC=1;
 * CT_EUNSUPPORTED (the program can go on, slowly) if the re-exec failed.
 * CTRAIN_BLAS_DISTRUST=1 treats any kernel as slow (tests). */
ct_status ct_blas_select_kernel(int argc, char **argv);
/* OpenMP's wait policy in this process and who chose it, for reports:
 * "PASSIVE (set by ctrain: ...)", "ACTIVE (user's OMP_WAIT_POLICY)", ... */
const char *ct_omp_wait_policy(void);
/* Logs one warning per process, naming the fix, if OpenBLAS runs a slower
 * kernel than the CPU allows and the user did not choose it. */
void ct_blas_warn_if_slow(void);

/* ---- matrix products by dtype (OpenBLAS and oneDNN) -------------------- */
/* Same row-major contract as ct_sgemm; C is always f32, beta 0 never reads C,
 * leading dimensions are in elements.  oneDNN products are cached by shape,
 * strides, alpha, beta and thread count (the first call of a shape pays the
 * set-up); calls from several threads are safe but run one at a time. */

typedef enum {
    CT_GEMM_AUTO = 0,  /* whichever measured faster for the shape class and OpenBLAS kernel */
    CT_GEMM_OPENBLAS,  /* ct_sgemm */
    CT_GEMM_ONEDNN     /* oneDNN matmul */
} ct_gemm_engine;

/* f32 product through engine; AUTO falls back to OpenBLAS (warning once) if oneDNN fails. */
ct_status ct_gemm_f32(ct_gemm_engine engine, int trans_a, int trans_b, int m, int n, int k,
                      float alpha, const float *a, int lda, const float *b, int ldb, float beta,
                      float *c, int ldc);
/* bf16 x bf16 (bits as ct_f32_to_bf16 makes them) with f32 accumulation into f32 C, through
 * oneDNN; subnormal bf16 operands may count as 0 (AVX512_BF16 flushes them). */
ct_status ct_gemm_bf16(int trans_a, int trans_b, int m, int n, int k, float alpha,
                       const uint16_t *a, int lda, const uint16_t *b, int ldb, float beta,
                       float *c, int ldc);
/* C = op(A) op(B) + bias, bias a row of n floats added to every row of C (NULL: none); C is
 * written as f32, or as bf16 (rounded as ct_f32_to_bf16) when c_bf16.  One oneDNN pass. */
ct_status ct_gemm_bf16_bias(int trans_a, int trans_b, int m, int n, int k, const uint16_t *a, int lda,
                            const uint16_t *b, int ldb, const float *bias, void *c, int c_bf16, int ldc);
/* f32 C = op(A) op(B) + bias (as ct_gemm_bf16_bias) through engine; oneDNN adds the bias in
 * the product, OpenBLAS onto rows first set to it. */
ct_status ct_gemm_f32_bias(ct_gemm_engine engine, int trans_a, int trans_b, int m, int n, int k,
                           const float *a, int lda, const float *b, int ldb, const float *bias, float *c,
                           int ldc);
/* The engine CT_GEMM_AUTO picks for an f32 product of this shape. */
ct_gemm_engine ct_gemm_f32_engine(int trans_a, int trans_b, int m, int n, int k);
/* oneDNN's kernel name for a dense product ("brg:avx512_core_bf16") into buf, creating it if
 * needed: the kernel that does the product's work on the route ct_gemm_bf16 / ct_gemm_f32
 * take for it (a bf16 weight gradient's runs on a copy of A^T, say). */
ct_status ct_gemm_onednn_impl(int bf16, int trans_a, int trans_b, int m, int n, int k, float beta,
                              char *buf, size_t len);
/* Frees the cached oneDNN primitives and scratch (later products set them up
 * again); programs that check ct_alloc leaks at exit call it first. */
void ct_gemm_cache_clear(void);
/* 1 if the CPU has AVX512_BF16 (oneDNN then runs bf16 natively; otherwise it emulates)
 * and CTRAIN_ISA does not cap it away. */
int ct_cpu_has_avx512_bf16(void);
/* The widest instruction set ctrain's kernels and oneDNN may use here: "portable", "avx2",
 * "avx512", "avx512bf16" or "amx"; CTRAIN_ISA set to one of these caps it (tests hold each
 * path against the portable one). */
const char *ct_cpu_isa(void);
/* The CPU's brand string ("Intel(R) Xeon(R) Platinum 8480+"), or "unknown CPU". */
const char *ct_cpu_model(void);

/* ---- time and tracing -------------------------------------------------- */

/* Monotonic clock in seconds. */
double ct_now(void);
/* Starts recording trace events for a Chrome/Perfetto timeline; pid is the
 * rank (each rank writes its own file). */
void ct_trace_enable(int pid);
/* 1 while recording. */
int ct_trace_enabled(void);
/* Records a complete event (name and category are copied) from start t0 to
 * t1 (ct_now seconds) on thread lane tid (0 compute, 1 communication).
 * Thread-safe; a no-op unless enabled. */
void ct_trace_event(const char *name, const char *cat, double t0, double t1, int tid);
/* The ledger of where the time goes (src/core/ledger.c): seconds summed over the process. */
typedef enum { CT_LEDGER_PRODUCTS, CT_LEDGER_ATTENTION, CT_LEDGER_OPTIMIZER, CT_LEDGER_N } ct_ledger_kind;
/* Opens a timed region; returns what ct_ledger_end takes (a region inside another, or
 * on a thread of a running team, is not counted again). */
double ct_ledger_begin(void);
/* Closes the region ct_ledger_begin opened (every begin has its end), adding it to k. */
void ct_ledger_end(ct_ledger_kind k, double t0);
/* seconds[k] for each kind k < CT_LEDGER_N. */
void ct_ledger_read(double *seconds);
/* Writes the events as trace-event JSON ({"traceEvents": [...]}) to path
 * atomically and stops recording. */
ct_status ct_trace_write(const char *path);

#ifdef __cplusplus
}
#endif
#endif
