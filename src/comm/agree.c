/*
 * One configuration across ranks: ct_group_agree_settings compares a list
 * of key=value settings over a group before any work that depends on them.
 * The sequence of collectives is fixed (an allgather of a hash and a
 * length; only when some differ, an allgatherv of every rank's settings),
 * so ranks that disagree never wait on each other in different calls, and
 * every rank computes the same message from the same gathered text.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define MAX_NAMED 3 /* settings the message names before "and N more" */

static uint64_t fnv1a(const char *p, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 1099511628211ull;
    return h;
}

/* The value of key in the packed "key\0value\0..." blob b[0..len), or NULL. */
static const char *find(const char *b, int64_t len, const char *key)
{
    for (const char *p = b; p < b + len;) {
        const char *v = p + strlen(p) + 1;
        if (v >= b + len) return NULL;
        if (!strcmp(p, key)) return v;
        p = v + strlen(v) + 1;
    }
    return NULL;
}

static int same_value(const char *v, const char *w) { return (!v && !w) || (v && w && !strcmp(v, w)); }

/* Appends to msg who holds what for key: "rank 0 has '100', ranks 1,3 have '200'". */
static void describe(char *msg, size_t n, const char *key, const char *all, const int64_t *lens, int size)
{
    const char **v = ct_alloc(sizeof *v * (size_t)size, CT_MEM_OTHER);
    int *grp = ct_alloc(sizeof *grp * (size_t)size, CT_MEM_OTHER);
    size_t at = strlen(msg);
#define PUT(...) (at += (size_t)snprintf(msg + at, at < n ? n - at : 0, __VA_ARGS__))
    PUT("%s%s differs: ", at ? "; " : "", key);
    if (!v || !grp) goto out;
    int64_t off = 0;
    for (int r = 0; r < size; off += lens[r], r++) {
        v[r] = find(all + off, lens[r], key);
        for (grp[r] = 0; !same_value(v[grp[r]], v[r]); grp[r]++) {} /* the first rank with this value */
    }
    int groups = 0;
    for (int r = 0; r < size && at < n; r++) {
        if (grp[r] != r) continue;
        int count = 0, listed = 0;
        for (int q = r; q < size; q++) count += grp[q] == r;
        if (groups++ == 4) {
            PUT(", ...");
            break;
        }
        PUT("%s%s", groups > 1 ? ", " : "", count > 1 ? "ranks " : "rank ");
        for (int q = r; q < size && listed < 8; q++)
            if (grp[q] == r) PUT("%s%d", listed++ ? "," : "", q);
        if (count > listed) PUT(",...");
        if (v[r]) PUT(" %s '%.200s'", count > 1 ? "have" : "has", v[r]);
        else PUT(" %s no such setting", count > 1 ? "have" : "has");
    }
#undef PUT
out:
    ct_free(v);
    ct_free(grp);
}

ct_status ct_group_agree_settings(ct_group *g, const char *what, const char *const *keys, const char *const *vals,
                                  int n)
{
    CT_ASSERT(n >= 0 && (n == 0 || (keys && vals)));
    if (!g) return ct_error(CT_EINVAL, "agree settings: group is NULL");
    int size = ct_group_size(g);
    size_t len = 0;
    for (int i = 0; i < n; i++) len += strlen(keys[i]) + strlen(vals[i]) + 2;
    char *mine = ct_alloc(len + 1, CT_MEM_OTHER);
    int64_t *info = ct_alloc(sizeof *info * 2 * (size_t)size, CT_MEM_OTHER);
    int64_t *lens = ct_alloc(sizeof *lens * (size_t)size, CT_MEM_OTHER);
    char *all = NULL;
    /* The first collective happens whatever failed here, so no rank is left waiting. */
    ct_status st = ct_group_check(g, mine && info && lens ? CT_OK : CT_ENOMEM);
    if (st != CT_OK) goto out;
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        size_t kl = strlen(keys[i]) + 1, vl = strlen(vals[i]) + 1;
        memcpy(mine + at, keys[i], kl);
        memcpy(mine + at + kl, vals[i], vl);
        at += kl + vl;
    }
    int64_t me[2] = {(int64_t)fnv1a(mine, len), (int64_t)len};
    if ((st = ct_group_allgather(g, me, info, 2, CT_I64, NULL)) != CT_OK) goto out;
    int same = 1;
    int64_t total = 0;
    for (int r = 0; r < size; r++) {
        same &= info[2 * r] == info[0] && info[2 * r + 1] == info[1];
        total += lens[r] = info[2 * r + 1];
    }
    if (same) goto out;
    all = ct_alloc((size_t)total + 1, CT_MEM_OTHER);
    if ((st = ct_group_check(g, all ? CT_OK : CT_ENOMEM)) != CT_OK) goto out;
    if ((st = ct_group_allgatherv(g, mine, (int64_t)len, all, lens, NULL, CT_U8, NULL)) != CT_OK) goto out;
    /* Every key any rank has, in the order rank r first lists it, r = 0, 1, ... */
    char msg[2048] = "";
    int named = 0, more = 0;
    int64_t off = 0;
    for (int r = 0; r < size; off += lens[r], r++) {
        const char *b = all + off;
        for (const char *p = b; p < b + lens[r];) {
            const char *v = p + strlen(p) + 1;
            int dup = 0, differs = 0;
            int64_t o2 = 0;
            for (int q = 0; q < size; o2 += lens[q], q++) {
                if (q < r && find(all + o2, lens[q], p)) dup = 1; /* listed already under an earlier rank */
                const char *w = find(all + o2, lens[q], p);
                differs |= !w || strcmp(w, v);
            }
            if (!dup && differs) {
                if (named < MAX_NAMED) describe(msg, sizeof msg, p, all, lens, size);
                else more++;
                named++;
            }
            p = v + strlen(v) + 1;
        }
    }
    if (!named) snprintf(msg, sizeof msg, "the same settings in a different order");
    char tail[48] = "";
    if (more) snprintf(tail, sizeof tail, " (and %d more)", more);
    st = ct_error(CT_EINVAL, "ranks disagree on %s: %s%s; every rank must run the same configuration: give "
                  "every rank the same flags", what, msg, tail);
out:
    ct_free(all);
    ct_free(lens);
    ct_free(info);
    ct_free(mine);
    return st;
}
