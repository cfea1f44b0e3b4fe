/* C unit tests of the shard core: CRC32C, layout, round trips, damage, range, kernel advice.
 * Run one group per process: `test_shard <group>` (ctest does this). */
#define _GNU_SOURCE
#include "shard.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int failures;
static char dir[256];

#define CHECK(cond)                                                                     \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);    \
            failures++;                                                                 \
        }                                                                               \
    } while (0)

#define CHECK_ERR(err, want)                                                            \
    do {                                                                                \
        if ((err).code != (want)) {                                                     \
            fprintf(stderr, "%s:%d: expected error %d, got %d: %s\n", __FILE__, __LINE__,  \
                    (want), (err).code, (err).msg);                                     \
            failures++;                                                                 \
        }                                                                               \
    } while (0)

enum { IMG = 48 }; /* uint8 image 3x4x4, then an int64 label: 56-byte records */

static void fields2(shard_field_t *f)
{
    memset(f, 0, 2 * sizeof *f);
    strcpy(f[0].name, "image");
    f[0].dtype = SHARD_U8;
    f[0].ndim = 3;
    f[0].shape[0] = 3;
    f[0].shape[1] = 4;
    f[0].shape[2] = 4;
    strcpy(f[1].name, "label");
    f[1].dtype = SHARD_I64;
    f[1].ndim = 0;
}

static void record(unsigned char *rec, uint64_t r)
{
    for (int b = 0; b < IMG; b++)
        rec[b] = (unsigned char)(r * 7 + (uint64_t)b);
    int64_t label = (int64_t)r * 3;
    memcpy(rec + IMG, &label, 8);
}

static void path_of(char *out, const char *name) { snprintf(out, 512, "%s/%s", dir, name); }

/* Write n records [first, first+n) to dir/name; returns 0 on success. */
static int make_shard(const char *name, uint64_t first, uint64_t n)
{
    shard_field_t f[2];
    shard_err_t err;
    char path[512];
    fields2(f);
    if (!shard_layout(f, 2, &err))
        return -1;
    path_of(path, name);
    shard_writer_t *w = shard_writer_open(path, f, 2, &err);
    if (!w)
        return -1;
    unsigned char rec[56];
    for (uint64_t r = first; r < first + n; r++) {
        memset(rec, 0, sizeof rec);
        record(rec, r);
        if (shard_writer_append(w, rec, 1, &err)) {
            shard_writer_abort(w);
            return -1;
        }
    }
    return shard_writer_close(w, &err) ? -1 : 0;
}

static unsigned char *slurp(const char *name, size_t *size)
{
    char path[512];
    path_of(path, name);
    FILE *fh = fopen(path, "rb");
    if (!fh)
        return NULL;
    fseek(fh, 0, SEEK_END);
    *size = (size_t)ftell(fh);
    fseek(fh, 0, SEEK_SET);
    unsigned char *buf = malloc(*size + 64);
    if (fread(buf, 1, *size, fh) != *size) {
        free(buf);
        buf = NULL;
    }
    fclose(fh);
    return buf;
}

static void spit(const char *name, const unsigned char *buf, size_t size)
{
    char path[512];
    path_of(path, name);
    FILE *fh = fopen(path, "wb");
    fwrite(buf, 1, size, fh);
    fclose(fh);
}

static uint32_t r32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t r64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static void w32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static void w64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }

/* Recompute header, index and trailer checksums after a deliberate edit, so the
 * check under test (not a checksum) is what catches it. */
static void reseal(unsigned char *b, size_t size)
{
    uint32_t nf = r32(b + 16);
    uint32_t c = shard_crc32c(0, b, 60);
    c = shard_crc32c(c, b + SHARD_HEADER_SIZE, (size_t)nf * SHARD_FIELD_SIZE);
    w32(b + 60, c);
    unsigned char *t = b + size - SHARD_TRAILER_SIZE;
    uint64_t count = r64(t + 8), index = r64(t + 16);
    if (index + count * 16 <= size)
        w32(t + 24, shard_crc32c(0, b + index, (size_t)(count * 16)));
    w32(t + 28, shard_crc32c(0, t, 28));
}

static shard_t *open_named(const char *name, int verify, shard_err_t *err)
{
    char path[512];
    path_of(path, name);
    return shard_open(path, verify, err);
}

/* ---- groups ---------------------------------------------------------- */

static void test_crc32c(void)
{
    CHECK(shard_crc32c(0, "123456789", 9) == 0xE3069283u);
    CHECK(shard_crc32c_portable(0, "123456789", 9) == 0xE3069283u);
    unsigned char zeros[32] = {0};
    CHECK(shard_crc32c(0, zeros, 32) == 0x8A9136AAu);
    static unsigned char buf[10000];
    for (int i = 0; i < 10000; i++)
        buf[i] = (unsigned char)(i * 31 + 7 + (i >> 8));
    /* Every alignment and many lengths (one stream, three short or long streams, and
     * mixtures): the hardware and table paths agree, and chaining works. */
    for (size_t off = 0; off < 9; off++)
        for (size_t len = 0; len < 9900; len += len < 400 ? 7 : 97) {
            uint32_t a = shard_crc32c(0, buf + off, len);
            CHECK(a == shard_crc32c_portable(0, buf + off, len));
            size_t half = len / 3;
            CHECK(a == shard_crc32c(shard_crc32c(0, buf + off, half), buf + off + half, len - half));
        }
}

static void test_layout(void)
{
    shard_field_t f[3];
    shard_err_t err;
    fields2(f);
    CHECK(shard_layout(f, 2, &err) == 56);
    CHECK(f[0].offset == 0 && f[0].size == 48);
    CHECK(f[1].offset == 48 && f[1].size == 8);
    /* A label before a 3-byte image: the image follows the label, the record pads to 8. */
    memset(f, 0, sizeof f);
    strcpy(f[0].name, "label");
    f[0].dtype = SHARD_I64;
    strcpy(f[1].name, "tag");
    f[1].dtype = SHARD_U8;
    f[1].ndim = 1;
    f[1].shape[0] = 3;
    strcpy(f[2].name, "w");
    f[2].dtype = SHARD_F32;
    CHECK(shard_layout(f, 3, &err) == 16);
    CHECK(f[2].offset == 12);
    /* Invalid schemas are refused with SHARD_E_ARG. */
    strcpy(f[2].name, "tag");
    CHECK(shard_layout(f, 3, &err) == 0);
    CHECK_ERR(err, SHARD_E_ARG);
    strcpy(f[2].name, "w");
    f[2].dtype = 99;
    CHECK(shard_layout(f, 3, &err) == 0);
    CHECK_ERR(err, SHARD_E_ARG);
    f[2].dtype = SHARD_F32;
    f[1].shape[0] = 0;
    CHECK(shard_layout(f, 3, &err) == 0);
    CHECK(shard_layout(f, 0, &err) == 0);
}

static int batch_ok(const unsigned char *img, const int64_t *lab, const int64_t *idx, size_t n,
                    uint64_t first)
{
    unsigned char want[56];
    for (size_t k = 0; k < n; k++) {
        record(want, (uint64_t)idx[k] + first);
        if (memcmp(img + k * IMG, want, IMG) != 0)
            return 0;
        if (lab[k] != (idx[k] + (int64_t)first) * 3)
            return 0;
    }
    return 1;
}

static void test_roundtrip(void)
{
    shard_err_t err;
    CHECK(make_shard("a.shard", 0, 1000) == 0);
    for (int verify = 0; verify < 3; verify++) {
        shard_t *s = open_named("a.shard", verify, &err);
        CHECK(s != NULL);
        if (!s)
            return;
        CHECK(shard_count(s) == 1000);
        CHECK(shard_record_size(s) == 56);
        CHECK(shard_n_fields(s) == 2);
        CHECK(strcmp(shard_field(s, 1)->name, "label") == 0);
        CHECK(shard_field(s, 2) == NULL);
        unsigned char img[300 * IMG];
        int64_t lab[300];
        int64_t idx[300];
        void *outs[2] = {img, lab};
        uint64_t start = 0;
        for (int k = 0; k < 300; k++)
            idx[k] = (k * 7919) % 1000;
        CHECK(shard_gather(&s, &start, 1, 1000, idx, 300, outs, &err) == SHARD_OK);
        CHECK(batch_ok(img, lab, idx, 300, 0));
        for (int k = 0; k < 300; k++)
            idx[k] = 500 + k; /* in order */
        CHECK(shard_gather(&s, &start, 1, 1000, idx, 300, outs, &err) == SHARD_OK);
        CHECK(batch_ok(img, lab, idx, 300, 0));
        CHECK(shard_gather(&s, &start, 1, 1000, idx, 0, outs, &err) == SHARD_OK);
        CHECK(shard_verify_all(s, &err) == SHARD_OK);
        uint32_t crc = 0;
        CHECK(shard_file_crc(s, &crc, &err) == SHARD_OK);
        size_t size;
        unsigned char *raw = slurp("a.shard", &size);
        CHECK(raw && crc == shard_crc32c(0, raw, size));
        CHECK(shard_file_size(s) == size);
        free(raw);
        CHECK(shard_prefetch(s, idx, 10, &err) == SHARD_OK);
        shard_close(s);
    }
}

static void test_multishard(void)
{
    shard_err_t err;
    CHECK(make_shard("m0.shard", 0, 10) == 0);
    CHECK(make_shard("m1.shard", 10, 15) == 0);
    CHECK(make_shard("m2.shard", 25, 1) == 0);
    shard_t *s[3] = {open_named("m0.shard", 1, &err), open_named("m1.shard", 1, &err),
                     open_named("m2.shard", 1, &err)};
    CHECK(s[0] && s[1] && s[2]);
    if (!s[0] || !s[1] || !s[2])
        return;
    uint64_t starts[3] = {0, 10, 25};
    int64_t idx[26];
    for (int k = 0; k < 26; k++)
        idx[k] = (k * 11) % 26;
    unsigned char img[26 * IMG];
    int64_t lab[26];
    void *outs[2] = {img, lab};
    CHECK(shard_gather(s, starts, 3, 26, idx, 26, outs, &err) == SHARD_OK);
    CHECK(batch_ok(img, lab, idx, 26, 0));
    for (int k = 0; k < 26; k++)
        idx[k] = k;
    CHECK(shard_gather(s, starts, 3, 26, idx, 26, outs, &err) == SHARD_OK);
    CHECK(batch_ok(img, lab, idx, 26, 0));
    idx[0] = 26;
    CHECK(shard_gather(s, starts, 3, 26, idx, 1, outs, &err) == SHARD_E_RANGE);

    /* Same schema, another layout (label first, then the image): still read right. */
    shard_field_t f[2];
    char path[512];
    fields2(f);
    f[1].size = 8;
    f[1].offset = 0;
    f[0].size = IMG;
    f[0].offset = 8;
    path_of(path, "m1.shard");
    shard_writer_t *w = shard_writer_open(path, f, 2, &err);
    CHECK(w != NULL);
    if (w) {
        CHECK(shard_writer_record_size(w) == 56);
        unsigned char rec[56], flip[56];
        for (uint64_t r = 10; r < 25; r++) {
            record(rec, r);
            memcpy(flip, rec + IMG, 8);
            memcpy(flip + 8, rec, IMG);
            CHECK(shard_writer_append(w, flip, 1, &err) == SHARD_OK);
        }
        CHECK(shard_writer_close(w, &err) == SHARD_OK);
    }
    shard_close(s[1]);
    s[1] = open_named("m1.shard", 1, &err);
    CHECK(s[1] != NULL && shard_field(s[1], 0)->offset == 8);
    for (int k = 0; k < 26; k++)
        idx[k] = (k * 11) % 26;
    CHECK(shard_gather(s, starts, 3, 26, idx, 26, outs, &err) == SHARD_OK);
    CHECK(batch_ok(img, lab, idx, 26, 0));
    for (int i = 0; i < 3; i++)
        shard_close(s[i]);
}

static int exists(const char *name)
{
    char path[512];
    struct stat st;
    path_of(path, name);
    return stat(path, &st) == 0;
}

static int temp_files(void)
{
    int n = 0;
    DIR *d = opendir(dir);
    struct dirent *e;
    while ((e = readdir(d)))
        if (strstr(e->d_name, ".tmp-"))
            n++;
    closedir(d);
    return n;
}

static void test_writer(void)
{
    shard_field_t f[2];
    shard_err_t err;
    char path[512];
    fields2(f);
    shard_layout(f, 2, &err);
    path_of(path, "w.shard");
    unsigned char rec[56] = {0};

    /* Until close, nothing is at the target path. */
    shard_writer_t *w = shard_writer_open(path, f, 2, &err);
    CHECK(w != NULL);
    CHECK(shard_writer_append(w, rec, 1, &err) == SHARD_OK);
    CHECK(!exists("w.shard"));
    CHECK(temp_files() == 1);
    shard_writer_abort(w);
    CHECK(!exists("w.shard"));
    CHECK(temp_files() == 0);

    /* An empty shard is refused and leaves no file. */
    w = shard_writer_open(path, f, 2, &err);
    CHECK(shard_writer_close(w, &err) == SHARD_E_EMPTY);
    CHECK(!exists("w.shard"));
    CHECK(temp_files() == 0);

    /* Replacing an existing shard is atomic: the old one stays valid until close. */
    CHECK(make_shard("w.shard", 0, 5) == 0);
    w = shard_writer_open(path, f, 2, &err);
    record(rec, 100);
    CHECK(shard_writer_append(w, rec, 1, &err) == SHARD_OK);
    shard_t *old = open_named("w.shard", 2, &err);
    CHECK(old && shard_count(old) == 5);
    shard_close(old);
    CHECK(shard_writer_close(w, &err) == SHARD_OK);
    shard_t *s = open_named("w.shard", 2, &err);
    CHECK(s && shard_count(s) == 1);
    shard_close(s);
    CHECK(temp_files() == 0);

    /* A writer for a directory that does not exist fails cleanly. */
    w = shard_writer_open("/nonexistent-dir/x.shard", f, 2, &err);
    CHECK(w == NULL);
    CHECK_ERR(err, SHARD_E_IO);
}

static void expect_open_error(const char *name, int code, int64_t record, int64_t offset)
{
    shard_err_t err;
    shard_t *s = open_named(name, 1, &err);
    CHECK(s == NULL);
    if (s) {
        fprintf(stderr, "  (%s opened but should not)\n", name);
        shard_close(s);
        return;
    }
    CHECK_ERR(err, code);
    if (record != -2)
        CHECK(err.record == record);
    if (offset != -2 && err.offset != offset) {
        fprintf(stderr, "  %s: offset %lld, expected %lld (%s)\n", name, (long long)err.offset,
                (long long)offset, err.msg);
        failures++;
    }
    CHECK(strstr(err.msg, name) != NULL); /* the message names the file */
}

static void test_damage(void)
{
    CHECK(make_shard("good.shard", 0, 20) == 0);
    size_t size;
    unsigned char *good = slurp("good.shard", &size);
    unsigned char *b = malloc(size + 64);
    uint64_t index = r64(good + 48), data = r64(good + 40);

    spit("t0.shard", good, 0);
    expect_open_error("t0.shard", SHARD_E_TRUNCATED, -1, -2);
    spit("t50.shard", good, 50);
    expect_open_error("t50.shard", SHARD_E_TRUNCATED, -1, -2);
    spit("thalf.shard", good, size / 2);
    expect_open_error("thalf.shard", SHARD_E_TRUNCATED, -1, -2);
    spit("t1.shard", good, size - 1);
    expect_open_error("t1.shard", SHARD_E_TRUNCATED, -1, -2);

    memcpy(b, good, size);
    memcpy(b + size, "garbage!", 8);
    spit("tail.shard", b, size + 8);
    expect_open_error("tail.shard", SHARD_E_TRUNCATED, -1, (int64_t)(size + 8 - 32));

    memcpy(b, good, size);
    b[0] = 'X';
    spit("magic.shard", b, size);
    expect_open_error("magic.shard", SHARD_E_MAGIC, -1, 0);

    memcpy(b, good, size);
    w32(b + 8, 2);
    reseal(b, size);
    spit("version.shard", b, size);
    expect_open_error("version.shard", SHARD_E_VERSION, -1, 8);

    memcpy(b, good, size);
    b[SHARD_HEADER_SIZE + 1] ^= 0x20; /* field name */
    spit("hcrc.shard", b, size);
    expect_open_error("hcrc.shard", SHARD_E_HEADER, -1, 60);

    memcpy(b, good, size);
    w64(b + SHARD_HEADER_SIZE + SHARD_FIELD_SIZE + 120, 16); /* label claims 16 bytes */
    reseal(b, size);
    spit("fsize.shard", b, size);
    expect_open_error("fsize.shard", SHARD_E_HEADER, -1, -2);

    memcpy(b, good, size);
    b[size - 5] ^= 1; /* trailer checksum */
    spit("tcrc.shard", b, size);
    expect_open_error("tcrc.shard", SHARD_E_HEADER, -1, (int64_t)(size - 4));

    memcpy(b, good, size);
    w64(b + index + 3 * 16, size + 4096); /* record 3 beyond the file */
    reseal(b, size);
    spit("outside.shard", b, size);
    expect_open_error("outside.shard", SHARD_E_INDEX, 3, (int64_t)(index + 3 * 16));

    memcpy(b, good, size);
    w64(b + index + 3 * 16, index - 10); /* record 3 runs into the index */
    reseal(b, size);
    spit("intoindex.shard", b, size);
    expect_open_error("intoindex.shard", SHARD_E_INDEX, 3, (int64_t)(index + 3 * 16));

    memcpy(b, good, size);
    w64(b + index + 0 * 16, data - 8); /* record 0 inside the header */
    reseal(b, size);
    spit("before.shard", b, size);
    expect_open_error("before.shard", SHARD_E_INDEX, 0, (int64_t)index);

    memcpy(b, good, size);
    memcpy(b + index + 2 * 16, good + index + 3 * 16, 16); /* unsorted: swap 2 and 3 */
    memcpy(b + index + 3 * 16, good + index + 2 * 16, 16);
    reseal(b, size);
    spit("unsorted.shard", b, size);
    expect_open_error("unsorted.shard", SHARD_E_INDEX, 3, (int64_t)(index + 3 * 16));

    memcpy(b, good, size);
    w64(b + index + 4 * 16, r64(good + index + 3 * 16) + 8); /* 4 overlaps 3 */
    reseal(b, size);
    spit("overlap.shard", b, size);
    expect_open_error("overlap.shard", SHARD_E_INDEX, 4, (int64_t)(index + 4 * 16));

    memcpy(b, good, size);
    w32(b + index + 5 * 16 + 8, 55); /* wrong record length */
    reseal(b, size);
    spit("length.shard", b, size);
    expect_open_error("length.shard", SHARD_E_INDEX, 5, (int64_t)(index + 5 * 16 + 8));

    memcpy(b, good, size);
    b[index + 7 * 16 + 12] ^= 1; /* a record checksum in the index, index crc not updated */
    spit("icrc.shard", b, size);
    expect_open_error("icrc.shard", SHARD_E_INDEX, -1, (int64_t)index);

    /* An empty shard: header, field table, no records, no index, trailer. */
    size_t esize = (size_t)data + SHARD_TRAILER_SIZE;
    memcpy(b, good, (size_t)data);
    w64(b + 24, 0);
    w64(b + 48, data);
    unsigned char *t = b + data;
    memcpy(t, good + size - SHARD_TRAILER_SIZE, SHARD_TRAILER_SIZE);
    w64(t + 8, 0);
    w64(t + 16, data);
    reseal(b, esize);
    spit("empty.shard", b, esize);
    expect_open_error("empty.shard", SHARD_E_EMPTY, -1, 24);

    /* A damaged record opens (structure is intact) but fails when read or verified. */
    uint64_t off5 = r64(good + index + 5 * 16);
    memcpy(b, good, size);
    b[off5 + 3] ^= 0x40;
    spit("data.shard", b, size);
    shard_err_t err;
    for (int verify = 1; verify <= 2; verify++) {
        shard_t *s = open_named("data.shard", verify, &err);
        CHECK(s != NULL);
        if (!s)
            continue;
        unsigned char img[2 * IMG];
        int64_t lab[2];
        void *outs[2] = {img, lab};
        uint64_t start = 0;
        int64_t idx[2] = {4, 5};
        CHECK(shard_gather(&s, &start, 1, 20, idx, 1, outs, &err) == SHARD_OK);
        CHECK(shard_gather(&s, &start, 1, 20, idx, 2, outs, &err) == SHARD_E_CHECKSUM);
        CHECK(err.record == 5 && err.offset == (int64_t)off5);
        CHECK(strstr(err.msg, "data.shard") && strstr(err.msg, "record 5"));
        CHECK(shard_verify_all(s, &err) == SHARD_E_CHECKSUM);
        CHECK(err.record == 5);
        shard_close(s);
    }
    shard_t *s = open_named("data.shard", SHARD_VERIFY_NEVER, &err);
    CHECK(s != NULL);
    shard_close(s);

    expect_open_error("missing.shard", SHARD_E_IO, -1, -2);
    free(b);
    free(good);
}

static void test_range(void)
{
    shard_err_t err;
    CHECK(make_shard("r.shard", 0, 10) == 0);
    shard_t *s = open_named("r.shard", 1, &err);
    CHECK(s != NULL);
    if (!s)
        return;
    unsigned char img[3 * IMG];
    int64_t lab[3] = {-7, -7, -7};
    void *outs[2] = {img, lab};
    uint64_t start = 0;
    int64_t bad[][3] = {{0, 1, 10}, {-1, 0, 1}, {0, INT64_MIN, 2}, {INT64_MAX, 0, 0}};
    for (int c = 0; c < 4; c++) {
        CHECK(shard_gather(&s, &start, 1, 10, bad[c], 3, outs, &err) == SHARD_E_RANGE);
        CHECK(strstr(err.msg, "r.shard") != NULL);
        CHECK(lab[0] == -7); /* nothing was copied */
    }
    CHECK(shard_prefetch(s, bad[0], 3, &err) == SHARD_E_RANGE);
    shard_close(s);
}

static void test_advice(void)
{
    shard_err_t err;
    CHECK(make_shard("adv.shard", 0, 40000) == 0); /* about 2.2 MB */
    shard_t *s = open_named("adv.shard", 0, &err);
    CHECK(s != NULL);
    if (!s)
        return;
    enum { B = 1000 };
    static unsigned char img[B * IMG];
    static int64_t lab[B];
    int64_t idx[B];
    void *outs[2] = {img, lab};
    uint64_t start = 0;
    /* In order: pages behind the reader are dropped as it moves on. */
    shard_set_readahead(s, 64 << 10);
    for (int b = 0; b < 40; b++) {
        for (int k = 0; k < B; k++)
            idx[k] = b * B + k;
        CHECK(shard_gather(&s, &start, 1, 40000, idx, B, outs, &err) == SHARD_OK);
        CHECK(batch_ok(img, lab, idx, B, 0));
    }
    uint64_t seq = shard_released_bytes(s);
    CHECK(seq > 1000000);
    /* The next epoch starts over from record 0 and drops pages behind it again. */
    for (int b = 0; b < 40; b++) {
        for (int k = 0; k < B; k++)
            idx[k] = b * B + k;
        CHECK(shard_gather(&s, &start, 1, 40000, idx, B, outs, &err) == SHARD_OK);
    }
    CHECK(shard_released_bytes(s) > seq + 1000000);
    seq = shard_released_bytes(s);
    /* Shuffled: the mapping is dropped whenever the touched-bytes budget is spent,
     * and the data read afterwards is still right. */
    shard_set_release_budget(s, 200000);
    for (int b = 0; b < 20; b++) {
        for (int k = 0; k < B; k++)
            idx[k] = (int64_t)(((uint64_t)(b * B + k) * 2654435761u) % 40000);
        CHECK(shard_gather(&s, &start, 1, 40000, idx, B, outs, &err) == SHARD_OK);
        CHECK(batch_ok(img, lab, idx, B, 0));
    }
    CHECK(shard_released_bytes(s) > seq);
    shard_close(s);
}

static void test_shrink(void)
{
    shard_err_t err;
    char path[512];
    CHECK(make_shard("shrink.shard", 0, 40000) == 0); /* about 2.2 MB */
    shard_t *s = open_named("shrink.shard", 0, &err);
    CHECK(s != NULL);
    if (!s)
        return;
    path_of(path, "shrink.shard");
    CHECK(truncate(path, 100000) == 0); /* another program shortens it in place */
    unsigned char img[2 * IMG];
    int64_t lab[2];
    void *outs[2] = {img, lab};
    uint64_t start = 0;
    int64_t idx[2] = {0, 39999};
    CHECK(shard_gather(&s, &start, 1, 40000, idx, 1, outs, &err) == SHARD_OK);
    CHECK(batch_ok(img, lab, idx, 1, 0));
    CHECK(shard_gather(&s, &start, 1, 40000, idx, 2, outs, &err) == SHARD_E_TRUNCATED);
    CHECK(strstr(err.msg, "shrink.shard") && strstr(err.msg, "truncated while in use"));
    CHECK(err.offset >= 100000);
    CHECK(shard_verify_all(s, &err) == SHARD_E_TRUNCATED);
    uint32_t crc;
    CHECK(shard_file_crc(s, &crc, &err) == SHARD_E_TRUNCATED);
    /* Still usable for what is left, and later faults are caught again. */
    CHECK(shard_gather(&s, &start, 1, 40000, idx, 1, outs, &err) == SHARD_OK);
    CHECK(shard_gather(&s, &start, 1, 40000, idx + 1, 1, outs, &err) == SHARD_E_TRUNCATED);
    shard_close(s);
}

/* Records with a big field take the grouped AVX2 path: image 3x32x32 bytes, then a label. */
enum { BIG = 3072, BREC = 3080 };

static void big_record(unsigned char *rec, uint64_t r, int label_first)
{
    unsigned char img[BIG];
    for (int b = 0; b < BIG; b++)
        img[b] = (unsigned char)(r * 131 + (uint64_t)b * 7 + (uint64_t)(b >> 8));
    int64_t label = (int64_t)r * 5 + 1;
    memcpy(rec + (label_first ? 8 : 0), img, BIG);
    memcpy(rec + (label_first ? 0 : BIG), &label, 8);
}

static int make_big(const char *name, uint64_t first, uint64_t n, int label_first)
{
    shard_field_t f[2];
    shard_err_t err;
    char path[512];
    memset(f, 0, sizeof f);
    strcpy(f[0].name, "image");
    f[0].dtype = SHARD_U8;
    f[0].ndim = 3;
    f[0].shape[0] = 3;
    f[0].shape[1] = 32;
    f[0].shape[2] = 32;
    strcpy(f[1].name, "label");
    f[1].dtype = SHARD_I64;
    if (!shard_layout(f, 2, &err))
        return -1;
    if (label_first) {
        f[1].offset = 0;
        f[0].offset = 8;
    }
    path_of(path, name);
    shard_writer_t *w = shard_writer_open(path, f, 2, &err);
    if (!w)
        return -1;
    unsigned char rec[BREC];
    for (uint64_t r = first; r < first + n; r++) {
        big_record(rec, r, label_first);
        if (shard_writer_append(w, rec, 1, &err)) {
            shard_writer_abort(w);
            return -1;
        }
    }
    return shard_writer_close(w, &err) ? -1 : 0;
}

static int big_ok(const unsigned char *img, const int64_t *lab, const int64_t *idx, size_t n)
{
    unsigned char want[BREC];
    for (size_t k = 0; k < n; k++) {
        big_record(want, (uint64_t)idx[k], 0);
        if (memcmp(img + k * BIG, want, BIG) != 0 || lab[k] != idx[k] * 5 + 1) {
            fprintf(stderr, "  batch position %zu (record %lld) differs\n", k, (long long)idx[k]);
            return 0;
        }
    }
    return 1;
}

static void test_wide(void)
{
    shard_err_t err;
    CHECK(make_big("b0.shard", 0, 300, 0) == 0);
    CHECK(make_big("b1.shard", 300, 200, 1) == 0); /* another layout, same schema */
    shard_t *s[2] = {open_named("b0.shard", 1, &err), open_named("b1.shard", 2, &err)};
    CHECK(s[0] && s[1]);
    if (!s[0] || !s[1])
        return;
    uint64_t starts[2] = {0, 300};
    static unsigned char img[37 * BIG];
    int64_t lab[37], idx[37];
    void *outs[2] = {img, lab};
    for (size_t n = 1; n <= 37; n += 3) {
        for (size_t k = 0; k < n; k++)
            idx[k] = (int64_t)((k * 7919 + n * 31) % 500);
        CHECK(shard_gather(s, starts, 2, 500, idx, n, outs, &err) == SHARD_OK);
        CHECK(big_ok(img, lab, idx, n));
        CHECK(shard_gather(s, starts, 1, 300, idx, n, outs, &err) == SHARD_OK ||
              err.code == SHARD_E_RANGE);
        for (size_t k = 0; k < n; k++)
            idx[k] = (int64_t)(290 + k); /* in order, across the shard boundary */
        CHECK(shard_gather(s, starts, 2, 500, idx, n, outs, &err) == SHARD_OK);
        CHECK(big_ok(img, lab, idx, n));
    }
    shard_close(s[0]);
    shard_close(s[1]);

    /* A damaged record in the middle of a group is reported, by record and offset. */
    size_t size;
    unsigned char *b = slurp("b0.shard", &size);
    uint64_t data = r64(b + 40);
    b[data + 6 * BREC + 100] ^= 1;
    spit("b0bad.shard", b, size);
    free(b);
    shard_t *bad = open_named("b0bad.shard", 1, &err);
    CHECK(bad != NULL);
    if (!bad)
        return;
    int64_t ids[5] = {4, 5, 6, 7, 8};
    uint64_t zero = 0;
    CHECK(shard_gather(&bad, &zero, 1, 300, ids, 5, outs, &err) == SHARD_E_CHECKSUM);
    CHECK(err.record == 6 && err.offset == (int64_t)(data + 6 * BREC));
    CHECK(shard_gather(&bad, &zero, 1, 300, ids, 2, outs, &err) == SHARD_OK);
    CHECK(big_ok(img, lab, ids, 2));
    shard_close(bad);
}

static void cleanup(void)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    char path[600];
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            unlink(path);
        }
    closedir(d);
    rmdir(dir);
}

int main(int argc, char **argv)
{
    static const struct {
        const char *name;
        void (*fn)(void);
    } groups[] = {{"crc32c", test_crc32c},       {"layout", test_layout},
                  {"roundtrip", test_roundtrip}, {"multishard", test_multishard},
                  {"writer", test_writer},       {"damage", test_damage},
                  {"range", test_range},         {"advice", test_advice},
                  {"shrink", test_shrink},       {"wide", test_wide}};
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/shardtest-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 2;
    }
    int ran = 0;
    for (size_t g = 0; g < sizeof groups / sizeof groups[0]; g++)
        if (argc < 2 || strcmp(argv[1], groups[g].name) == 0) {
            int before = failures;
            groups[g].fn();
            printf("%-10s %s\n", groups[g].name, failures == before ? "ok" : "FAILED");
            ran++;
        }
    cleanup();
    if (!ran) {
        fprintf(stderr, "unknown test group %s\n", argv[1]);
        return 2;
    }
    return failures ? 1 : 0;
}
