/*
 * ctrain dtypes as MPI datatypes, and the reductions MPI lacks.  MPI has no
 * bf16 or f16, so each is a committed 16-bit datatype of its own with
 * user-defined SUM/MAX/MIN ops that widen to f32, combine, and round back
 * (round to nearest even): a 16-bit sum accumulates in f32 within each
 * reduction step and is rounded once per step.  AVG is the sum followed by
 * a scale by 1/size (ct__scale), done once on the result.
 */
#include <math.h>

#include "internal.h"

static MPI_Datatype t_bf16 = MPI_DATATYPE_NULL, t_f16 = MPI_DATATYPE_NULL;
/* [0] bf16, [1] f16; by CT_OP_SUM (also AVG), CT_OP_MAX, CT_OP_MIN */
static MPI_Op op16[2][3] = {{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL},
                            {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}};

static inline float add_f(float a, float b) { return a + b; }
/* fmaxf/fminf: a nan loses to a number. */
static inline float max_f(float a, float b) { return fmaxf(a, b); }
static inline float min_f(float a, float b) { return fminf(a, b); }

/* inout[i] = combine(in[i], inout[i]) in f32, rounded back to 16 bits. */
#define DEF_OP16(name, to32, from32, combine)                                 \
    static void name(void *in, void *inout, int *len, MPI_Datatype *dt)        \
    {                                                                         \
        (void)dt;                                                             \
        const uint16_t *a = in;                                               \
        uint16_t *b = inout;                                                  \
        for (int i = 0; i < *len; i++) b[i] = from32(combine(to32(a[i]), to32(b[i]))); \
    }

DEF_OP16(sum_bf16, ct_bf16_to_f32, ct_f32_to_bf16, add_f)
DEF_OP16(max_bf16, ct_bf16_to_f32, ct_f32_to_bf16, max_f)
DEF_OP16(min_bf16, ct_bf16_to_f32, ct_f32_to_bf16, min_f)
DEF_OP16(sum_f16, ct_f16_to_f32, ct_f32_to_f16, add_f)
DEF_OP16(max_f16, ct_f16_to_f32, ct_f32_to_f16, max_f)
DEF_OP16(min_f16, ct_f16_to_f32, ct_f32_to_f16, min_f)

ct_status ct__dtypes_create(void)
{
    static MPI_User_function *fns[2][3] = {{sum_bf16, max_bf16, min_bf16},
                                           {sum_f16, max_f16, min_f16}};
    int rc;
    if ((rc = MPI_Type_contiguous(1, MPI_UINT16_T, &t_bf16)) != MPI_SUCCESS ||
        (rc = MPI_Type_commit(&t_bf16)) != MPI_SUCCESS ||
        (rc = MPI_Type_contiguous(1, MPI_UINT16_T, &t_f16)) != MPI_SUCCESS ||
        (rc = MPI_Type_commit(&t_f16)) != MPI_SUCCESS)
        return ct__mpi_fail(rc, "creating the bf16/f16 MPI datatypes");
    for (int t = 0; t < 2; t++)
        for (int o = 0; o < 3; o++)
            if ((rc = MPI_Op_create(fns[t][o], 1, &op16[t][o])) != MPI_SUCCESS)
                return ct__mpi_fail(rc, "creating the bf16/f16 reduction ops");
    return CT_OK;
}

void ct__dtypes_free(void)
{
    for (int t = 0; t < 2; t++)
        for (int o = 0; o < 3; o++)
            if (op16[t][o] != MPI_OP_NULL) MPI_Op_free(&op16[t][o]);
    if (t_bf16 != MPI_DATATYPE_NULL) MPI_Type_free(&t_bf16);
    if (t_f16 != MPI_DATATYPE_NULL) MPI_Type_free(&t_f16);
}

MPI_Datatype ct__mpi_dtype(ct_dtype dt)
{
    switch (dt) {
    case CT_F32: return MPI_FLOAT;
    case CT_BF16: return t_bf16;
    case CT_F16: return t_f16;
    case CT_I64: return MPI_INT64_T;
    case CT_I32: return MPI_INT32_T;
    case CT_U8: return MPI_UINT8_T;
    default: break;
    }
    CT_ASSERT(!"unknown dtype");
    return MPI_DATATYPE_NULL;
}

const char *ct__op_name(ct_reduce_op op)
{
    switch (op) {
    case CT_OP_SUM: return "SUM";
    case CT_OP_AVG: return "AVG";
    case CT_OP_MAX: return "MAX";
    case CT_OP_MIN: return "MIN";
    }
    return "?";
}

ct_status ct__check_op(ct_dtype dt, ct_reduce_op op, const char *what)
{
    if ((int)op < CT_OP_SUM || (int)op > CT_OP_MIN)
        return ct_error(CT_EINVAL, "%s: unknown reduce op %d; use CT_OP_SUM, CT_OP_AVG, CT_OP_MAX "
                                   "or CT_OP_MIN", what, (int)op);
    if (op == CT_OP_AVG && (dt == CT_I32 || dt == CT_I64 || dt == CT_U8))
        return ct_error(CT_EUNSUPPORTED, "%s: AVG is not defined for %s (integer division "
                                         "truncates); reduce with CT_OP_SUM and divide yourself",
                        what, ct_dtype_name(dt));
    return CT_OK;
}

MPI_Op ct__mpi_op(ct_dtype dt, ct_reduce_op op)
{
    int o = op == CT_OP_MAX ? 1 : op == CT_OP_MIN ? 2 : 0;
    if (dt == CT_BF16) return op16[0][o];
    if (dt == CT_F16) return op16[1][o];
    return o == 1 ? MPI_MAX : o == 2 ? MPI_MIN : MPI_SUM;
}

void ct__scale(void *buf, int64_t n, ct_dtype dt, int size)
{
    if (size == 1) return;
    float inv = 1.0f / (float)size;
    if (dt == CT_F32) {
        float *x = buf;
        for (int64_t i = 0; i < n; i++) x[i] *= inv;
    } else if (dt == CT_BF16) {
        uint16_t *x = buf;
        for (int64_t i = 0; i < n; i++) x[i] = ct_f32_to_bf16(ct_bf16_to_f32(x[i]) * inv);
    } else if (dt == CT_F16) {
        uint16_t *x = buf;
        for (int64_t i = 0; i < n; i++) x[i] = ct_f32_to_f16(ct_f16_to_f32(x[i]) * inv);
    } else {
        CT_ASSERT(!"AVG on an integer dtype");
    }
}
