/*
 * Tests of status codes, the per-thread error message (src/core/status.c)
 * and logging (src/core/log.c).  Log lines are captured by pointing stderr
 * at a scratch file.
 */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "test.h"

TEST(core_error_sets_message_and_returns_code)
{
    ct_clear_error();
    ASSERT(!strcmp(ct_last_error(), ""));
    ASSERT_EQ(ct_error(CT_EIO, "cannot open %s (%d); check the path", "x.bin", 2), CT_EIO);
    ASSERT(!strcmp(ct_last_error(), "cannot open x.bin (2); check the path"));
    ASSERT_EQ(ct_error(CT_EINVAL, "second"), CT_EINVAL); /* the latest wins */
    ASSERT(!strcmp(ct_last_error(), "second"));
    ct_clear_error();
    ASSERT(!strcmp(ct_last_error(), ""));

    /* Wrapping the previous message with context must not garble it. */
    ct_error(CT_EIO, "short read at byte %d", 17);
    ct_error(CT_EIO, "loading model.safetensors: %s", ct_last_error());
    ASSERT(!strcmp(ct_last_error(), "loading model.safetensors: short read at byte 17"));
    ct_error(CT_EIO, "%s (rank 3)", ct_last_error());
    ASSERT(!strcmp(ct_last_error(), "loading model.safetensors: short read at byte 17 (rank 3)"));

    /* Long messages are cut, not overrun (ASan watches the buffer). */
    char big[5000];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = 0;
    ct_error(CT_EFORMAT, "%s", big);
    size_t len = strlen(ct_last_error());
    ASSERT(len > 1024 && len < sizeof big - 1); /* issue 13: messages were cut at 1024 bytes */
    /* A cut message says so: it ends in "..." (issue 13). */
    ASSERT(ct_last_error()[0] == 'a' && ct_last_error()[len - 4] == 'a' && !strcmp(ct_last_error() + len - 3, "..."));
}

TEST(core_strerror_every_code)
{
    struct { ct_status s; const char *name; } want[] = {
        {CT_OK, "ok"},
        {CT_EINVAL, "invalid argument"},
        {CT_ENOMEM, "out of memory"},
        {CT_EIO, "i/o error"},
        {CT_EFORMAT, "malformed data"},
        {CT_ECOMM, "communication error"},
        {CT_ESTATE, "invalid state"},
        {CT_EUNSUPPORTED, "unsupported"},
    };
    int n = (int)(sizeof want / sizeof want[0]);
    for (int i = 0; i < n; i++) {
        ASSERT_EQ(want[i].s, -i); /* the codes are 0, -1, ..., -7 */
        ASSERT(!strcmp(ct_strerror(want[i].s), want[i].name));
    }
    int unknown[] = {1, -8, -100, 12345};
    for (int i = 0; i < 4; i++) {
        const char *s = ct_strerror(unknown[i]);
        ASSERT(s != NULL && s[0]);
        for (int j = 0; j < n; j++) ASSERT(strcmp(s, want[j].name));
    }
}

static void *thread_body(void *arg)
{
    char *result = arg;
    /* A new thread starts with no message, whatever main has set. */
    snprintf(result, 256, "start='%s'", ct_last_error());
    ct_error(CT_ECOMM, "thread message");
    size_t n = strlen(result);
    snprintf(result + n, 256 - n, " after='%s'", ct_last_error());
    return NULL;
}

TEST(core_error_message_is_per_thread)
{
    ct_error(CT_EINVAL, "main message");
    char result[256] = "";
    pthread_t th;
    ASSERT_EQ(pthread_create(&th, NULL, thread_body, result), 0);
    ASSERT_EQ(pthread_join(th, NULL), 0);
    ASSERT(!strcmp(result, "start='' after='thread message'"));
    ASSERT(!strcmp(ct_last_error(), "main message"));
}

/* Runs fn with stderr sent to a scratch file; returns what was written. */
static char captured[8192];

static const char *capture_stderr(void (*fn)(void))
{
    char path[512];
    snprintf(path, sizeof path, "%s/stderr.txt", ct_test_tmpdir());
    FILE *f = fopen(path, "w+");
    if (!f) ct_test_fail(__FILE__, __LINE__, "cannot create %s", path);
    fflush(stderr);
    int saved = dup(2);
    dup2(fileno(f), 2);
    fn();
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    rewind(f);
    size_t n = fread(captured, 1, sizeof captured - 1, f);
    captured[n] = 0;
    fclose(f);
    unlink(path);
    return captured;
}

static void log_sample(void)
{
    ct_log_set_rank(0, 1);
    ct_log_set_level(CT_LOG_INFO);
    ct_log(CT_LOG_INFO, "plain %d", 1);
    ct_log(CT_LOG_DEBUG, "hidden debug");
    ct_log(CT_LOG_WARN, "careful");
    ct_log_set_rank(1, 2);
    ct_log(CT_LOG_ERROR, "broken %s", "pipe");
    ct_log_set_rank(2, 4);
    ct_log_set_level(CT_LOG_ERROR);
    ct_log(CT_LOG_WARN, "hidden warning");
    ct_log_set_level(CT_LOG_DEBUG);
    ct_log(CT_LOG_DEBUG, "shown debug");
    ct_log_set_rank(0, 1);
}

TEST(core_log_format_and_levels)
{
    const char *out = capture_stderr(log_sample);
    const char *want = "plain 1\n"
                       "warning: careful\n"
                       "[rank 1/2] error: broken pipe\n"
                       "[rank 2/4] debug: shown debug\n";
    if (strcmp(out, want)) ct_test_fail(__FILE__, __LINE__, "log output:\n%s---\nwanted:\n%s", out, want);
    ASSERT_EQ(ct_log_get_level(), CT_LOG_DEBUG);
}

static void log_long(void)
{
    static char big[3000];
    memset(big, 'z', sizeof big - 1);
    ct_log_set_level(CT_LOG_INFO);
    ct_log(CT_LOG_INFO, "%s", big);
    ct_log(CT_LOG_INFO, "next");
}

TEST(core_log_truncated_line_still_ends)
{
    /* An over-long message is cut, but it stays one line: the next message
     * must not be glued onto it. */
    const char *out = capture_stderr(log_long);
    const char *nl = strchr(out, '\n');
    ASSERT(nl != NULL);
    ASSERT(nl - out > 1000);
    ASSERT(!strcmp(nl + 1, "next\n"));
}

TEST(core_log_level_from_env)
{
    /* Each test is a fresh process, so the level is still unread here. */
    setenv("CTRAIN_LOG", "warn", 1);
    ASSERT_EQ(ct_log_get_level(), CT_LOG_WARN);
    ct_log_set_level(CT_LOG_ERROR);
    ASSERT_EQ(ct_log_get_level(), CT_LOG_ERROR);
    unsetenv("CTRAIN_LOG");
}
