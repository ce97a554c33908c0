/*
 * A program whose ranks call different collectives, for the collective
 * fingerprint test (tests/test_reliability.c runs it under mpirun with
 * CTRAIN_DEBUG=collectives):
 *   fp_prog kinds   rank 0 allreduces 16 floats, the others broadcast 16
 *   fp_prog count   rank 0 allreduces 16 floats, the others 32
 *   fp_prog same    every rank allreduces 16 floats (exit 0)
 * With fingerprints the mismatch ends the job naming both ranks and calls.
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <ctrain/ctrain.h>

int main(int argc, char **argv)
{
    if (argc != 2) return 2;
    if (ct_comm_init(&argc, &argv) != CT_OK) return 1;
    ct_group *g = ct_group_world();
    int me = ct_group_rank(g);
    float buf[32] = {1};
    ct_status st = ct_group_allreduce(g, buf, 4, CT_F32, CT_OP_SUM, NULL); /* one that matches first */
    if (st == CT_OK) {
        if (!strcmp(argv[1], "kinds") && me > 0) st = ct_group_broadcast(g, buf, 16, CT_F32, 0, NULL);
        else if (!strcmp(argv[1], "count") && me > 0) st = ct_group_allreduce(g, buf, 32, CT_F32, CT_OP_SUM, NULL);
        else st = ct_group_allreduce(g, buf, 16, CT_F32, CT_OP_SUM, NULL);
    }
    if (st != CT_OK) fprintf(stderr, "fp_prog: %s\n", ct_last_error());
    printf("fp_prog rank %d: %s, fingerprints %s\n", me, st == CT_OK ? "done" : "failed",
           ct_comm_debug_collectives() ? "on" : "off");
    ct_comm_finalize();
#if defined(__SANITIZE_ADDRESS__)
    /* Open MPI's leftovers after MPI_Finalize are not ours (see test_comm_single.c). */
    fflush(stdout);
    _exit(st == CT_OK ? 0 : 1);
#endif
    return st == CT_OK ? 0 : 1;
}
