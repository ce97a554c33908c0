/*
 * A small strict JSON parser for safetensors headers, UTF-8 validation, and
 * the growable buffer the writer builds headers in.  The parser never trusts
 * its input: it bounds nesting depth and the number of values, checks every
 * escape and every byte of UTF-8, and reports the byte offset of a problem.
 */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define MAX_DEPTH 64
#define MAX_NODES (1 << 22) /* ~10 values per tensor: room for 400k tensors */

/* ---- UTF-8 ------------------------------------------------------------- */

size_t ct__utf8_check(const char *str, size_t n)
{
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c < 0x80) { i++; continue; }
        size_t need;
        unsigned lo = 0x80, hi = 0xBF; /* allowed range of the 2nd byte */
        if (c >= 0xC2 && c <= 0xDF) need = 1;
        else if (c >= 0xE0 && c <= 0xEF) {
            need = 2;
            if (c == 0xE0) lo = 0xA0;      /* overlong */
            if (c == 0xED) hi = 0x9F;      /* surrogates */
        } else if (c >= 0xF0 && c <= 0xF4) {
            need = 3;
            if (c == 0xF0) lo = 0x90;      /* overlong */
            if (c == 0xF4) hi = 0x8F;      /* past U+10FFFF */
        } else return i;
        if (n - i <= need) return i;
        if (s[i + 1] < lo || s[i + 1] > hi) return i;
        for (size_t k = 2; k <= need; k++)
            if ((s[i + k] & 0xC0) != 0x80) return i;
        i += need + 1;
    }
    return n;
}

/* ---- parser ------------------------------------------------------------ */

typedef struct {
    const char *t;
    size_t len, i;
    const char *what;
    const char *label;  /* "header JSON", "index JSON" */
    const char *hint;   /* what a bad document means, for the message */
    ct__json_doc *doc;
    ct_status st; /* why parsing stopped */
} parser;

static ct_status perr(parser *p, size_t at, const char *problem)
{
    return p->st = ct_error(CT_EFORMAT, "%s: %s: %s at byte %zu; %s", p->what, p->label, problem, at, p->hint);
}

static void skip_ws(parser *p)
{
    while (p->i < p->len) {
        char c = p->t[p->i];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->i++;
    }
}

static int32_t new_node(parser *p, ct__jkind kind)
{
    ct__json_doc *d = p->doc;
    if (d->n == d->cap) {
        if (d->cap >= MAX_NODES) {
            p->st = ct_error(CT_EFORMAT, "%s: %s has more than %d values; %s", p->what, p->label, MAX_NODES,
                             p->hint);
            return -1;
        }
        int32_t cap = d->cap ? d->cap * 2 : 64;
        ct__json *nn = ct_alloc_zeroed((size_t)cap * sizeof *nn, CT_MEM_OTHER);
        if (!nn) {
            p->st = CT_ENOMEM;
            return -1;
        }
        if (d->n) memcpy(nn, d->nodes, (size_t)d->n * sizeof *nn);
        ct_free(d->nodes);
        d->nodes = nn;
        d->cap = cap;
    }
    ct__json *j = &d->nodes[d->n];
    memset(j, 0, sizeof *j);
    j->kind = kind;
    j->first = j->next = -1;
    j->pos = p->i;
    return d->n++;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Reads 4 hex digits at p->i; -1 on a bad digit. */
static long hex4(parser *p)
{
    if (p->len - p->i < 4) return -1;
    long v = 0;
    for (int k = 0; k < 4; k++) {
        int h = hexval(p->t[p->i + (size_t)k]);
        if (h < 0) return -1;
        v = v * 16 + h;
    }
    p->i += 4;
    return v;
}

/* Parses a string at p->i (on the opening quote) into doc->strs. */
static ct_status parse_string(parser *p, const char **out, size_t *outlen)
{
    ct__json_doc *d = p->doc;
    size_t start = p->i++;
    char *o = d->strs + d->strs_used, *o0 = o;
    for (;;) {
        if (p->i >= p->len) return perr(p, start, "unterminated string");
        unsigned char c = (unsigned char)p->t[p->i];
        if (c == '"') { p->i++; break; }
        if (c < 0x20) return perr(p, p->i, "control character inside a string");
        if (c != '\\') { *o++ = (char)c; p->i++; continue; }
        size_t esc = p->i++;
        if (p->i >= p->len) return perr(p, esc, "unterminated escape");
        char e = p->t[p->i++];
        switch (e) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '/': *o++ = '/'; break;
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'n': *o++ = '\n'; break;
        case 'r': *o++ = '\r'; break;
        case 't': *o++ = '\t'; break;
        case 'u': {
            long cp = hex4(p);
            if (cp < 0) return perr(p, esc, "bad \\u escape (needs 4 hex digits)");
            if (cp >= 0xDC00 && cp <= 0xDFFF) return perr(p, esc, "\\u escape is a lone low surrogate");
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                if (p->len - p->i < 2 || p->t[p->i] != '\\' || p->t[p->i + 1] != 'u')
                    return perr(p, esc, "\\u escape is a high surrogate without its low half");
                p->i += 2;
                long lo = hex4(p);
                if (lo < 0xDC00 || lo > 0xDFFF)
                    return perr(p, esc, "\\u surrogate pair has a bad low half");
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            /* A \u escape takes 6 or 12 bytes of text and yields at most 4. */
            if (cp < 0x80) *o++ = (char)cp;
            else if (cp < 0x800) {
                *o++ = (char)(0xC0 | (cp >> 6));
                *o++ = (char)(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                *o++ = (char)(0xE0 | (cp >> 12));
                *o++ = (char)(0x80 | ((cp >> 6) & 0x3F));
                *o++ = (char)(0x80 | (cp & 0x3F));
            } else {
                *o++ = (char)(0xF0 | (cp >> 18));
                *o++ = (char)(0x80 | ((cp >> 12) & 0x3F));
                *o++ = (char)(0x80 | ((cp >> 6) & 0x3F));
                *o++ = (char)(0x80 | (cp & 0x3F));
            }
            break;
        }
        default: return perr(p, esc, "unknown escape in a string");
        }
    }
    *o++ = 0;
    d->strs_used += (size_t)(o - o0);
    *out = o0;
    *outlen = (size_t)(o - o0) - 1;
    return CT_OK;
}

static ct_status parse_int(parser *p, int64_t *out)
{
    size_t start = p->i;
    int neg = 0;
    if (p->t[p->i] == '-') { neg = 1; p->i++; }
    if (p->i >= p->len || p->t[p->i] < '0' || p->t[p->i] > '9') return perr(p, start, "bad number");
    if (p->t[p->i] == '0' && p->i + 1 < p->len && p->t[p->i + 1] >= '0' && p->t[p->i + 1] <= '9')
        return perr(p, start, "number with a leading zero");
    uint64_t v = 0, lim = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    while (p->i < p->len && p->t[p->i] >= '0' && p->t[p->i] <= '9') {
        unsigned dgt = (unsigned)(p->t[p->i] - '0');
        if (v > (lim - dgt) / 10) return perr(p, start, "integer does not fit in 64 bits");
        v = v * 10 + dgt;
        p->i++;
    }
    if (p->i < p->len && (p->t[p->i] == '.' || p->t[p->i] == 'e' || p->t[p->i] == 'E'))
        return perr(p, start, "number is not an integer (only integers belong in safetensors headers and indexes)");
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return CT_OK;
}

static int32_t parse_value(parser *p, int depth);

/* Parses the members (objects) or items (arrays) after the opening bracket. */
static ct_status parse_children(parser *p, int32_t self, int is_obj, int depth)
{
    char close = is_obj ? '}' : ']';
    int32_t last = -1;
    skip_ws(p);
    if (p->i < p->len && p->t[p->i] == close) { p->i++; return CT_OK; }
    for (;;) {
        const char *key = NULL;
        size_t keylen = 0;
        skip_ws(p);
        if (is_obj) {
            if (p->i >= p->len || p->t[p->i] != '"') return perr(p, p->i, "expected a string key");
            CT_TRY(parse_string(p, &key, &keylen));
            skip_ws(p);
            if (p->i >= p->len || p->t[p->i] != ':') return perr(p, p->i, "expected ':' after a key");
            p->i++;
            skip_ws(p);
        }
        int32_t kid = parse_value(p, depth + 1);
        if (kid < 0) return p->st;
        ct__json *nodes = p->doc->nodes;
        nodes[kid].key = key;
        nodes[kid].keylen = keylen;
        if (last < 0) nodes[self].first = kid;
        else nodes[last].next = kid;
        nodes[self].count++;
        last = kid;
        skip_ws(p);
        if (p->i >= p->len) return perr(p, p->i, is_obj ? "unterminated object" : "unterminated array");
        char c = p->t[p->i++];
        if (c == close) return CT_OK;
        if (c != ',') return perr(p, p->i - 1, is_obj ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

/* Returns the new node's index, or -1 with the error set. */
static int32_t parse_value(parser *p, int depth)
{
    if (depth > MAX_DEPTH) {
        perr(p, p->i, "nesting deeper than 64 levels");
        return -1;
    }
    skip_ws(p);
    if (p->i >= p->len) {
        perr(p, p->i, "unexpected end of text");
        return -1;
    }
    char c = p->t[p->i];
    int32_t self;
    if (c == '{' || c == '[') {
        self = new_node(p, c == '{' ? CT__JOBJ : CT__JARR);
        if (self < 0) return -1;
        p->i++;
        if (parse_children(p, self, c == '{', depth) != CT_OK) return -1;
        return self;
    }
    if (c == '"') {
        self = new_node(p, CT__JSTR);
        if (self < 0) return -1;
        const char *s = NULL;
        size_t n = 0;
        if (parse_string(p, &s, &n) != CT_OK) return -1;
        p->doc->nodes[self].str = s;
        p->doc->nodes[self].len = n;
        return self;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        self = new_node(p, CT__JINT);
        if (self < 0) return -1;
        int64_t v = 0;
        if (parse_int(p, &v) != CT_OK) return -1;
        p->doc->nodes[self].ival = v;
        return self;
    }
    static const struct { const char *word; ct__jkind kind; int v; } lits[] = {
        {"true", CT__JBOOL, 1}, {"false", CT__JBOOL, 0}, {"null", CT__JNULL, 0}};
    for (size_t k = 0; k < sizeof lits / sizeof lits[0]; k++) {
        size_t wl = strlen(lits[k].word);
        if (p->len - p->i >= wl && !memcmp(p->t + p->i, lits[k].word, wl)) {
            self = new_node(p, lits[k].kind);
            if (self < 0) return -1;
            p->doc->nodes[self].ival = lits[k].v;
            p->i += wl;
            return self;
        }
    }
    perr(p, p->i, "unexpected character");
    return -1;
}

ct_status ct__json_parse(const char *text, size_t len, const char *what, ct__json_doc *doc)
{
    return ct__json_parse_as(text, len, what, "header JSON", "the file is corrupt or not safetensors", doc);
}

ct_status ct__json_parse_as(const char *text, size_t len, const char *what, const char *label,
                            const char *hint, ct__json_doc *doc)
{
    memset(doc, 0, sizeof *doc);
    size_t bad = ct__utf8_check(text, len);
    if (bad < len)
        return ct_error(CT_EFORMAT, "%s: %s is not valid UTF-8 at byte %zu; %s", what, label, bad, hint);
    /* Decoded strings plus their NULs never exceed the text: each string
     * spends two quotes on one NUL, and escapes only shrink. */
    doc->strs = ct_alloc_zeroed(len + 1, CT_MEM_OTHER);
    if (!doc->strs) return CT_ENOMEM;
    parser p = {text, len, 0, what, label, hint, doc, CT_OK};
    if (parse_value(&p, 0) < 0) goto fail;
    skip_ws(&p);
    if (p.i != len) {
        perr(&p, p.i, "trailing characters after the value");
        goto fail;
    }
    return CT_OK;
fail:
    ct__json_free(doc);
    return p.st;
}

void ct__json_free(ct__json_doc *doc)
{
    ct_free(doc->nodes);
    ct_free(doc->strs);
    memset(doc, 0, sizeof *doc);
}

/* ---- growable buffer --------------------------------------------------- */

static int buf_reserve(ct__buf *b, size_t extra)
{
    if (b->failed) return 0;
    if (b->len + extra + 1 <= b->cap) return 1;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1) cap *= 2;
    char *np = ct_alloc_zeroed(cap, CT_MEM_OTHER);
    if (!np) { b->failed = 1; return 0; }
    if (b->len) memcpy(np, b->p, b->len);
    ct_free(b->p);
    b->p = np;
    b->cap = cap;
    return 1;
}

void ct__buf_put(ct__buf *b, const void *data, size_t n)
{
    if (!buf_reserve(b, n)) return;
    memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = 0;
}

void ct__buf_puts(ct__buf *b, const char *s) { ct__buf_put(b, s, strlen(s)); }

void ct__buf_printf(ct__buf *b, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    CT_ASSERT(n >= 0 && (size_t)n < sizeof tmp); /* only short numeric pieces go through here */
    ct__buf_put(b, tmp, (size_t)n);
}

void ct__buf_json_str(ct__buf *b, const char *s, size_t n)
{
    ct__buf_put(b, "\"", 1);
    size_t run = 0; /* start of the bytes that need no escape, flushed in one go */
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char u[8];
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default:
            if (c < 0x20) {
                snprintf(u, sizeof u, "\\u%04x", c);
                esc = u;
            }
        }
        if (!esc) continue;
        ct__buf_put(b, s + run, i - run);
        ct__buf_puts(b, esc);
        run = i + 1;
    }
    ct__buf_put(b, s + run, n - run);
    ct__buf_put(b, "\"", 1);
}

void ct__buf_free(ct__buf *b)
{
    ct_free(b->p);
    memset(b, 0, sizeof *b);
}
