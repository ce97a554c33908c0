/*
 * A user's program that makes a collective ctrain call on rank 0 only
 * (tests/test_misuse.c runs it under mpirun): saving with
 *   if (rank == 0) ct_strategy_model_state(...)
 * works by luck under a replicated strategy and waits forever under fsdp,
 * whose state is gathered from every rank.  The job must end with a message
 * that names ct_strategy_model_state: at once with CTRAIN_DEBUG=collectives,
 * else at CTRAIN_COMM_TIMEOUT.
 *
 *   misuse_prog rank0_state   fsdp, ct_strategy_model_state on rank 0 only
 *   misuse_prog all_state     the same call on every rank (exit 0)
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <ctrain/ctrain.h>

int main(int argc, char **argv)
{
    if (argc != 2 || ct_comm_init(&argc, &argv) != CT_OK) return 2;
    int me = ct_group_rank(ct_group_world());
    ct_module *m = ct_sequential_create();
    ct_module_add(m, NULL, ct_linear_create(8, 16, 1));
    ct_module_add(m, NULL, ct_relu_create());
    ct_module_add(m, NULL, ct_linear_create(16, 4, 1));
    ct_module_init_params(m, 1);
    ct_optim_opts o = ct_optim_defaults(CT_OPT_SGD);
    ct_strategy *s;
    ct_status st = ct_strategy_create("fsdp", m, &o, NULL, NULL, &s);
    if (st == CT_OK) {
        ct_state state = {0};
        if (me == 0 || !strcmp(argv[1], "all_state")) st = ct_strategy_model_state(s, &state);
        ct_state_fini(&state);
        ct_strategy_destroy(s);
    }
    if (st != CT_OK) fprintf(stderr, "misuse_prog: %s\n", ct_last_error());
    printf("misuse_prog rank %d: %s\n", me, st == CT_OK ? "done" : "failed");
    fflush(stdout);
    ct_module_destroy(m);
    ct_comm_finalize();
#if defined(__SANITIZE_ADDRESS__)
    _exit(st == CT_OK ? 0 : 1); /* Open MPI's leftovers after MPI_Finalize are not ours */
#endif
    return st == CT_OK ? 0 : 1;
}
