/*
 * ctrain on a cluster of hosts made by scripts/cluster (network namespaces
 * on a bridge, TCP only, each host its own hostname and /dev/shm): every
 * strategy at 2 hosts x 1 and 2 hosts x 2 ranks equals one process (the
 * multi-rank suite's comparisons, run across the hosts, and the ctrain
 * command's checkpoints); ctrain's nodes are the hosts and no shared memory
 * spans them (tests/mpi/test_cluster.c); a rank killed on one host ends the
 * job within 10 s; a host that does not answer is a clear error before any
 * MPI job starts; the script refuses, saying why, where it cannot make
 * namespaces.  Skipped, with the script's reason, where namespaces cannot
 * be made (not root, no CAP_NET_ADMIN).  Run from the repository root.
 */
#include <dirent.h>
#include <stdarg.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli_util.h"

#define CLUSTER "scripts/cluster"
#define SKIP_RC 77

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Runs a shell command line with stderr joined to stdout into out; its exit code. */
static int sh(char *out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int sh(char *out, const char *fmt, ...)
{
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char full[8300];
    snprintf(full, sizeof full, "( %s ) 2>&1", cmd);
    return capture(full, out);
}

/* Skips the test, with the script's reason, where no cluster can be made. */
static void need_cluster(void)
{
    static char out[OUT_MAX];
    if (access(CLUSTER, X_OK) != 0) SKIP("needs %s (run from the repository root)", CLUSTER);
    int rc = sh(out, CLUSTER " check");
    if (rc == SKIP_RC) SKIP("%s", out);
    if (rc != 0) ct_test_fail(__FILE__, __LINE__, "cluster check failed (%d):\n%s", rc, out);
}

/* The multi-rank suite binary beside this one. */
static const char *mpi_run(void)
{
    static char path[1100];
    snprintf(path, sizeof path, "%s/tests/mpi_run", cli_bin_dir());
    return path;
}

/* The multi-rank suite's comparisons with one process, across 2 hosts of
 * per_host ranks: every strategy (ddp, zero1, zero2, fsdp in every sharding
 * and hybrid over the hosts, pipe, pipe x ddp, offload x ddp), the mlp-like
 * models and the tied gpt, f32 and bf16, DDP and ZeRO-1 with PowerSGD; and
 * the cluster's own checks. */
static void suite_on_hosts(int per_host)
{
    static char out[OUT_MAX];
    need_cluster();
    int rc = sh(out, CLUSTER " run --hosts 2 --per-host %d --rate 10gbit -- %s equals_one_process "
                "matches_single_process with_replicas offload_ddp powersgd cluster_",
                per_host, mpi_run());
    if (rc != 0 || strstr(out, "\nFAIL ") || !strstr(out, " 0 failed, 0 skipped"))
        ct_test_fail(__FILE__, __LINE__, "the suite across 2 hosts x %d failed (%d):\n%s", per_host, rc, out);
    /* The strategies that must have run (a renamed test would drop out silently) */
    const char *must[] = {"ok ddp_matches_single_process_adamw", "ok zero1_equals_one_process",
                          "ok zero2_equals_one_process", "ok fsdp_full_shard_equals_one_process",
                          "ok fsdp_each_sharding_strategy_equals_one_process", "ok pipe_two_stages_with_replicas_ddp",
                          "ok offload_ddp_matches_single_process", "ok gpt_tied_pipe_equals_one_process",
                          "ok gpt_tied_pipe_with_replicas_equals_one_process", "ok gpt_tied_mixed_bf16_equals_one_process",
                          "ok gpt_tied_fsdp_equals_one_process", "ok zero_mixed_bf16_equals_one_process",
                          "ok ddp_powersgd_equals_one_process", "ok cluster_nodes_are_the_hosts", "ok cluster_no_shared_memory_across_hosts",
                          "ok cluster_fsdp_hybrid_shards_inside_a_host_and_equals_one_process"};
    for (size_t i = 0; i < sizeof must / sizeof must[0]; i++) ASSERT_STR_CONTAINS(out, must[i]);
    ASSERT_STR_CONTAINS(out, per_host == 1 ? "2 ranks over 2 hosts" : "4 ranks over 2 hosts");
}

TEST(cluster_2_hosts_x_1_every_strategy_equals_one_process) { suite_on_hosts(1); }
TEST(cluster_2_hosts_x_2_every_strategy_equals_one_process) { suite_on_hosts(2); }

/* The relative L2 distance of two checkpoints' tensors, all taken as one
 * vector (a bias of tiny values that Adam moves by its learning rate
 * either way does not swamp it). */
static double ckpt_distance(const char *a, const char *b)
{
    ct_safetensors *x, *y;
    ASSERT_OK(ct_safetensors_load(a, &x));
    ASSERT_OK(ct_safetensors_load(b, &y));
    ASSERT_EQ(ct_safetensors_count(x), ct_safetensors_count(y));
    double d2 = 0, n2 = 0;
    for (int i = 0; i < ct_safetensors_count(x); i++) {
        const ct_tensor *tx = ct_safetensors_tensor(x, i), *ty = ct_safetensors_tensor(y, i);
        ASSERT(!strcmp(ct_safetensors_name(x, i), ct_safetensors_name(y, i)));
        ASSERT(ct_tensor_same_shape(tx, ty));
        ASSERT_EQ(tx->dtype, CT_F32);
        const float *p = ct_tensor_data(tx), *q = ct_tensor_data(ty);
        for (int64_t k = 0; k < tx->numel; k++) {
            d2 += ((double)p[k] - q[k]) * ((double)p[k] - q[k]);
            n2 += (double)q[k] * q[k];
        }
    }
    ct_safetensors_destroy(x);
    ct_safetensors_destroy(y);
    return sqrt(d2 / (n2 > 0 ? n2 : 1));
}

#define MLP_ "--model mlp --hidden 32,16 --batch 24 --threads 1 --lr 0.01"
#define MLP MLP_ " --log-every 0"
#define GPT "--model gpt --layers 2 --heads 2 --dim 32 --context 16 --batch 8 --log-every 0 --threads 1 --dropout 0.1"

/* The ctrain command across hosts saves the checkpoint one process saves. */
TEST(cluster_ctrain_command_equals_one_process)
{
    static char out[OUT_MAX];
    need_cluster();
    const char *t = ct_test_tmpdir();
    struct {
        const char *model, *flags;
        int per_host;
    } runs[] = {
        {MLP, "--strategy ddp", 2},
        {MLP, "--strategy zero2 --mixed bf16", 1},
        {GPT, "--strategy fsdp --sharding hybrid --mixed bf16", 2},
        {GPT, "--strategy pipe", 1},
        {GPT, "--strategy zero1", 2},
    };
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        char one[700], many[700];
        snprintf(one, sizeof one, "%s/one%zu.safetensors", t, i);
        snprintf(many, sizeof many, "%s/many%zu.safetensors", t, i);
        const char *mixed = strstr(runs[i].flags, "--mixed bf16") ? "--mixed bf16" : "";
        int rc = sh(out, "%s/ctrain train %s --steps 6 %s --save %s", cli_bin_dir(), runs[i].model, mixed, one);
        if (rc) ct_test_fail(__FILE__, __LINE__, "one process failed:\n%s", out);
        rc = sh(out, CLUSTER " run --hosts 2 --per-host %d -- %s/ctrain train %s --steps 6 %s --save %s", runs[i].per_host,
                cli_bin_dir(), runs[i].model, runs[i].flags, many);
        if (rc) ct_test_fail(__FILE__, __LINE__, "%s across 2 hosts x %d failed:\n%s", runs[i].flags, runs[i].per_host, out);
        double d = ckpt_distance(many, one), tol = *mixed ? 2e-3 : 1e-5;
        printf("    %s across 2 hosts x %d: relative distance %.3g to one process\n", runs[i].flags, runs[i].per_host, d);
        if (!(d <= tol)) ct_test_fail(__FILE__, __LINE__, "%s across 2 hosts x %d: weights %g from one process's (tolerance %g)",
                                      runs[i].flags, runs[i].per_host, d, tol);
    }
}

/* Bytes all hosts of cluster name sent, from the bridge ports' counters. */
static double wire_sent(const char *name)
{
    static char out[OUT_MAX];
    if (sh(out, CLUSTER " bytes --name %s", name)) ct_test_fail(__FILE__, __LINE__, "cluster bytes failed:\n%s", out);
    double sum = 0;
    for (const char *p = out; (p = strstr(p, " sent ")); p += 6) sum += atof(p + 6);
    return sum;
}

/* The step report's messages per rank (ct_comm_traffic) are what the links
 * carried: DDP across 2 hosts x 1, two runs of S1 and S2 steps, the
 * difference of the links' bytes over S2 - S1 steps (set-up, evaluation and
 * MPI's wire-up cancel) against the ranks' reported sent bytes per step,
 * within 10% (TCP and IP headers, acknowledgements); each rank sends the 4P
 * gradient bytes once (a ring over 2 ranks). */
TEST(cluster_step_report_counts_the_wire)
{
    static char out[OUT_MAX];
    need_cluster();
    char name[64], metrics[700];
    snprintf(name, sizeof name, "ctt%d", (int)getpid());
    snprintf(metrics, sizeof metrics, "%s/traffic.jsonl", ct_test_tmpdir());
    if (sh(out, CLUSTER " up 2 --name %s", name)) ct_test_fail(__FILE__, __LINE__, "cluster up failed:\n%s", out);
    const int s1 = 2, s2 = 6;
    double b[3];
    int rc = 0;
    b[0] = wire_sent(name);
    for (int k = 0; k < 2 && !rc; k++) {
        rc = sh(out, CLUSTER " run --name %s --per-host 1 -- %s/ctrain train --model mlp --hidden 256 --batch 32 "
                     "--steps %d --threads 1 --log-every 0 --limit-test 64 --strategy ddp --metrics %s",
                name, cli_bin_dir(), k ? s2 : s1, metrics);
        b[k + 1] = wire_sent(name);
    }
    static char down[OUT_MAX];
    sh(down, CLUSTER " down --name %s", name);
    if (rc) ct_test_fail(__FILE__, __LINE__, "ddp across 2 hosts failed:\n%s", out);
    ASSERT_STR_CONTAINS(out, "messages per step");
    size_t n;
    char *line = (char *)read_file(metrics, &n), *last = line, *p;
    line[n] = 0;
    while ((p = strstr(last + 1, "\"event\":\"summary\""))) last = p;
    double sent = json_max(last, "sent"), per_host = ((b[2] - b[1]) - (b[1] - b[0])) / (s2 - s1) / 2;
    free(line);
    const double P = 784 * 256 + 256 + 256 * 10 + 10;
    printf("    reported %.0f bytes sent per rank and step (4P = %.0f), the links carried %.0f per host\n", sent, 4 * P,
           per_host);
    ASSERT(sent >= 4 * P && sent <= 4 * P + 64);
    if (!(fabs(per_host - sent) <= 0.10 * sent))
        ct_test_fail(__FILE__, __LINE__, "the links carried %.0f bytes per host and step, the report says %.0f", per_host,
                     sent);
}

/* A process of ours whose environment holds both strings (the rank we
 * tagged), or 0. */
static pid_t find_rank(const char *tag, const char *rank)
{
    DIR *d = opendir("/proc");
    ASSERT(d);
    pid_t found = 0;
    struct dirent *e;
    while (!found && (e = readdir(d))) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        char path[300], env[1 << 16];
        snprintf(path, sizeof path, "/proc/%s/environ", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        size_t n = fread(env, 1, sizeof env - 1, f);
        fclose(f);
        for (size_t k = 0; k < n; k++)
            if (!env[k]) env[k] = '\n';
        env[n] = 0;
        char comm[300] = "";
        snprintf(path, sizeof path, "/proc/%s/comm", e->d_name);
        if ((f = fopen(path, "r"))) {
            if (!fgets(comm, sizeof comm, f)) comm[0] = 0;
            fclose(f);
        }
        if (strstr(env, tag) && strstr(env, rank) && !strncmp(comm, "ctrain", 6)) found = (pid_t)atoi(e->d_name);
    }
    closedir(d);
    return found;
}

/* Rank 3, on host 1, killed with SIGKILL in mid-training: the launcher
 * returns an error within 10 s, naming the rank, and nothing of the job
 * (or of the cluster) is left. */
TEST(cluster_killed_rank_ends_the_job_within_10s)
{
    static char out[OUT_MAX];
    need_cluster();
    char tag[64], log[700];
    snprintf(tag, sizeof tag, "CT_CLUSTER_KILL_TEST=%d", (int)getpid());
    snprintf(log, sizeof log, "%s/job.log", ct_test_tmpdir());
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0);
        putenv(tag);
        char cmd[4096];
        snprintf(cmd, sizeof cmd,
                 CLUSTER " run --hosts 2 --per-host 2 -- %s/ctrain train " MLP_ " --steps 1000000 --log-every 1 > %s 2>&1",
                 cli_bin_dir(), log);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    ASSERT(pid > 0);
    /* Wait for rank 3 to be training (it has logged steps through rank 0). */
    pid_t victim = 0;
    double t0 = now();
    while (now() - t0 < 60) {
        if (!victim) victim = find_rank(tag, "OMPI_COMM_WORLD_RANK=3");
        FILE *f = fopen(log, "r");
        size_t n = f ? fread(out, 1, OUT_MAX - 1, f) : 0;
        if (f) fclose(f);
        out[n] = 0;
        if (victim && strstr(out, "step 3/")) break;
        if (waitpid(pid, NULL, WNOHANG) == pid) ct_test_fail(__FILE__, __LINE__, "the job ended by itself:\n%s", out);
        usleep(50000);
    }
    if (!victim || !strstr(out, "step 3/")) {
        kill(-pid, SIGKILL);
        waitpid(pid, NULL, 0);
        ct_test_fail(__FILE__, __LINE__, "rank 3 never started training:\n%s", out);
    }
    ASSERT_EQ(kill(victim, SIGKILL), 0);
    double killed = now();
    int st = 0;
    while (waitpid(pid, &st, WNOHANG) != pid) {
        if (now() - killed > 30) {
            kill(-pid, SIGKILL);
            waitpid(pid, &st, 0);
            ct_test_fail(__FILE__, __LINE__, "the job still ran 30 s after rank 3 was killed");
        }
        usleep(20000);
    }
    double took = now() - killed;
    /* the log's end: the error naming the rank comes after every rank's
     * step lines (--log-every 1), which under load pass OUT_MAX */
    FILE *f = fopen(log, "r");
    size_t n = 0;
    if (f) {
        long size = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : 0;
        if (size > OUT_MAX - 1) fseek(f, size - (OUT_MAX - 1), SEEK_SET);
        else rewind(f);
        n = fread(out, 1, OUT_MAX - 1, f);
        fclose(f);
    }
    out[n] = 0;
    printf("    the job ended %.1f s after rank 3 was killed\n", took);
    if (!(took <= 10)) ct_test_fail(__FILE__, __LINE__, "the job took %.1f s to end after rank 3 was killed:\n%s", took, out);
    ASSERT(WIFEXITED(st) && WEXITSTATUS(st) != 0);
    ASSERT_STR_CONTAINS(out, "rank 3");
    usleep(200000);
    ASSERT_EQ(find_rank(tag, "OMPI_COMM_WORLD_RANK="), 0); /* every rank is gone */
}

/* A host in the hostfile that does not exist, and a host whose link is
 * unplugged: each an error naming the address, before mpirun, quickly. */
TEST(cluster_unreachable_host_is_a_clear_error)
{
    static char out[OUT_MAX];
    need_cluster();
    char hf[700], name[64];
    snprintf(hf, sizeof hf, "%s/hosts", ct_test_tmpdir());
    FILE *f = fopen(hf, "w");
    ASSERT(f);
    fputs("10.77.0.1 slots=1\n10.77.0.9 slots=1\n", f);
    fclose(f);
    double t0 = now();
    int rc = sh(out, CLUSTER " run --hosts 2 --hostfile %s -- hostname", hf);
    ASSERT(rc != 0);
    ASSERT_STR_CONTAINS(out, "host(s) 10.77.0.9 do not answer from host 0");
    ASSERT(strstr(out, "cluster: 2 ranks") == NULL); /* no MPI job was started */
    ASSERT(now() - t0 < 20);
    /* A cluster that stays up: unplug host 1, the run names it; plug it back, the run works. */
    snprintf(name, sizeof name, "t%d", (int)getpid());
    rc = sh(out, CLUSTER " up 2 --name %s", name);
    if (rc) ct_test_fail(__FILE__, __LINE__, "up failed:\n%s", out);
    ASSERT_STR_CONTAINS(out, "host 1: ");
    static char down[OUT_MAX], back[OUT_MAX];
    rc = sh(down, CLUSTER " link --name %s 1 down && " CLUSTER " run --name %s -- hostname", name, name);
    int rc2 = sh(back, CLUSTER " link --name %s 1 up && " CLUSTER " run --name %s -- hostname", name, name);
    sh(out, CLUSTER " down --name %s", name);
    ASSERT_STR_CONTAINS(out, "is down");
    ASSERT(rc != 0);
    ASSERT_STR_CONTAINS(down, "host(s) 10.77.0.2 do not answer from host 0");
    if (rc2 != 0) ct_test_fail(__FILE__, __LINE__, "the run after plugging the link back failed:\n%s", back);
    char host1[80];
    snprintf(host1, sizeof host1, "%s-h1", name);
    ASSERT_STR_CONTAINS(back, host1);
    rc = sh(out, CLUSTER " status --name %s", name);
    ASSERT(rc != 0);
    ASSERT_STR_CONTAINS(out, "is up");
}

/* Where namespaces cannot be made the script refuses with status 77 and
 * the reason: not root; root without CAP_NET_ADMIN and CAP_SYS_ADMIN. */
TEST(cluster_refuses_without_root_or_capabilities)
{
    static char out[OUT_MAX];
    if (access(CLUSTER, X_OK) != 0) SKIP("needs %s (run from the repository root)", CLUSTER);
    int rc = sh(out, "setpriv --reuid=65534 --regid=65534 --clear-groups --reset-env " CLUSTER " run -- hostname");
    if (getuid() != 0 && rc == 127) SKIP("not root: cannot change to another user to test the refusal");
    ASSERT_EQ(rc, SKIP_RC);
    ASSERT_STR_CONTAINS(out, "cluster: cannot make a cluster here: not root");
    if (getuid() != 0) return;
    rc = sh(out, "setpriv --bounding-set=-net_admin,-sys_admin --inh-caps=-net_admin,-sys_admin " CLUSTER " up 2 --name nocaps%d",
            (int)getpid());
    ASSERT_EQ(rc, SKIP_RC);
    ASSERT_STR_CONTAINS(out, "CAP_SYS_ADMIN and CAP_NET_ADMIN are needed");
}
